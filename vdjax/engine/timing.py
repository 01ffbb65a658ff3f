"""Compile-time measurements: warm timings with compilation taken out, program counts.

    gen, ttft_s, decode_s, compile_s = timed_run(params, ids, "valuediff", 256)
    with count_compiles() as n: vdjax.generate(...)   # n.value: XLA programs compiled inside the block

Every (policy, budget, length bucket) compiles its own prefill and decode programs on first use; JAX reports
the time it spends tracing, lowering and compiling through `jax.monitoring`, which is how the compile time is
measured apart from the warm time to first token and decode rate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import jax.monitoring

from vdjax.engine.api import run

COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def union_seconds(spans, lo: float, hi: float) -> float:
    """Total length of the union of (start, end) spans clipped to [lo, hi]."""
    total, reach = 0.0, lo
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total, reach = total + end - start, end
    return total


@contextlib.contextmanager
def compile_spans():
    """Collect the wall-clock (start, end, thread) spans of JAX tracing, lowering and compiling inside the
    block; thread is the `threading.get_ident()` of the thread that compiled (`compiler.BACKGROUND` compiles
    the decode program in a thread of its own while the prefill runs)."""
    spans: list[tuple[float, float, int]] = []

    def listener(event, start, end, **_):
        if event in COMPILE_EVENTS:
            spans.append((start, end, threading.get_ident()))

    jax.monitoring.register_event_time_span_listener(listener)
    try:
        yield spans
    finally:
        jax.monitoring.unregister_event_time_span_listener(listener)


@dataclasses.dataclass
class Count:
    """A counter filled by `count_compiles`."""

    value: int = 0


@contextlib.contextmanager
def count_compiles():
    """Count the XLA programs compiled (or loaded from the persistent cache) inside the block: `n.value`."""
    count = Count()

    def listener(event, duration, **_):
        if event == BACKEND_COMPILE:
            count.value += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def timed_run(params, ids, policy, budget, **kwargs):
    """`run` plus warm timings: (generation, ttft_s, decode_s, compile_s), compile time taken out."""
    with compile_spans() as spans:
        start = time.time()
        gen = run(params, ids, policy, budget, **kwargs)
        end = time.time()
    boundary = end - gen.decode_s  # prefill (and its compile) ends here, decoding begins
    c_prefill, c_decode, total = compile_split(spans, start, boundary, end, threading.get_ident())
    return gen, max(gen.prefill_s - c_prefill, 0.0), max(gen.decode_s - c_decode, 0.0), total


def compile_split(spans, start: float, boundary: float, end: float, me: int) -> tuple[float, float, float]:
    """Compile seconds (in the prefill's time, in the decode's time, in all) from `compile_spans` of a call
    that prefilled in [start, boundary] and decoded in [boundary, end] on thread `me`. Another thread's
    compiling during the prefill (the decode program, `compiler.BACKGROUND`) ran beside it, so it is not taken
    out of the prefill's time; whatever of it the decode waited for is taken out of the decode's."""
    here = [(a, b) for a, b, t in spans if t == me]
    every = [(a, b) for a, b, _ in spans]
    return (union_seconds(here, start, boundary), union_seconds(every, boundary, end),
            union_seconds(every, start, end))

"""`vdjax demo`: the paper's thesis in about a minute on the two real models this machine has.

SmolLM2-135M (Llama-style, no sink suppression: its heads park attention on the first token) and
Gemma3-270M (QK-norm: *sink-suppressed*) each answer needle-in-a-haystack prompts at three depths with the
cache cut to 25 % of the prompt, under a handful of policies (`--all`: every one). Each model's KV geometry
is measured on the demo prompt itself and printed in one line (σV/σK, BOS key cosine, sink rate); the verdict
line says which scorer family kept the needle where. Output fits 80 columns, and progress goes to stderr
as plain lines (visible in a log file too).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

MODELS = ("smollm2-135m", "gemma3-270m")
POLICIES = ("dense", "streaming", "keydiff", "valuediff")
DEPTHS = (0.25, 0.5, 0.75)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def geometry_line(params, ids) -> tuple[str, dict]:
    """One line of KV geometry (σV/σK, BOS key cosine, sink rate) measured on one prompt, and its numbers."""
    from vdjax.analysis import geometry as G

    agg = G.analyze(params, [ids], topk=0).aggregate()
    mech = G.mechanism(params.config)
    kind = "no sink suppression" if mech == "none" else f"sink-suppressed: {mech}"
    return (f"σV/σK {agg['ratio']:.2f}  BOS key cos {agg['bos_cos']:.2f}  sink rate {agg['sink_rate']:.2f} "
            f"({kind})"), agg | {"kind": kind}


def run_model(model: str, policies, *, length: int, block: int, max_new: int, seed: int, budget=None,
              layer_scan: bool | None = None) -> dict:
    """Every policy on the needle prompts of one model -> {"policies": {name: row}, "geometry": ..., ...}."""
    import jax

    import vdjax
    from vdjax.app.needle import is_correct, needle_prompt
    from vdjax.engine.timing import timed_run

    t = time.perf_counter()
    params, tok = vdjax.load(model), vdjax.load_tokenizer(model)
    _log(f"[{model}] loaded in {time.perf_counter() - t:.0f} s")
    prompts = [needle_prompt(tok, length, depth=d, seed=seed + i) for i, d in enumerate(DEPTHS)]
    n = budget or max(64, 64 * round(min(p.n_tokens for p in prompts) / 4 / 64))
    t = time.perf_counter()
    line, geo = geometry_line(params, prompts[1].ids)
    _log(f"[{model}] geometry in {time.perf_counter() - t:.0f} s: {line}")
    rows = {}
    for name in policies:
        dense = vdjax.get_policy(name).is_dense
        gen, ttft, _, compile_s = timed_run(params, [p.ids for p in prompts], name, None if dense else n,
                                            block_size=block, max_new_tokens=max_new,
                                            key=jax.random.key(seed), layer_scan=layer_scan)
        texts = [tok.decode(list(r), skip_special_tokens=True) for r in gen.tokens]
        found = sum(is_correct(x, p.answer) for x, p in zip(texts, prompts, strict=True))
        rows[name] = {"found": found, "answer": (texts[1].strip().splitlines() or [""])[0], "ttft": ttft,
                      "compile": compile_s}
        _log(f"[{model}] {name:<18} found {found}/{len(prompts)}  TTFT {ttft:.2f} s  "
             f"compile {compile_s:.1f} s")
    return {"model": model, "budget": n, "tokens": prompts[1].n_tokens, "geometry": geo, "line": line,
            "policies": rows, "answer_key": prompts[1].answer}


def table(res: dict) -> list[str]:
    """A model's block of the report: header, geometry line, one row per policy (80 columns)."""
    out = [f"{_short(res['model'])}: {res['tokens']} tokens, budget N={res['budget']} (25 %), needle at "
           f"depths {', '.join(f'{d:g}' for d in DEPTHS)}", f"  geometry  {res['line']}",
           f"  {'policy':<18} {'found':>5}  {'answer (depth 0.5)':<24} {'TTFT s':>7} {'compile s':>9}"]
    for name, r in res["policies"].items():
        ans = r["answer"][:24]
        out.append(f"  {name:<18} {r['found']:>3}/{len(DEPTHS)}  {ans:<24} "
                   f"{r['ttft']:>7.2f} {r['compile']:>9.1f}")
    return out


def verdict(results: list[dict]) -> str:
    """Which of ValueDiff and KeyDiff kept more needles on each model, beside its sink rate."""
    parts = []
    for r in results:
        p = r["policies"]
        if "valuediff" in p and "keydiff" in p:
            vd, kd = p["valuediff"]["found"], p["keydiff"]["found"]
            best = "valuediff" if vd > kd else "keydiff" if kd > vd else "a tie"
            parts.append(f"{_short(r['model'])} ({r['geometry']['kind']}): valuediff {vd}, keydiff {kd} "
                         f"-> {best}")
    if not parts:
        return "verdict: run valuediff and keydiff to compare them"
    return ("verdict (the paper: value scores win where sinks are suppressed, key scores where they "
            "dominate): " + "; ".join(parts))


def run_demo(models=MODELS, policies=POLICIES, *, length: int = 1024, block: int = 128, max_new: int = 12,
             seed: int = 0, budget=None, write: Callable[[str], None] = print,
             layer_scan: bool | None = True) -> list[dict]:
    """The demo: every model, every policy; the report through `write`, progress to stderr.

    Each program runs once, so compiling dominates: the layers are scanned by default (on CPU 112 s vs 137 s
    for the whole demo, bench/README.md)."""
    wall = time.perf_counter()
    results = [run_model(m, policies, length=length, block=block, max_new=max_new, seed=seed, budget=budget,
                         layer_scan=layer_scan) for m in models]
    for r in results:
        for ln in table(r):
            write(ln)
        write("")
    for ln in _wrap(verdict(results)):
        write(ln)
    write(f"total {time.perf_counter() - wall:.0f} s (TTFT with compile taken out; greedy, {max_new} new "
          "tokens)")
    return results


def _short(model: str) -> str:
    """A model's display name: a registered name or Hub id as is, a folder by its last part."""
    from pathlib import Path

    return Path(model).name if Path(model).exists() else model


def _wrap(text: str, width: int = 80) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width, subsequent_indent="  ")

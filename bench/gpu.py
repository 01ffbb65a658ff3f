#!/usr/bin/env python
"""GPU benchmark: time to first token and peak device memory of block prefill at 32k and 128k tokens.

    python bench/gpu.py                                  # Qwen3-4B shape, bf16, 32k + 128k, B=128, N=2048
    python bench/gpu.py --lengths 32768 --policies valuediff
    python bench/gpu.py --tiny --allow-cpu               # a small shape on CPU: checks the script runs

One self-contained script for one call on a machine with a GPU. The model is random-initialised with the
shape of Qwen3-4B (36 layers, hidden 2560, 32 query / 8 KV heads of 128, MLP 9728, vocab 151936, q/k-norm) in
bf16: speed and memory do not depend on the weights' values. For each prompt length and policy (dense,
streaming, valuediff) a fresh subprocess compiles the prefill ahead of time, then times one prefill (block
B=128, cache N=2048; dense keeps everything) to the first token, and reads the device's peak memory.

Each TTFT sits next to the weight-streaming floor: every block reads every weight once, so a prefill cannot
beat weight bytes x blocks / memory bandwidth (bandwidth measured here with a large on-device copy). Target:
TTFT within 2x of that floor. The paper reports 61.5 s on an H100 (PyTorch) for a 4B model at 128k.
Where no GPU is visible it says so and measures nothing (exit 0), unless --allow-cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

QWEN3_4B = dict(family="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                tie_embeddings=True, qk_norm=True, max_position_embeddings=262144)
TINY = dict(QWEN3_4B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=64)
PAPER_TTFT_128K_H100_S = 61.5


def random_params(shape: dict, seed: int = 0):
    """Random bf16 Params of `shape` (every weight its family spec declares), drawn on the default device."""
    import jax.numpy as jnp

    from vdjax.models.config import ModelConfig
    from vdjax.models.spec import init_params

    return init_params(ModelConfig(**shape), seed, scale=0.02, dtype=jnp.bfloat16, on_device=True)


def bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device memory bandwidth (GB/s): best of 5 on-device copies x -> x + 1 of `nbytes` bf16 (read + write)."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    bump = jax.jit(lambda a: a + 1)
    bump(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        bump(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def worker(a) -> dict:
    """One (length, policy) measurement in this process: AOT compile, one timed prefill, peak memory."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from vdjax.pipeline import compile_prefill

    params = random_params(TINY if a.tiny else QWEN3_4B)
    weight_bytes = params.nbytes()
    ids = np.random.default_rng(0).integers(0, params.config.vocab_size, a.length, dtype=np.int32)
    budget = None if a.policy == "dense" else a.budget
    t = time.perf_counter()
    program = compile_prefill(params, ids, a.policy, budget, a.block)
    compile_s = time.perf_counter() - t
    p = program.plan
    t = time.perf_counter()
    cache, logits = program()
    first = int(jnp.argmax(logits[0]))  # the first token: what TTFT waits for
    ttft = time.perf_counter() - t
    stats = jax.devices()[0].memory_stats() or {}
    return {"length": a.length, "policy": a.policy, "ttft_s": ttft, "compile_s": compile_s, "first_token": first,
            "blocks": int(p.tokens.shape[1] // p.block), "slots": p.slots, "weight_bytes": weight_bytes,
            "cache_bytes": cache.nbytes(), "peak_bytes": stats.get("peak_bytes_in_use"),
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend()}


def secs(x: float) -> str:
    """Seconds with two decimals, or three significant digits below 1 s (a tiny CPU floor is not 0.00)."""
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--policies", default="dense,streaming,valuediff")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true", help="a small model shape (for a CPU smoke run)")
    ap.add_argument("--allow-cpu", action="store_true", help="measure even where no GPU is visible")
    ap.add_argument("--out", default="results/gpu.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a)))
        return 0

    import jax

    backend = jax.default_backend()
    if backend != "gpu" and not a.allow_cpu:
        print(f"No GPU visible: jax.default_backend() = {backend!r}, devices {jax.devices()}. This benchmark needs a "
              "GPU with a CUDA jaxlib (pip install 'jax[cuda12]'); nothing was measured.")
        return 0
    lengths = [int(x) for x in a.lengths.split(",")] if not a.tiny or a.lengths != "32768,131072" else [1024, 2048]
    budget = a.budget if not a.tiny or a.budget != 2048 else 256
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    bw = bandwidth_gbs((2 << 30) if backend == "gpu" else (256 << 20))
    print(f"backend {backend}, device {jax.devices()[0].device_kind}, measured bandwidth {bw:.0f} GB/s")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # peak_bytes_in_use then means what was used
    rows = []
    for length in lengths:
        for policy in policies:
            cmd = [sys.executable, __file__, "--worker", "--length", str(length), "--policy", policy,
                   "--block", str(a.block), "--budget", str(budget)] + (["--tiny"] if a.tiny else [])
            t = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not found:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                print(f"{length} {policy}: FAILED ({' | '.join(tail)})")
                rows.append({"length": length, "policy": policy, "error": " | ".join(tail)})
                continue
            r = json.loads(found[0][7:])
            r["floor_s"] = r["weight_bytes"] * r["blocks"] / (bw * 1e9)
            rows.append(r)
            print(f"{length} {policy}: TTFT {secs(r['ttft_s'])} s (floor {secs(r['floor_s'])} s), compile "
                  f"{r['compile_s']:.1f} s, wall {time.perf_counter() - t:.0f} s")
    head = ("| prompt | policy | N | TTFT (s) | floor (s) | TTFT / floor | target ≤ 2× | peak device mem (GB) | "
            "cache (GB) | compile (s) |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"# vdjax GPU prefill ({'tiny shape' if a.tiny else 'Qwen3-4B shape'}, bf16, B={a.block})", "",
             f"backend {backend}, device {jax.devices()[0].device_kind}, bandwidth {bw:.0f} GB/s (measured); "
             f"floor = weight bytes x blocks / bandwidth", "", head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['length']} | {r['policy']} | | failed: {r['error']} | | | | | | |")
            continue
        ratio = r["ttft_s"] / r["floor_s"]
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f}"
        lines.append(f"| {r['length']} | {r['policy']} | {r['slots']} | {secs(r['ttft_s'])} | {secs(r['floor_s'])} | "
                     f"{ratio:.2f} | {'PASS' if ratio <= 2 else 'FAIL'} | {peak} | {r['cache_bytes'] / 2**30:.2f} | "
                     f"{r['compile_s']:.1f} |")
    lines += ["", f"Paper (PyTorch, H100, 4B model, 128k): {PAPER_TTFT_128K_H100_S} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"bandwidth_gbs": bw, "rows": rows}, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

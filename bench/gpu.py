#!/usr/bin/env python
"""GPU/TPU benchmark: compile time, time to first token, decode speed and peak device
memory, each beside its floor.

    python bench/gpu.py                                  # Qwen3-4B shape, bf16, 32k + 128k, B=128, N=2048
    python bench/gpu.py --shape gpt-oss-20b --lengths 65536   # the paper's Table 9 setting (B=128, N=2048)
    python bench/gpu.py --shape qwen3.5 --lengths 32768,131072
    python bench/gpu.py --all                            # every shape at its own lengths, one table
    python bench/gpu.py --lengths 32768 --policies valuediff
    python bench/gpu.py --tiny --allow-cpu               # a small shape on CPU: checks the script runs

Shapes: qwen3-4b; qwen3.5 (transformers' Qwen3_5TextConfig defaults: 32 layers, 8 gated-attention + 24 Gated
DeltaNet, hidden 4096, 16/4 heads of 256, vocab 248320 -- the released 4B config could not be read offline);
gpt-oss-20b (24 layers alternating sliding-128 / full, 64/8 heads of 64, 32 experts top 4 of width 2880, vocab
201088, YaRN). Decode: `--decode-steps` greedy steps after a `--decode-context`-token prompt (batch 1), their
floor = (weight bytes a step reads + cache bytes) / bandwidth; an MoE step reads only its top-k experts.

One self-contained script for one call on a machine with a GPU or TPU. The model is random-initialised with
the shape of Qwen3-4B (36 layers, hidden 2560, 32 query / 8 KV heads of 128, MLP 9728, vocab 151936, q/k-norm)
in bf16: speed and memory do not depend on the weights' values. For each prompt length and policy (dense,
streaming, valuediff) a fresh subprocess compiles the prefill ahead of time, then times one prefill (block
B=128, cache N=2048; dense keeps everything) to the first token, and reads the device's peak memory.

Each TTFT sits next to the weight-streaming floor: every block reads every weight once, so a prefill cannot
beat weight bytes x blocks / memory bandwidth (bandwidth measured here with a large on-device copy). Target:
TTFT within 2x of that floor. The paper reports 61.5 s on an H100 (PyTorch) for a 4B model at 128k.
Where no GPU or TPU is visible it says so and measures nothing (exit 0), unless --allow-cpu.
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
QWEN3_5 = dict(family="qwen3_5", vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_layers=32,
               num_heads=16, num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7, norm_offset=1.0,
               qk_norm=True, attn_gate=True, rotary_dim=64, max_position_embeddings=262144,
               layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=16,
               linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel=4)
QWEN3_5["layer_types"] = QWEN3_5["layer_types"] * 8
_YARN = (("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0),
         ("original_max_position_embeddings", 4096), ("rope_type", "yarn"), ("truncate", False))
GPT_OSS_20B = dict(family="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                   num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, rope_theta=150000.0,
                   rope_scaling=_YARN, layer_types=("sliding_attention", "full_attention") * 12,
                   sliding_window=128, qkv_bias=True, o_bias=True, sinks=True, num_experts=32,
                   experts_per_token=4, max_position_embeddings=131072)
TINY = dict(QWEN3_4B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=64)
SHAPES = {"qwen3-4b": (QWEN3_4B, "32768,131072"), "qwen3.5": (QWEN3_5, "32768,131072"),
          "gpt-oss-20b": (GPT_OSS_20B, "65536"), "tiny": (TINY, "1024,2048")}
PAPER_TTFT_128K_H100_S = 61.5
PAPER_GPT_OSS_65K = (50.2, 34.0)  # Table 9: TTFT (s) dense -> evicting, GPT-OSS-20B at 65k


def random_params(shape: dict, seed: int = 0):
    """Random bf16 Params of `shape` (every weight its family spec declares), drawn on the default device."""
    import jax.numpy as jnp

    from vdjax.models.config import ModelConfig
    from vdjax.models.weights import init_params

    return init_params(ModelConfig(**shape), seed, scale=0.02, dtype=jnp.bfloat16, on_device=True)


def bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device memory bandwidth (GB/s): best of 5 on-device copies x -> x + 1 of
    `nbytes` bf16 (read + write)."""
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


def active_bytes(params, rows: int = 1) -> int:
    """Weight bytes one decode step of `rows` tokens reads: all of them, but of a mixture of experts only the
    experts its tokens select (at most rows x k of E)."""
    cfg = params.config
    if not cfg.num_experts:
        return params.nbytes()
    share = min(1.0, rows * cfg.experts_per_token / cfg.num_experts)
    expert = sum(v.nbytes for lw in params.weights["layers"] for k, v in lw.items() if k.startswith("moe_"))
    return int(params.nbytes() - expert + share * expert)


def decode_worker(a) -> dict:
    """Decode speed at batch 1: one warm run (compiles), then one timed run of `decode_steps` tokens."""
    import jax
    import numpy as np

    import vdjax

    params = random_params(SHAPES[a.shape][0])
    ids = np.random.default_rng(0).integers(0, params.config.vocab_size, a.decode_context, dtype=np.int32)
    budget = None if a.policy == "dense" else a.budget
    kw = dict(block_size=a.block, max_new_tokens=a.decode_steps, eos_token_id=[])
    t = time.perf_counter()
    vdjax.run(params, ids, a.policy, budget, **kw)
    first = time.perf_counter() - t
    g = vdjax.run(params, ids, a.policy, budget, **kw)
    return {"policy": a.policy, "context": a.decode_context, "steps": g.steps, "decode_s": g.decode_s,
            "first_call_s": first, "weight_bytes": active_bytes(params), "cache_bytes": g.cache.nbytes(),
            "backend": jax.default_backend()}


def worker(a) -> dict:
    """One (length, policy) measurement in this process: AOT compile, one timed prefill, peak memory."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from vdjax.engine.api import compile_prefill

    params = random_params(SHAPES[a.shape][0])
    weight_bytes = params.nbytes()  # (an MoE prefill block of 128 x k tokens reaches nearly every expert)
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
    return {"length": a.length, "policy": a.policy, "ttft_s": ttft, "compile_s": compile_s,
            "first_token": first, "blocks": int(p.tokens.shape[1] // p.block), "slots": p.slots,
            "weight_bytes": weight_bytes,
            "cache_bytes": cache.nbytes(), "peak_bytes": stats.get("peak_bytes_in_use"),
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend()}


def secs(x: float) -> str:
    """Seconds with two decimals, or three significant digits below 1 s (a tiny CPU floor is not 0.00)."""
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _spawn(args: list[str], env) -> dict:
    """Run one worker in a fresh process -> its RESULT dict, or {"error": the last lines of its output}."""
    proc = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True,
                          env=env)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not found:
        return {"error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])}
    return json.loads(found[0][7:])


def prefill_rows(a, shape: str, lengths, policies, budget, bw, env) -> list[dict]:
    """The prefill table's rows of one shape: compile, TTFT and peak memory per (length, policy)."""
    rows = []
    for length in lengths:
        for policy in policies:
            t = time.perf_counter()
            r = _spawn(["--length", str(length), "--policy", policy, "--block", str(a.block), "--budget",
                        str(budget), "--shape", shape], env) | {"shape": shape, "length": length,
                                                                "policy": policy}
            if "error" in r:
                print(f"{shape} {length} {policy}: FAILED ({r['error']})")
            else:
                r["floor_s"] = r["weight_bytes"] * r["blocks"] / (bw * 1e9)
                print(f"{shape} {length} {policy}: TTFT {secs(r['ttft_s'])} s "
                      f"(floor {secs(r['floor_s'])} s), compile {r['compile_s']:.1f} s, "
                      f"wall {time.perf_counter() - t:.0f} s")
            rows.append(r)
    return rows


def decode_rows(a, shape: str, policies, budget, bw, env) -> list[dict]:
    """The decode table's rows of one shape (batch 1)."""
    rows = []
    for policy in policies:
        r = _spawn(["--decode", "--policy", policy, "--block", str(a.block), "--budget", str(budget),
                    "--shape", shape, "--decode-context", str(a.decode_context), "--decode-steps",
                    str(a.decode_steps)], env)
        r |= {"shape": shape, "policy": policy}
        if "error" not in r:
            r["floor_s"] = r["steps"] * (r["weight_bytes"] + r["cache_bytes"]) / (bw * 1e9)
            print(f"{shape} decode {policy}: {r['steps'] / r['decode_s']:.1f} tok/s (floor "
                  f"{r['steps'] / r['floor_s']:.1f})")
        rows.append(r)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    ap.add_argument("--all", action="store_true", help="every shape but tiny, each at its default lengths")
    ap.add_argument("--decode-steps", type=int, default=32, help="0: no decode table")
    ap.add_argument("--decode-context", type=int, default=4096)
    ap.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lengths", default=None, help="comma list (default: the shape's)")
    ap.add_argument("--policies", default="dense,streaming,valuediff")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true", help="a small model shape (for a CPU smoke run)")
    ap.add_argument("--allow-cpu", action="store_true", help="measure even where no GPU or TPU is visible")
    ap.add_argument("--out", default="results/gpu/gpu.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny:
        a.shape = "tiny"
    if a.worker:
        print("RESULT " + json.dumps(decode_worker(a) if a.decode else worker(a)))
        return 0

    import jax

    backend = jax.default_backend()
    if backend == "cpu" and not a.allow_cpu:
        print(f"No GPU visible (nor TPU): jax.default_backend() = {backend!r}, devices {jax.devices()}. "
              "This benchmark needs a GPU with a CUDA jaxlib (pip install 'jax[cuda12]') or a TPU "
              "(jax[tpu]); nothing was measured.")
        return 0
    shapes = [k for k in SHAPES if k != "tiny"] if a.all else [a.shape]
    budget = a.budget if a.shape != "tiny" or a.budget != 2048 else 256
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    bw = bandwidth_gbs((256 << 20) if backend == "cpu" else (2 << 30))
    print(f"backend {backend}, device {jax.devices()[0].device_kind}, measured bandwidth {bw:.0f} GB/s")
    # peak_bytes_in_use then means what was used
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    rows, decodes = [], []
    for shape in shapes:
        lengths = [int(x) for x in (a.lengths or SHAPES[shape][1]).split(",")]
        rows += prefill_rows(a, shape, lengths, policies, budget, bw, env)
        if a.decode_steps:
            decodes += decode_rows(a, shape, policies, budget, bw, env)
    lines = table(a, rows, decodes, backend, jax.devices()[0].device_kind, bw)
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"bandwidth_gbs": bw, "rows": rows, "decode": decodes},
                                                   indent=1))
    return 1 if any("error" in r for r in rows + decodes) else 0


def table(a, rows, decodes, backend, device, bw) -> list[str]:
    """The markdown report: prefill (compile, TTFT vs floor, peak memory) and decode (tok/s vs floor)."""
    head = ("| shape | prompt | policy | N | TTFT (s) | floor (s) | TTFT / floor | target ≤ 2× | "
            "peak device mem (GB) | cache (GB) | compile (s) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"# vdjax on {device} (bf16, B={a.block})", "",
             f"backend {backend}, bandwidth {bw:.0f} GB/s (measured); prefill floor = weight bytes x "
             "blocks / bandwidth", "", head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['length']} | {r['policy']} | | failed: {r['error']} "
                         "| | | | | | |")
            continue
        ratio = r["ttft_s"] / r["floor_s"]
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f}"
        lines.append(f"| {r['shape']} | {r['length']} | {r['policy']} | {r['slots']} | {secs(r['ttft_s'])} | "
                     f"{secs(r['floor_s'])} | {ratio:.2f} | {'PASS' if ratio <= 2 else 'FAIL'} | {peak} | "
                     f"{r['cache_bytes'] / 2**30:.2f} | {r['compile_s']:.1f} |")
    lines += ["", f"Paper (PyTorch, H100, 4B model, 128k): {PAPER_TTFT_128K_H100_S} s; GPT-OSS-20B at 65k "
              f"(Table 9): TTFT {PAPER_GPT_OSS_65K[0]} s dense -> {PAPER_GPT_OSS_65K[1]} s evicting."]
    if decodes:
        lines += ["", f"## Decode, batch 1, {a.decode_context}-token prompt, {a.decode_steps} steps", "",
                  "| shape | policy | tok/s | floor tok/s | / floor | target ≥ 0.8 | "
                  "first call (s, compile incl.) |",
                  "|---|---|---|---|---|---|---|"]
        for r in decodes:
            if "error" in r:
                lines.append(f"| {r['shape']} | {r['policy']} | failed: {r['error']} | | | | |")
                continue
            got, floor = r["steps"] / r["decode_s"], r["steps"] / r["floor_s"]
            lines.append(f"| {r['shape']} | {r['policy']} | {got:.1f} | {floor:.1f} | {got / floor:.2f} | "
                         f"{'PASS' if got / floor >= 0.8 else 'FAIL'} | {r['first_call_s']:.1f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())

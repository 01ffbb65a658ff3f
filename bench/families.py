#!/usr/bin/env python
"""CPU prefill of the two sink-suppressed families on random weights small enough for this machine.

    python bench/families.py                       # both sections: stdout and results/families/families.md
    python bench/families.py --section moe         # GPT-OSS-shaped: grouped dispatch vs every expert
    python bench/families.py --section linear      # Qwen3.5-shaped: prefill tok/s from 2k to 32k tokens

moe: a GPT-OSS-shaped model (alternating sliding-128 / full layers, sinks, 32 experts top 4, YaRN), scaled to
hidden 720 and 4 layers: prefill tok/s (compile excluded) of dense and valuediff with the grouped dispatch
(`models/moe.py`: only the selected experts run) and with every expert on every token (`dense_moe`, what a
dispatch-free MoE costs: E / k = 8x the expert FLOPs).
linear: a Qwen3.5-shaped model (3 Gated DeltaNet : 1 gated attention, head 256, partial RoPE) scaled to hidden
512 and 8 layers: evicting prefill (N=2048, B=128) costs the same per block at any length, so tok/s at 32k
should stay within 0.9x of 2k (the DeltaNet state and the cache are fixed-size).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_YARN = (("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0),
         ("original_max_position_embeddings", 4096), ("rope_type", "yarn"), ("truncate", False))
GPT_OSS_SMALL = dict(family="gpt_oss", vocab_size=32000, hidden_size=720, intermediate_size=720, num_layers=4,
                     num_heads=16, num_kv_heads=2, head_dim=64, rope_theta=150000.0, rope_scaling=_YARN,
                     layer_types=("sliding_attention", "full_attention") * 2, sliding_window=128,
                     qkv_bias=True, o_bias=True, sinks=True, num_experts=32, experts_per_token=4)
QWEN3_5_SMALL = dict(family="qwen3_5", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                     num_layers=8, num_heads=4, num_kv_heads=2, head_dim=256, rms_norm_eps=1e-6,
                     rope_theta=1e7, norm_offset=1.0, qk_norm=True, attn_gate=True, rotary_dim=64,
                     layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
                     + ("full_attention",), linear_num_key_heads=4, linear_num_value_heads=8,
                     linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel=4)


def _params(shape: dict):
    from vdjax.models.config import ModelConfig
    from vdjax.models.weights import init_params

    return init_params(ModelConfig(**shape), 0, scale=0.05)


def _prefill_s(params, n: int, policy: str, budget, block: int = 128, repeats: int = 2) -> float:
    """Best warm prefill time (compile excluded: a first call compiles) of an n-token random prompt."""
    import vdjax

    ids = np.random.default_rng(n).integers(0, params.config.vocab_size, n, dtype=np.int32)
    _, logits = vdjax.prefill(params, ids, policy, budget, block)
    logits.block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        _, logits = vdjax.prefill(params, ids, policy, budget, block)
        logits.block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def moe_section(length: int) -> list[str]:
    """GPT-OSS-shaped prefill with and without the grouped dispatch."""
    import jax

    from vdjax.models import moe as M

    params = _params(GPT_OSS_SMALL)
    rows = {}
    grouped = M.grouped
    for dispatch in ("grouped", "every expert"):
        M.grouped = grouped if dispatch == "grouped" else (
            lambda lw, x, idx, w, cfg, ragged=None: M.dense_moe(lw, x, idx, w, cfg))
        jax.clear_caches()  # the programs trace `grouped` again
        for policy, budget in (("dense", None), ("valuediff", 512)):
            rows[dispatch, policy] = length / _prefill_s(params, length, policy, budget)
            print(f"moe {dispatch:13s} {policy:9s} {rows[dispatch, policy]:.0f} tok/s", flush=True)
    M.grouped = grouped
    cfg = params.config
    out = [f"## GPT-OSS-shaped MoE prefill, {length} tokens (hidden {cfg.hidden_size}, {cfg.num_layers} "
           f"layers, {cfg.num_experts} experts top {cfg.experts_per_token}, fp32, B=128)", "",
           "| policy | grouped dispatch (tok/s) | every expert (tok/s) | speed-up |", "|---|---|---|---|"]
    for policy in ("dense", "valuediff"):
        g, d = rows["grouped", policy], rows["every expert", policy]
        out.append(f"| {policy}{' N=512' if policy != 'dense' else ''} | {g:.0f} | {d:.0f} | {g / d:.2f}x |")
    return out


def linear_section(lengths: list[int]) -> list[str]:
    """Qwen3.5-shaped evicting prefill tok/s across lengths (fixed-size state and cache: flat)."""
    params = _params(QWEN3_5_SMALL)
    rate = {}
    for n in lengths:
        rate[n] = n / _prefill_s(params, n, "valuediff", 2048, repeats=1 if n > 8192 else 2)
        print(f"linear {n:6d} {rate[n]:.0f} tok/s", flush=True)
    base = rate[lengths[0]]
    out = ["## Qwen3.5-shaped evicting prefill (valuediff N=2048, B=128; hidden 512, 6 Gated DeltaNet + 2 "
           "gated attention layers, fp32)", "", "| prompt | tok/s | / first | target ≥ 0.9 |",
           "|---|---|---|---|"]
    out += [f"| {n} | {rate[n]:.0f} | {rate[n] / base:.2f} | {'PASS' if rate[n] / base >= 0.9 else 'FAIL'} |"
            for n in lengths]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--section", choices=("all", "moe", "linear"), default="all")
    ap.add_argument("--moe-length", type=int, default=2048)
    ap.add_argument("--lengths", default="2048,8192,32768", help="linear section's prompt lengths")
    ap.add_argument("--out", default=str(ROOT / "results" / "families" / "families.md"))
    a = ap.parse_args()
    import jax

    lines = [f"# vdjax families benchmark ({jax.default_backend()}, {jax.devices()[0].device_kind})", ""]
    if a.section in ("all", "moe"):
        lines += moe_section(a.moe_length) + [""]
    if a.section in ("all", "linear"):
        lines += linear_section([int(x) for x in a.lengths.split(",")]) + [""]
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

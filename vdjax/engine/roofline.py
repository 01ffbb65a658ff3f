"""Published chip figures and the analytic work of the prefill and decode programs, for `aot`'s roofline
estimates (`roofline_s` = max(flops / peak FLOP/s, bytes / HBM bandwidth) per chip).

Why analytic: XLA's `cost_analysis()` counts every loop body once (HloCostAnalysis does not multiply by trip
counts: the block scan of a 128k prefill, the layer scan and decode's while loop each count one iteration, as
`tests/test_aot.py` shows), so its flops are a per-iteration figure, not the program's. The counts here
follow what vdjax's programs compute (static shapes: a dense prefill runs its padded length; an evicting
prefill skips blocks of padding; attention runs over every cache slot, masked or not; a pool's heads each
read the whole pool; GPT-OSS's experts count their routed share, k / E): matmuls and attention only. Within a
few percent of XLA's own count on a one-iteration prefill (tests/test_aot.py checks it). Bytes are HBM
traffic of weights and KV cache only (activations, which XLA keeps in VMEM or re-reads, are left out): a
lower bound, as a roofline is.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's published figures: dense bf16 peak FLOP/s, HBM bytes and HBM bytes/s per chip."""

    name: str
    flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    source: str


GB = 1e9
CHIPS = {
    "v4": Chip("TPU v4", 275e12, 32 * 2**30, 1200 * GB, "cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, "
               "32 GiB HBM2, 1200 GB/s"),
    "v5e": Chip("TPU v5e", 197e12, 16 * GB, 819 * GB, "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, "
                "16 GB HBM2, 819 GB/s"),
    "v5p": Chip("TPU v5p", 459e12, 95 * GB, 2765 * GB, "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, "
                "95 GB HBM2e, 2765 GB/s"),
    "v6e": Chip("TPU v6e", 918e12, 32 * GB, 1638 * GB, "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, "
                "32 GB HBM, 1638 GB/s"),
    # not a TPU: the paper's Table 9 card, for comparing the same analytic counts with its measured TTFT
    "h100": Chip("NVIDIA H100 SXM", 989e12, 80 * GB, 3350 * GB, "nvidia.com H100 datasheet (SXM): "
                 "989 TFLOP/s dense bf16, 80 GB HBM3, 3.35 TB/s"),
}


def chip_of(device_kind: str) -> str:
    """The `CHIPS` key of a TPU device kind ("TPU v5 lite" -> "v5e", "TPU v6 lite" -> "v6e", "TPU v5" ->
    "v5p", "TPU v4" -> "v4")."""
    kind = device_kind.lower()
    for key, words in (("v5e", ("v5 lite", "v5e")), ("v6e", ("v6 lite", "v6e")), ("v5p", ("v5p", "v5")),
                       ("v4", ("v4",))):
        if any(w in kind for w in words):
            return key
    raise ValueError(f"no published figures for device kind {device_kind!r}; known: {sorted(CHIPS)}")


def roofline_s(flops: float, nbytes: float, chip: Chip) -> float:
    """max(flops / peak FLOP/s, bytes / HBM bandwidth): the time one chip needs at best."""
    return max(flops / chip.flops, nbytes / chip.hbm_bandwidth)


@dataclasses.dataclass(frozen=True)
class Split:
    """How one chip's share of the work shrinks on the mesh: rows per chip, and whether attention heads split
    over "model" (else every chip of a model group computes all of them)."""

    rows: int  # batch rows one chip computes (the padded batch / "data" size)
    model: int  # the "model" axis size
    heads_split: bool


def matmul_elems(abstract_weights: dict, cfg, shard=None) -> tuple[float, float]:
    """(weight elements one token multiplies through in the layers, in the LM head): every layer array of two
    or more axes (GPT-OSS's experts at their routed share k / E); `shard(name, shape)` -> the shape one chip
    holds (None: whole arrays)."""
    def size(name, shape):
        return float(np.prod(shard(name, shape) if shard else shape))

    layers = 0.0
    for lw in abstract_weights["layers"]:
        for name, leaf in lw.items():
            if len(leaf.shape) < 2:
                continue
            n = size(name, leaf.shape)
            layers += n * (cfg.experts_per_token / cfg.num_experts if name.startswith("moe_") else 1.0)
    head = abstract_weights.get("lm_head", abstract_weights["embed"])
    return layers, size("lm_head" if "lm_head" in abstract_weights else "embed", head.shape)


def _linear_flops(cfg) -> float:
    """Gated DeltaNet work per token and layer beyond its projections (state update and read-out, chunked
    form's intra-chunk products of 64 tokens): an estimate."""
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return hv * (6.0 * dk * dv + 2.0 * 64 * (dk + dv))


def _attn_heads(cfg, split: Split) -> float:
    return cfg.num_heads / (split.model if split.heads_split else 1)


def dense_pairs(t: int, window: int | None, chunk: int) -> float:
    """(query, key) pairs `transformer.causal_attention` computes over t tokens: the causal half at chunk
    granularity (the diagonal chunk whole), from the window's first chunk on a sliding layer."""
    c = min(chunk, t)
    n = -(-t // c)
    total = 0
    for i in range(n):
        first = 0 if window is None else max(0, (i * c - window + 1) // c)
        total += i - first + 1
    return float(total) * c * c


def prefill_work(cfg, weights, split: Split, slots: tuple[int, ...], *, tokens: int, padded: int, block: int,
                 dense: bool, weight_bytes: float, head_bytes: float, cache_bytes: float,
                 kv_token_bytes: float, chunk: int, shard=None) -> tuple[float, float]:
    """(flops, HBM bytes) one chip spends on a prefill. `slots`: each layer's cache slots (0 without a KV
    cache); `tokens` the longest real prompt, `padded` its padded length; `weight_bytes` (the layers'),
    `head_bytes` (the LM head's), `cache_bytes` (the cache as the program returns it): what one chip holds;
    `kv_token_bytes`: one token's key and value in one layer on one chip."""
    mm, head = matmul_elems(weights, cfg, shard)
    heads, d = _attn_heads(cfg, split), cfg.head_dim
    lin = sum(_linear_flops(cfg) for i in range(cfg.num_layers) if not cfg.attends(i))
    head_flops = 2.0 * head * split.rows  # last-token logits
    if dense:
        pairs = [dense_pairs(padded, cfg.window(i), chunk) for i in cfg.attention_layers]
        flops = split.rows * (2.0 * mm * padded + lin * padded + 4.0 * heads * d * sum(pairs)) + head_flops
        # weights once, the cache written once, and every key chunk read once per query chunk that sees it
        reads = split.rows * kv_token_bytes * sum(pairs) / min(chunk, padded)
        return flops, weight_bytes + head_bytes + cache_bytes + reads
    nb = -(-tokens // block)  # blocks of padding are skipped
    attn = sum(4.0 * heads * d * block * (n + block) for n in slots if n)
    flops = nb * split.rows * (2.0 * mm * block + lin * block + attn) + head_flops
    # each block reads every weight and the cache, and writes the cache back (eviction's gather)
    return flops, nb * (weight_bytes + 2.0 * cache_bytes) + head_bytes


def decode_work(cfg, weights, split: Split, slots: tuple[int, ...], *, weight_bytes: float, head_bytes: float,
                cache_bytes: float, shard=None) -> tuple[float, float]:
    """(flops, HBM bytes) one chip spends on one decode step: one token per row through every weight and
    every cache slot (eviction's scatter writes one slot per head: left out)."""
    mm, head = matmul_elems(weights, cfg, shard)
    heads, d = _attn_heads(cfg, split), cfg.head_dim
    lin = sum(_linear_flops(cfg) for i in range(cfg.num_layers) if not cfg.attends(i))
    attn = sum(4.0 * heads * d * n for n in slots if n)
    return split.rows * (2.0 * (mm + head) + lin + attn), weight_bytes + head_bytes + cache_bytes


def gib(n: float | None) -> str:
    """Bytes as GiB with two significant decimals ("19.3", "0.012"); "?" for unknown."""
    if n is None:
        return "?"
    if not math.isfinite(n):
        return "inf"
    g = n / 2**30
    return f"{g:.1f}" if g >= 1 or g == 0 else f"{g:.2g}"

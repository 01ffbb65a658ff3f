"""Adaptive budgets: how a layer's or a head's share of the cache is decided (pure functions).

* Layer budgets (`pyramid_budgets`): PyramidKV's rule as kvpress 0.5.5's `PyramidKVPress.get_layer_budget`
  (KVCache-Factory's), with kvpress's `T * (1 - compression_ratio)` read as the per-head budget N and `T` as
  the prompt length; the layers' budgets sum to L * N up to rounding, so the memory is the uniform cache's.
* Head-adaptive selection (`adakv_keep`, `criticaladakv_keep`): a layer's K heads share K * N slots; at every
  eviction the layer keeps its best K * N candidates across heads (scores of different heads compared
  directly, as kvpress does), each head first keeping its own top `safeguard(N, alpha)`.
* CriticalKV (`critical_scores`): the base's top `first_stage_ratio * N` kept outright, the rest ranked by
  `(score + epsilon) * ||W_o v||_1` (`wo_l1_norm`).

Scores here are [B, K, C] over one layer's candidates in the per-head view (an invalid candidate has pos -1);
`+inf` marks a protected candidate, as everywhere in vdjax.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from vdjax.engine.cache import keep_mask, rank_keys

_INF = jnp.inf


def safeguard(n: int, alpha: float) -> int:
    """Candidates each head keeps of its own before heads compete: max(1, floor(alpha * n)), 0 when alpha is 0
    (kvpress's `n_safe`, with n its `n_kept`)."""
    if alpha <= 0 or n <= 0:
        return 0
    return max(1, int(n * alpha))


def pyramid_budgets(num_layers: int, n: float, t: int, beta: float = 20, window_size: int = 64
                    ) -> tuple[int, ...]:
    """Per-layer budgets of PyramidKV for a prompt of t tokens at a mean budget n (kvpress's
    `get_layer_budget` with `q_len = t` and `t * (1 - ratio) = n`): linear from `max_num` at layer 0 to
    `min_num` at the last, `max_num` capped at `t - window_size`; where `t >= max_num >= min_num >=
    window_size` fails, every layer gets `max(1, round(n))`. Python's round (half to even), as kvpress."""
    if beta < 1:
        raise ValueError(f"pyramidkv beta must be >= 1, got {beta!r}")
    min_num = n / beta
    max_num = 2 * n - min_num
    if max_num >= t - window_size:
        max_num = t - window_size
        min_num = 2 * n - max_num
    if not (t >= max_num >= min_num >= window_size):
        return (max(1, round(n)),) * num_layers
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return tuple(max(1, round(max_num - i * steps)) for i in range(num_layers))


def wo_l1_norm(v: jax.Array, wo: jax.Array) -> jax.Array:
    """||v W_o,h||_1 of each candidate, averaged over the query heads h of its KV head's group:
    v [B, K, C, D], wo [Nq, D, H] (the layer's output projection per query head) -> [B, K, C] fp32."""
    nq, d, hidden = wo.shape
    kh = v.shape[1]
    w = wo.reshape(kh, nq // kh, d, hidden).astype(jnp.float32)  # [K, G, D, H]
    proj = jnp.einsum("bkcd,kgdh->bkgch", v.astype(jnp.float32), w)
    return jnp.mean(jnp.sum(jnp.abs(proj), axis=-1), axis=2)


def critical_scores(scores: jax.Array, pos: jax.Array, n: int, vnorm: jax.Array, epsilon: float,
                    first_stage_ratio: float) -> jax.Array:
    """CriticalKV's two stages as one score [B, K, C]: each head's top `first_stage_ratio * n` (at least one,
    kvpress's floor) by the base score protected, the rest `(score + epsilon) * vnorm`."""
    first = max(1, int(first_stage_ratio * n)) if first_stage_ratio > 0 else 0
    protected = (pos >= 0) & jnp.isposinf(scores)
    s = rank_keys(scores, pos)
    stage1 = keep_mask(s, pos, first) | protected
    return jnp.where(stage1, _INF, (s + epsilon) * vnorm)


def _protect_safeguard(scores, pos, n: int, alpha: float):
    """Scores (invalid -inf) with each head's top `safeguard(n, alpha)` and the base's protected (+inf)
    candidates set to +inf."""
    protected = (pos >= 0) & jnp.isposinf(scores)
    s = rank_keys(scores, pos)
    m = safeguard(n, alpha)
    if m:
        protected = protected | keep_mask(s, pos, m)
    return jnp.where(protected, _INF, s)


def _across_heads(s, pos, total: int):
    """The top `total` candidates of each row across all its heads: s, pos [B, K, C] -> keep [B, K, C]."""
    b, k, c = s.shape
    return keep_mask(s.reshape(b, 1, k * c), pos.reshape(b, 1, k * c), total).reshape(b, k, c)


def adakv_keep(scores: jax.Array, pos: jax.Array, n: int, alpha: float) -> jax.Array:
    """AdaKV: which of a row's candidates survive when its K heads share K * n slots: each head's top
    `safeguard(n, alpha)`, then the best of all heads. scores, pos [B, K, C] -> keep [B, K, C] bool."""
    return _across_heads(_protect_safeguard(scores, pos, n, alpha), pos, scores.shape[1] * n)


def criticaladakv_keep(scores: jax.Array, pos: jax.Array, n: int, vnorm: jax.Array, alpha: float,
                       epsilon: float, first_stage_ratio: float) -> jax.Array:
    """CriticalAdaKV (kvpress's `CriticalAdaKVPress.compress`, each row on its own): head budgets n_h from
    the safeguarded base scores by the AdaKV rule (sum K * n), then inside each head its top
    `floor(first_stage_ratio * n_h)` by the base score kept and the rest of n_h by `(score + epsilon) *
    vnorm`. scores, pos, vnorm [B, K, C] -> keep [B, K, C] bool."""
    s = _protect_safeguard(scores, pos, n, alpha)
    head_budget = jnp.sum(_across_heads(s, pos, scores.shape[1] * n), axis=-1)  # [B, K]
    first = jnp.floor(head_budget * first_stage_ratio).astype(jnp.int32)
    stage1 = keep_mask(s, pos, first) | jnp.isposinf(s)
    return keep_mask(jnp.where(stage1, _INF, (s + epsilon) * vnorm), pos, head_budget)


def chunk_scores(scores: jax.Array, pos: jax.Array, length: int) -> jax.Array:
    """ChunkKV: every candidate scored by its chunk (positions [c * length, (c + 1) * length)): the sum over
    the KV heads of each head's mean score over the chunk's candidates (kvpress's sum over heads, then mean
    over the chunk), +inf for a chunk holding a protected candidate. scores, pos [B, K, C] -> [B, K, C], one
    value for a chunk in every head, so all heads keep the same chunks, whole but for the last one kept
    (its earliest positions, the tie order)."""
    b, kh, c = pos.shape
    valid = pos >= 0
    protected = valid & (scores == _INF)
    s = jnp.where(valid & ~protected, scores, 0.0).astype(jnp.float32)
    # each row's chunks numbered 0, 1, ... in position order over every head's candidates (sort, not a
    # [K C, K C] comparison), then per-(head, chunk) sums by segment_sum
    flat = jnp.where(valid, pos // length, jnp.iinfo(jnp.int32).max).reshape(b, kh * c)
    order = jnp.argsort(flat, axis=1)
    ranked = jnp.take_along_axis(flat, order, axis=1)
    step = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                            (ranked[:, 1:] != ranked[:, :-1]).astype(jnp.int32)], axis=1)
    rank = jnp.take_along_axis(jnp.cumsum(step, axis=1), jnp.argsort(order, axis=1), axis=1)  # [B, K C]
    seg = (jnp.arange(kh)[None, :, None] * (kh * c) + rank.reshape(b, kh, c)).reshape(b, kh * c)

    def per_head_chunk(x):  # [B, K, C] -> sums [B, K, K C] over each (head, chunk)
        return jax.vmap(lambda v, i: jax.ops.segment_sum(v, i, num_segments=kh * kh * c))(
            x.reshape(b, kh * c), seg).reshape(b, kh, kh * c)

    count = per_head_chunk(valid.astype(jnp.float32))
    mean = per_head_chunk(s) / jnp.maximum(count, 1.0)
    total = jnp.sum(jnp.where(count > 0, mean, 0.0), axis=1)  # [B, K C] per chunk: the sum over heads
    hit = jnp.sum(per_head_chunk(protected.astype(jnp.float32)), axis=1) > 0
    return jnp.where(jnp.take_along_axis(hit, rank, axis=1), _INF,
                     jnp.take_along_axis(total, rank, axis=1)).reshape(b, kh, c)


def check_fraction(name: str, value, low: float = 0.0, high: float = 1.0) -> float:
    """`value` as a float in [low, high], or a ValueError naming the keyword."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high) \
            or math.isnan(value):
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)

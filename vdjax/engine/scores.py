"""Score functions (higher = keep) over one layer's candidates, and what they may read (`AttnInfo`).

Every score function has the signature

    score(k, v, attn, pos, *, slots, **hyper) -> scores [B, K, C] (fp32)

over the C = N + S candidates of one layer (the N cache slots, then the block's S new tokens):
k, v [B, K, C, D] (keys after RoPE), pos [B, K, C] absolute positions (-1 = invalid), attn an `AttnInfo`,
`slots` the layer's cache size N (min(N, W - 1) on a sliding layer of window W: it never holds more).
Scores of invalid candidates are ignored (the programs set them to -inf); means are taken over the valid
candidates of each head. `+inf` marks a protected token: protected tokens rank above all others.
Ties keep the earlier position (see `cache.keep_mask`). The registry and
composition: `policies.py`. """

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

_EPS = 1e-12
INF = jnp.inf


@flax.struct.dataclass
class AttnInfo:
    """What a score may read beyond the candidates' k, v and positions: the block's queries' attention, the
    accumulated attention, the layer's index and weights (the one context object every score receives)."""

    probs: jax.Array  # [B, K, G, S, C] softmax weights of the block's queries over the candidates
    q_pos: jax.Array  # [B, S] absolute query positions, -1 = padding
    acc: jax.Array  # [B, K, C] attention accumulated over every query so far (GQA mean), incl. this block
    layer: Any = 0  # index of the layer being scored (an int, or a traced int32 inside the layer scan)
    # the layer's weights as the model holds them (e.g. "wo" [Nq, D, H], the output projection per query
    # head, which CriticalKV reads); None where a score is called outside the engine
    weights: Any = None
    # for a policy with `queries=True` (else None): the block's pre-RoPE queries [B, S, Nq, D]; with
    # `query_stats=True` the running `cache.QueryStats` of every query seen so far (this block's included)
    queries: Any = None
    stats: Any = None
    # the candidates' per-token feature [B, K, C] for a policy with a `token_feature` (computed once when each
    # token entered and carried in the cache), else None
    feature: Any = None
    # the layer's inverse RoPE frequencies [R/2] and the RoPE scale (cos and sin are multiplied by it)
    inv_freq: Any = None
    rope_scale: float = flax.struct.field(pytree_node=False, default=1.0)
    # cos and sin [2, P, R/2] of positions 0 .. P - 1 with these frequencies (`rope_table`), computed once per
    # prefill, where every position is below P: `unrotate` gathers them instead of evaluating them per call;
    # None (decode, or outside the engine): computed from the positions
    rope_table: Any = None

    @property
    def last_index(self) -> jax.Array:
        """Index [B] of the block's last valid query (0 when the row has none)."""
        s = self.q_pos.shape[1]
        return jnp.max(jnp.where(self.q_pos >= 0, jnp.arange(s), 0), axis=1)

    @property
    def last_pos(self) -> jax.Array:
        """Absolute position [B] of the last valid query seen (the most recent token)."""
        return jnp.max(self.q_pos, axis=1)

    def last_query(self) -> jax.Array:
        """Attention weights [B, K, G, C] of the block's last valid query."""
        idx = self.last_index[:, None, None, None, None]  # [B, 1, 1, 1, 1]
        return jnp.take_along_axis(self.probs, idx, axis=3)[:, :, :, 0]


def valid_mask(pos: jax.Array) -> jax.Array:
    """Candidates that hold a token: [B, K, C] bool."""
    return pos >= 0


def masked_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Mean over the valid candidates: x [B, K, C, D], valid [B, K, C] -> [B, K, 1, D] (fp32)."""
    w = valid.astype(jnp.float32)
    # a batched mat-vec, not a broadcast-multiply-reduce over axis 2 (much slower on XLA:CPU)
    total = jnp.einsum("bkcd,bkc->bkd", x.astype(jnp.float32), w)[:, :, None]
    return total / jnp.maximum(jnp.sum(w, axis=-1)[:, :, None, None], 1.0)


def _norm(x: jax.Array) -> jax.Array:
    """L2 norm over the last axis in fp32."""
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(x * x, axis=-1))


def _cos(x: jax.Array, anchor: jax.Array) -> jax.Array:
    """Cosine similarity of x [B, K, C, D] with anchor [B, K, 1, D] -> [B, K, C]."""
    x = x.astype(jnp.float32)
    dot = jnp.einsum("bkcd,bkd->bkc", x, anchor[:, :, 0])  # a mat-vec, not a broadcast-multiply-sum
    return dot / jnp.maximum(_norm(x) * _norm(anchor), _EPS)


def recent_mask(pos: jax.Array, attn: AttnInfo, window: int) -> jax.Array:
    """Candidates among the `window` most recent positions: [B, K, C] bool."""
    return pos > (attn.last_pos[:, None, None] - window)


# ---- value geometry -------------------------------------------------------------------------------------
def valuediff(k, v, attn, pos, **_):
    """ValueDiff: ||v_j - mean(v)||_2."""
    return _norm(v.astype(jnp.float32) - masked_mean(v, valid_mask(pos)))


def valuediff_dir(k, v, attn, pos, **_):
    """ValueDiff-Dir: 1 - cos(v_j, mean(v))."""
    return 1.0 - _cos(v, masked_mean(v, valid_mask(pos)))


def valuediff_norm(k, v, attn, pos, **_):
    """ValueDiff-Norm: ||v_j||_2."""
    return _norm(v)


# ---- key geometry ---------------------------------------------------------------------------------------
def keydiff(k, v, attn, pos, **_):
    """KeyDiff: -cos(k_j, mean_i(k_i / ||k_i||))."""
    k32 = k.astype(jnp.float32)
    unit = k32 / jnp.maximum(_norm(k32), _EPS)[..., None]
    return -_cos(k32, masked_mean(unit, valid_mask(pos)))


def keynorm(k, v, attn, pos, **_):
    """KeyNorm: -||k_j||_2 (keep the smallest key norms)."""
    return -_norm(k)


def manifoldkv(k, v, attn, pos, **_):
    """ManifoldKV: ||k_j - mean(k)||_2."""
    return _norm(k.astype(jnp.float32) - masked_mean(k, valid_mask(pos)))


# ---- position / attention -------------------------------------------------------------------------------
def streaming(k, v, attn, pos, *, n_sink: int = 4, **_):
    """StreamingLLM: the first `n_sink` positions, then the most recent ones."""
    return jnp.where(pos < n_sink, INF, pos.astype(jnp.float32))


def tova(k, v, attn, pos, *, per_kv_head: bool = False, **_):
    """TOVA: the block's last query's weights, averaged over all query heads of the layer (or per KV head)."""
    last = attn.last_query()  # [B, K, G, C]
    if per_kv_head:
        return jnp.mean(last, axis=2)
    return jnp.broadcast_to(jnp.mean(last, axis=(1, 2))[:, None], pos.shape)


def _pool_by_position(scores: jax.Array, pos: jax.Array, kernel: int, pooling: str = "max") -> jax.Array:
    """Pool scores [B, K, C] along candidates sorted by position (stride 1, same length, zero/-inf padded).

    "max": max-pooling; "avg": sum over the window / kernel, padding counted (torch's avg_pool1d with
    padding=kernel//2, as SnapKV's and kvpress's code). Invalid candidates
    sort last and pool as padding. """
    pad_value = -INF if pooling == "max" else 0.0
    key = jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max)  # invalid last
    iota = jax.lax.broadcasted_iota(jnp.int32, pos.shape, pos.ndim - 1)
    # one stable sort carries the scores along (cheaper on CPU than argsort + gather)
    _, order, sorted_scores = jax.lax.sort((key, iota, jnp.where(pos >= 0, scores, pad_value)), dimension=-1,
                                           is_stable=True, num_keys=1)
    pad = kernel // 2
    window = ((0, 0), (0, 0), (pad, kernel - 1 - pad))
    if pooling == "max":
        pooled = jax.lax.reduce_window(sorted_scores, -INF, jax.lax.max, (1, 1, kernel), (1, 1, 1), window)
    else:
        pooled = jax.lax.reduce_window(sorted_scores, 0.0, jax.lax.add, (1, 1, kernel), (1, 1, 1), window)
        pooled = pooled / kernel
    b, kh, _ = pos.shape
    rows, heads = jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None]
    return jnp.zeros_like(pooled).at[rows, heads, order].set(pooled, unique_indices=True)  # back to slots


SNAPKV_KERNELS = {"max": 7,
                  "avg": 5}  # kernel=None: max-pooling over 7 (vdjax's default), avg over 5 (SnapKV)


def snapkv(k, v, attn, pos, *, window: int = 32, kernel: int | None = None, pooling: str = "max", **_):
    """SnapKV: attention of the last `window` queries summed, GQA-mean, pooled along positions (max over
    `kernel` = 7, or avg over 5 as SnapKV's and kvpress's code); the window is always kept."""
    if pooling not in SNAPKV_KERNELS:
        raise ValueError(f"snapkv pooling must be one of {sorted(SNAPKV_KERNELS)}, got {pooling!r}")
    kernel = SNAPKV_KERNELS[pooling] if kernel is None else kernel
    in_window = (attn.q_pos >= 0) & (attn.q_pos > attn.last_pos[:, None] - window)  # [B, S]
    votes = jnp.sum(attn.probs * in_window[:, None, None, :, None], axis=3)  # [B, K, G, C]
    pooled = _pool_by_position(jnp.mean(votes, axis=2), pos, kernel, pooling)
    return jnp.where(recent_mask(pos, attn, window), INF, pooled)


def snapkv_kvpress(k, v, attn, pos, *, window_size: int = 64, kernel: int = 5, **_):
    """SnapKV as kvpress's `SnapKVPress.score`: the last `window_size` queries' attention, GQA mean, average-
    pooled (`kernel`, zero padding) over the candidates outside the window only; the window always kept."""
    in_window = (attn.q_pos >= 0) & (attn.q_pos > attn.last_pos[:, None] - window_size)  # [B, S]
    votes = jnp.sum(attn.probs * in_window[:, None, None, :, None], axis=3)  # [B, K, G, C]
    recent = recent_mask(pos, attn, window_size)
    pooled = _pool_by_position(jnp.mean(votes, axis=2), jnp.where(recent, -1, pos), kernel, "avg")
    return jnp.where(recent, INF, pooled)


def bind_snapkv(params, hyper, budget=None):
    """kernel=None -> the pooling's own kernel (7 for max, 5 for avg), so results record the number."""
    hyper = dict(hyper)
    if hyper.get("pooling") not in SNAPKV_KERNELS:
        raise ValueError(f"snapkv pooling must be one of {sorted(SNAPKV_KERNELS)}, got "
                         f"{hyper.get('pooling')!r}")
    if hyper.get("kernel") is None:
        hyper["kernel"] = SNAPKV_KERNELS[hyper["pooling"]]
    return tuple(sorted(hyper.items()))


def h2o(k, v, attn, pos, *, slots: int, n_recent: int | None = None, **_):
    """H2O: accumulated attention (heavy hitters) plus the `n_recent` most recent tokens (default slots // 2:
    N // 2 on full-attention layers, min(N, W - 1) // 2 on sliding ones, whose caches are that small)."""
    recent = slots // 2 if n_recent is None else n_recent
    return jnp.where(recent_mask(pos, attn, recent), INF, attn.acc)


def fastcaote(k, v, attn, pos, **_):
    """FastCAOTE: alpha_j / (1 - alpha_j) * ||v_j - mean(v)||, alpha = last query's GQA-mean attention."""
    alpha = jnp.mean(attn.last_query(), axis=2)  # [B, K, C]
    return alpha / jnp.maximum(1.0 - alpha, _EPS) * valuediff(k, v, attn, pos)


def standardize(s: jax.Array, valid: jax.Array) -> jax.Array:
    """Z-score [B, K, C] over the valid finite entries of each head; +inf (protected) stays +inf."""
    finite = valid & jnp.isfinite(s)
    n = jnp.maximum(jnp.sum(finite, axis=-1, keepdims=True), 1)
    x = jnp.where(finite, s, 0.0)
    mean = jnp.sum(x, axis=-1, keepdims=True) / n
    var = jnp.sum(jnp.where(finite, (x - mean) ** 2, 0.0), axis=-1, keepdims=True) / n
    return jnp.where(finite, (x - mean) / jnp.sqrt(var + _EPS), s)


# ---- the field's query-agnostic scorers (kvpress 0.5.5's presses in true block mode) ---------------------
def _avg_rope(x: jax.Array, attn: AttnInfo, count: int) -> jax.Array:
    """x [B, ..., D] times the RoPE rotation averaged over the `count` positions after the last query (on the
    last axis; dims past the rotated ones unchanged): kvpress's `apply_avg_rope`."""
    inv_freq = attn.inv_freq
    half = inv_freq.shape[-1]
    p = (attn.last_pos[:, None] + 1 + jnp.arange(count))[..., None].astype(jnp.float32)  # [B, F, 1]
    c = jnp.mean(jnp.cos(p * inv_freq), axis=1) * attn.rope_scale  # [B, R/2]
    s = jnp.mean(jnp.sin(p * inv_freq), axis=1) * attn.rope_scale
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    c, s = c.reshape(shape), s.reshape(shape)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return jnp.concatenate([c * x1 - s * x2, c * x2 + s * x1, rest], axis=-1)


def expected_attention(k, v, attn, pos, *, n_future_positions: int = 512, n_sink: int = 4,
                       use_covariance: bool = True, use_vnorm: bool = True, epsilon: float = 0.0,
                       stats: str = "all", **_):
    """Expected Attention: softmax over the non-sink candidates of k.mu/sqrt(d) + k^T Sigma k/(2d), with mu,
    Sigma the pre-RoPE queries' mean and covariance rotated by the RoPE averaged over the next
    `n_future_positions` positions, GQA mean, times ||v|| (`use_vnorm`); the first `n_sink` positions kept.
    `stats="all"`: the queries of every block so far (carried in the cache); "block": the current block's
    (at a decode step, all so far)."""
    if stats not in ("all", "block"):
        raise ValueError(f"expected_attention stats must be 'all' or 'block', got {stats!r}")
    st = attn.stats
    if stats == "block" and attn.q_pos.shape[1] > 1:
        st = type(st).of(attn.queries, attn.q_pos >= n_sink)
    b, kh, c, d = k.shape
    mu = _avg_rope(st.mean, attn, n_future_positions)  # [B, Nq, D]
    g = mu.shape[1] // kh
    k32 = k.astype(jnp.float32)
    logits = jnp.einsum("bkcd,bkgd->bkgc", k32, mu.reshape(b, kh, g, d)) / math.sqrt(d)
    if use_covariance:
        cov = _avg_rope(jnp.swapaxes(_avg_rope(st.cov, attn, n_future_positions), -1, -2), attn,
                        n_future_positions)  # R Sigma R^T [B, Nq, D, D]
        # k^T Sigma k as one contraction (XLA:CPU: a third faster than k Sigma, then the product with k)
        logits = logits + jnp.einsum("bkcd,bkgde,bkce->bkgc", k32, cov.reshape(b, kh, g, d, d), k32) / d / 2
    scored = (pos >= n_sink)[:, :, None, :]  # [B, K, 1, C]
    probs = jax.nn.softmax(jnp.where(scored, logits, -INF), axis=-1)
    s = jnp.mean(jnp.where(scored, probs, 0.0), axis=2)
    if use_vnorm:
        s = (s + epsilon) * _norm(v)
    return jnp.where((pos >= 0) & (pos < n_sink), INF, s)


def random_scores(k, v, attn, pos, *, seed: int = 0, **_):
    """Random: uniform scores, a new draw per layer, row and step from `seed` (the row's last position and the
    layer folded in): the floor every leaderboard needs."""
    base = jax.random.fold_in(jax.random.PRNGKey(seed), attn.layer)
    draw = jax.vmap(lambda p: jax.random.uniform(jax.random.fold_in(base, p), pos.shape[1:]))
    return draw(attn.last_pos)


def _window_share(x: jax.Array, pos: jax.Array, width: int) -> jax.Array:
    """x [B, K, C] divided by its sum over the valid candidates of its fixed `width`-position window
    (positions [w * width, (w + 1) * width))."""
    win = jnp.where(pos >= 0, pos // width, -1)
    same = (win[..., :, None] == win[..., None, :]) & (pos >= 0)[..., None, :]  # [B, K, C, C]
    total = jnp.einsum("bkij,bkj->bki", same.astype(jnp.float32), x)
    return x / jnp.maximum(total, _EPS)


def cur(k, v, attn, pos, *, num_sinks: int = 4, leverage_type: str = "kv_product",
        local_window_size: int = 16, use_random_leverage: bool = False, seed: int = 0, **_):
    """CurDKV (kvpress CURPress, default settings): each key's and value's share of squared norm within fixed
    `local_window_size`-position windows from position 0, combined by `leverage_type` (kv_product, kv_avg,
    key, value), normalised over the candidates; the first `num_sinks` positions kept.
    `use_random_leverage`: keys and values first projected on a Gaussian sketch of 20 columns drawn from
    `seed` and the layer (kvpress draws it unseeded)."""
    if leverage_type not in ("kv_product", "kv_avg", "key", "value"):
        raise ValueError(f"cur leverage_type must be one of kv_product, kv_avg, key, value, got "
                         f"{leverage_type!r}")
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    if use_random_leverage:
        key = jax.random.fold_in(jax.random.PRNGKey(seed), attn.layer)
        sketch = jax.random.normal(key, (k.shape[-1], 20)) / math.sqrt(20)
        k32, v32 = k32 @ sketch, v32 @ sketch
    k2 = _window_share(jnp.sum(k32 * k32, -1), pos, local_window_size)
    v2 = _window_share(jnp.sum(v32 * v32, -1), pos, local_window_size)
    s = {"kv_product": k2 * v2, "kv_avg": (k2 + v2) / 2, "key": k2, "value": v2}[leverage_type]
    s = s / jnp.maximum(jnp.sum(jnp.where(pos >= 0, s, 0.0), axis=-1, keepdims=True), _EPS)
    return jnp.where((pos >= 0) & (pos < num_sinks), INF, s)


def _lag_head(x_k, x_v, part, scored, lag: int, cross_scoring: bool):
    """LagKV's scores for one head's candidates sorted by position: x_k, x_v [C, D], part [C] (each one's
    partition, -1 for sinks and invalid), scored [C] (partitions with a complete successor). Each candidate of
    partition p is normalised by partition p + 1's per-channel min and max, scored by the std over channels
    (unbiased, as torch), softmax within its partition, keys and values averaged; then (cross_scoring False)
    its rank inside its partition / lag. -> [C] (0 where part is -1)."""
    c = part.shape[0]
    new = jnp.concatenate([jnp.ones((1,), bool), part[1:] != part[:-1]])
    seg = jnp.cumsum(new) - 1  # dense partition index in sorted order [C]
    seg_part = jax.ops.segment_max(part, seg, num_segments=c)  # partition number of each segment
    nxt = jnp.clip(seg + 1, 0, c - 1)
    has_ref = scored & (seg + 1 < c) & (seg_part[nxt] == part + 1)

    def one(x):
        big = jnp.where((part >= 0)[:, None], x, jnp.inf)
        lo = jax.ops.segment_min(big, seg, num_segments=c)[nxt]  # [C, D] the next partition's min
        hi = jax.ops.segment_max(jnp.where((part >= 0)[:, None], x, -jnp.inf), seg, num_segments=c)[nxt]
        z = (x - lo) / jnp.where(hi > lo, hi - lo, 1.0)  # a one-member successor: no range, x - lo
        d = x.shape[-1]
        std = jnp.sqrt(jnp.sum((z - jnp.mean(z, -1, keepdims=True)) ** 2, -1) / (d - 1))
        std = jnp.where(has_ref, std, -jnp.inf)
        top = jax.ops.segment_max(std, seg, num_segments=c)[seg]
        e = jnp.where(has_ref, jnp.exp(std - top), 0.0)
        return e / jnp.maximum(jax.ops.segment_sum(e, seg, num_segments=c)[seg], _EPS)

    s = (one(x_k.astype(jnp.float32)) + one(x_v.astype(jnp.float32))) / 2
    if not cross_scoring:  # rank inside the partition (ties: the earlier position ranks lower) / lag
        idx = jnp.arange(c)
        key = jnp.where(has_ref, seg, -1)  # a partition's members all have a reference or none has
        order = jnp.lexsort((idx, s, key))  # by partition, then score, then position
        k_sorted = key[order]
        first = jnp.concatenate([jnp.ones((1,), bool), k_sorted[1:] != k_sorted[:-1]])
        start = jax.lax.cummax(jnp.where(first, idx, 0))  # sorted index of each one's partition start
        rank = jnp.zeros((c,), jnp.int32).at[order].set(idx - start)
        s = rank.astype(jnp.float32) / lag
    return jnp.where(has_ref, s, 0.0)


def lagkv(k, v, attn, pos, *, n_sink: int = 4, lag_size: int = 128, cross_scoring: bool = False, **_):
    """LagKV (kvpress LagKVPress): positions after the `n_sink` sinks fall in partitions of `lag_size`; with
    `seen` = the last query's position + 1 (the prompt so far, decoded tokens included), each complete
    partition that has a complete successor is scored against it (`_lag_head`), the last complete partition
    and the incomplete rest score 1 (kept first, as the sinks); a partition whose successor has no candidate
    left in the cache scores 0, and a successor channel without range (one member) normalises by 1; below
    `n_sink + 2 * lag_size` seen tokens the score is (pos - n_sink) / (seen - n_sink) (the most recent kept),
    sinks 1."""
    seen = (attn.last_pos + 1)[:, None, None]  # [B, 1, 1]
    valid = pos >= 0
    sink = valid & (pos < n_sink)
    recency = (pos - n_sink).astype(jnp.float32) / jnp.maximum(seen - n_sink, 1).astype(jnp.float32)
    full = (seen - n_sink) // lag_size  # complete partitions [B, 1, 1]
    part = jnp.where(valid & ~sink, (pos - n_sink) // lag_size, -1)
    scored = (part >= 0) & (part < full - 1)
    order = jnp.argsort(jnp.where(valid, pos, jnp.iinfo(jnp.int32).max), axis=-1)
    take = lambda a: jnp.take_along_axis(a, order, axis=-1)  # noqa: E731
    ks = jnp.take_along_axis(k, order[..., None], axis=2)
    vs = jnp.take_along_axis(v, order[..., None], axis=2)
    head = jax.vmap(jax.vmap(lambda a, b_, p, m: _lag_head(a, b_, p, m, lag_size, cross_scoring)))
    s_sorted = head(ks, vs, take(part), take(scored))
    s = jnp.take_along_axis(s_sorted, jnp.argsort(order, axis=-1), axis=-1)
    lag = jnp.where(sink | ~scored, 1.0, s)
    short = seen < n_sink + 2 * lag_size
    return jnp.where(short, jnp.where(sink, 1.0, recency), lag)


def rope_table(inv_freq: jax.Array, positions: int) -> jax.Array:
    """cos and sin [2, P, R/2] of positions 0 .. P - 1 times inv_freq [R/2] (fp32, the same values `unrotate`
    computes from the positions)."""
    f = jnp.arange(positions, dtype=jnp.int32).astype(jnp.float32)[:, None] * inv_freq  # [P, R/2]
    return jnp.stack([jnp.cos(f), jnp.sin(f)])


def unrotate(k: jax.Array, pos: jax.Array, attn: AttnInfo) -> jax.Array:
    """Pre-RoPE keys from the cached (post-RoPE) ones: k [B, K, C, D] rotated back by its positions' RoPE
    (the inverse rotation divided by the RoPE scale; dims past the rotated ones unchanged), fp32. cos and
    sin are read from `attn.rope_table` when given (XLA:CPU evaluates them slowly at large angles and repeats
    them in each fused consumer: 3x the rest of `leverage` at 8k positions), else computed."""
    half = attn.inv_freq.shape[-1]
    if attn.rope_table is not None:
        cs = jnp.take(attn.rope_table, jnp.maximum(pos, 0), axis=1, mode="clip")  # [2, B, K, C, R/2]
        c, s = cs[0] / attn.rope_scale, cs[1] / attn.rope_scale
    else:
        f = jnp.maximum(pos, 0).astype(jnp.float32)[..., None] * attn.inv_freq  # [B, K, C, R/2]
        c, s = jnp.cos(f) / attn.rope_scale, jnp.sin(f) / attn.rope_scale
    k = k.astype(jnp.float32)
    y1, y2, rest = k[..., :half], k[..., half:2 * half], k[..., 2 * half:]
    return jnp.concatenate([c * y1 + s * y2, c * y2 - s * y1, rest], axis=-1)


def _row_zscore(s: jax.Array, valid: jax.Array) -> jax.Array:
    """Z-score [B, K, C] over each row's valid candidates of every head (std unbiased, floored at 1e-6, as
    kvpress's `scores.std().clamp_min(1e-6)`)."""
    w = valid.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w, axis=(1, 2), keepdims=True), 2.0)
    mean = jnp.sum(jnp.where(valid, s, 0.0), axis=(1, 2), keepdims=True) / n
    var = jnp.sum(jnp.where(valid, (s - mean) ** 2, 0.0), axis=(1, 2), keepdims=True) / (n - 1)
    return (s - mean) / jnp.maximum(jnp.sqrt(var), 1e-6)


def leverage(k, v, attn, pos, *, sketch_dimension: int = 48, ridge: float = 1e-2, seed: int = 0, **_):
    """Leverage scores (kvpress LeverageScorePress): the candidates' pre-RoPE keys (`unrotate`), centred over
    the head's valid candidates, projected on a Gaussian sketch [D, sketch_dimension] / sqrt(sketch_dimension)
    drawn per layer and KV head from `seed`; score x_i (X^T X + ridge I)^-1 x_i^T (>= 0), z-scored over the
    row (kvpress: over the batch; it draws a new sketch every call)."""
    valid = pos >= 0
    x = unrotate(k, pos, attn)
    xc = (x - masked_mean(x, valid)) * valid[..., None]
    kh, d = k.shape[1], k.shape[-1]
    key = jax.random.fold_in(jax.random.PRNGKey(seed), attn.layer)
    phi = jax.random.normal(key, (kh, d, sketch_dimension)) / math.sqrt(sketch_dimension)
    proj = jnp.einsum("bkcd,kdm->bkcm", xc, phi)
    gram = jnp.einsum("bkcm,bkcn->bkmn", proj, proj) + ridge * jnp.eye(sketch_dimension)
    # x G^-1 x^T = ||L^-1 x||^2 with G = L L^T (as kvpress's Cholesky solve; L^-1 by `tril_inverse`: XLA:CPU's
    # triangular solve, behind jnp.linalg.solve, costs milliseconds per call even at m = 48)
    y = jnp.einsum("bkcm,bknm->bkcn", proj, tril_inverse(jnp.linalg.cholesky(gram)))  # [B, K, C, m]
    lev = jnp.maximum(jnp.sum(y * y, axis=-1), 0.0)
    return _row_zscore(lev, valid)


def tril_inverse(lower: jax.Array) -> jax.Array:
    """Inverse of lower-triangular matrices [..., n, n] by blocks ([[A, 0], [C, D]]^-1 = [[A^-1, 0],
    [-D^-1 C A^-1, D^-1]]), forward substitution below 7 rows: matmuls only, no triangular-solve op."""
    n = lower.shape[-1]
    if n <= 6:
        rows = []
        for i in range(n):
            r = jnp.broadcast_to(jnp.eye(n, dtype=lower.dtype)[i], lower.shape[:-1])
            for j in range(i):
                r = r - lower[..., i, j, None] * rows[j]
            rows.append(r / lower[..., i, i, None])
        return jnp.stack(rows, axis=-2)
    h = n // 2
    ai, di = tril_inverse(lower[..., :h, :h]), tril_inverse(lower[..., h:, h:])
    low = -jnp.matmul(di, jnp.matmul(lower[..., h:, :h], ai))
    top = jnp.concatenate([ai, jnp.zeros((*ai.shape[:-1], n - h), lower.dtype)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([low, di], axis=-1)], axis=-2)


def rotate(q: jax.Array, q_pos: jax.Array, inv_freq: jax.Array, scale: float = 1.0, table=None) -> jax.Array:
    """RoPE applied to pre-RoPE queries q [B, S, Nq, D] at positions q_pos [B, S] (cos and sin times `scale`,
    read from `table` (`rope_table`) when given; dims past the rotated ones unchanged): the inverse of
    `unrotate`, fp32."""
    half = inv_freq.shape[-1]
    if table is not None:
        cs = jnp.take(table, jnp.maximum(q_pos, 0), axis=1, mode="clip")[:, :, :, None]  # [2, B, S, 1, R/2]
        c, s = cs[0] * scale, cs[1] * scale
    else:
        f = jnp.maximum(q_pos, 0).astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, S, 1, R/2]
        c, s = jnp.cos(f) * scale, jnp.sin(f) * scale
    q = q.astype(jnp.float32)
    x1, x2, rest = q[..., :half], q[..., half:2 * half], q[..., 2 * half:]
    return jnp.concatenate([c * x1 - s * x2, c * x2 + s * x1, rest], axis=-1)


def tile_attention(q: jax.Array, k: jax.Array, members: tuple[jax.Array, ...], chunk: int
                   ) -> tuple[jax.Array, ...]:
    """Non-causal attention inside tiles (Compactor): the block's members (each of `members` a [B, S] bool
    mask of contiguous positions, each a subset of the first; tiles of `chunk` tokens from each row's first
    member of the first mask, shared by all, so the logits are computed once); every member query attends to
    the member keys of its tile, unscaled logits q.k (kvpress's `non_causal_chunked_attn`), softmax in fp32;
    each key gets the sum it receives over its tile's queries, GQA-mean. q [B, S, Nq, D] post-RoPE,
    k [B, K, S, D] -> one [B, K, S] fp32 per mask (0 for non-members). Unlike kvpress, a partial last tile
    is masked exactly (kvpress pads it with zero queries, which then attend to every key, and pads keys with
    logit -1e-9 instead of -inf). A subset mask tiles as it would on its own when it holds the first mask's
    first member (else its tiles may start earlier than its own first member)."""
    b, s, nq, d = q.shape
    kh = k.shape[1]
    ce = min(chunk, s)  # a tile never needs more than the block
    s_pad = -(-s // ce) * ce
    nc = s_pad // ce
    first = jnp.argmax(members[0], axis=1)  # [B] first member's index
    idx = jnp.arange(s_pad)[None, :] + first[:, None]  # [B, S_pad] shifted so tiles start at the first member
    inside = idx < s
    idx = jnp.minimum(idx, s - 1)
    qg = jnp.take_along_axis(q.astype(jnp.float32), idx[:, :, None, None], axis=1)  # [B, S_pad, Nq, D]
    kg = jnp.take_along_axis(jnp.swapaxes(k, 1, 2).astype(jnp.float32), idx[:, :, None, None], axis=1)
    qg = qg.reshape(b, nc, ce, kh, nq // kh, d)
    kg = kg.reshape(b, nc, ce, kh, d)
    dots = jnp.einsum("bnikgd,bnjkd->bnkgij", qg, kg)  # [B, nc, K, G, ce, ce]
    back = jnp.clip(jnp.arange(s)[None, :] - first[:, None], 0, s_pad - 1)  # [B, S]
    out = []
    for member in members:
        m = jnp.take_along_axis(member, idx, axis=1) & inside  # [B, S_pad]
        mt = m.reshape(b, nc, ce)
        probs = jax.nn.softmax(jnp.where(mt[:, :, None, None, None, :], dots, -1e30), axis=-1)
        col = jnp.mean(jnp.sum(probs * mt[:, :, None, None, :, None], axis=-2), axis=3)  # [B, nc, K, ce]
        col = jnp.moveaxis(col, 2, 1).reshape(b, kh, s_pad)  # shifted coordinates
        got = jnp.take_along_axis(col, jnp.broadcast_to(back[:, None], (b, kh, s)), axis=-1)
        out.append(jnp.where(member[:, None, :], got, 0.0))
    return tuple(out)


def compactor_tiles(v, weights, *, k, q_pos, rope, hyper, **_) -> jax.Array:
    """Compactor's per-token feature, computed once when a token enters (`Policy.token_feature`): the
    non-causal tile attention it receives inside its block (`tile_attention`). Members are the block's tokens
    past the first `sink_size_start` positions; the block's newest `sink_size_end` tokens (protected at this
    boundary) are left out of the others' tiles, as kvpress leaves the prompt's last tokens out, and get
    theirs from the same tiling with them in. v [B, K, S, D], k [B, K, S, D] post-RoPE -> [B, K, S] fp32."""
    queries, inv_freq, scale, table = rope
    start, end, chunk = hyper["sink_size_start"], hyper["sink_size_end"], hyper["chunk_size"]
    q = rotate(queries, q_pos, inv_freq, scale, table)
    last = jnp.max(q_pos, axis=1, keepdims=True)  # [B, 1]
    every = (q_pos >= 0) & (q_pos >= start)
    core = every & (q_pos <= last - end)  # empty, or holding every's first member (positions contiguous)
    a_every, a_core = tile_attention(q, k, (every, core), chunk)
    return jnp.where(core[:, None], a_core, a_every)


def compactor(k, v, attn, pos, *, slots: int, blending: float | None = None, sink_size_start: int = 8,
              sink_size_end: int = 4, sketch_dimension: int = 48, ridge: float = 1e-2, seed: int = 0, **_):
    """Compactor (kvpress CompactorPress): blending * leverage + z-score(avg-pool_3(tile attention * ||v||)),
    both over the unprotected candidates (the first `sink_size_start` positions and the newest `sink_size_end`
    tokens are protected); leverage as `leverage` (same sketch for the same seed and layer), the tile
    attention carried per slot (`compactor_tiles`), pooled over the unprotected candidates sorted by position;
    blending=None: the compression ratio 1 - N / (tokens seen so far), floored at 0 (kvpress: its
    compression_ratio, the same in full-prefill mode)."""
    if attn.feature is None:
        raise ValueError("compactor reads its tile attention from attn.feature (Policy.token_feature "
                         "compactor_tiles); combine it only with policies that carry no other feature")
    valid = pos >= 0
    last = attn.last_pos[:, None, None]  # [B, 1, 1]
    protected = valid & ((pos < sink_size_start) | (pos > last - sink_size_end))
    free = valid & ~protected
    fpos = jnp.where(free, pos, -1)
    lev = leverage(k, v, attn, fpos, sketch_dimension=sketch_dimension, ridge=ridge, seed=seed)
    vnorm = jnp.sqrt(jnp.sum(jnp.square(v.astype(jnp.float32)), axis=-1))
    pooled = _pool_by_position(attn.feature * vnorm, fpos, 3, "avg")
    if blending is None:
        blend = jnp.maximum(1.0 - slots / (last + 1).astype(jnp.float32), 0.0)
    else:
        blend = blending
    return jnp.where(protected, INF, blend * lev + _row_zscore(pooled, free))


def replay_attention(q_r, r_pos, k_r, cand_k, cand_pos, q_pos, *, n_sink: int = 4, window=None,
                     h_norm=None, wov=None) -> jax.Array:
    """KVzip's score of a block's tokens: the most attention each receives from the replay's queries (max
    over the replay and the GQA group), the softmax (logits q.k / sqrt(D)) running over the sinks (positions
    < n_sink before the block), the block and the replay itself (causal), as kvpress's
    `_compute_cross_attention`. q_r [B, R, Nq, D] post-RoPE at r_pos [B, R] (-1 = padding), k_r [B, K, R, D];
    cand_k [B, K, C, D] / cand_pos [B, K, C] the layer's candidates (cache view, then the S block tokens at
    q_pos [B, S]). KVzip+ (`h_norm` [B, R] the replay's normed hidden states' norms, `wov` [B, K, G, C + R]
    ||W_o v|| per query head): weights / ||h|| per query, times ||W_o v|| per key. -> [B, K, S] fp32."""
    b, r, nq, d = q_r.shape
    kh, c = cand_k.shape[1], cand_k.shape[2]
    s = q_pos.shape[1]
    g = nq // kh
    qg = q_r.astype(jnp.float32).reshape(b, r, kh, g, d)
    keys = jnp.concatenate([cand_k, k_r], axis=2).astype(jnp.float32)  # [B, K, C + R, D]
    logits = jnp.einsum("brkgd,bkcd->bkgrc", qg, keys) / math.sqrt(d)  # [B, K, G, R, C + R]
    first = jnp.min(jnp.where(q_pos >= 0, q_pos, jnp.iinfo(jnp.int32).max), axis=1)  # [B] block's first
    in_block = jnp.arange(c) >= c - s  # [C]
    sink = (cand_pos >= 0) & (cand_pos < n_sink) & (cand_pos < first[:, None, None])
    cand_ok = (in_block & (cand_pos >= 0)) | sink  # [B, K, C]
    kpos = jnp.concatenate([cand_pos, jnp.broadcast_to(r_pos[:, None], (b, kh, r))], axis=-1)  # [B, K, C+R]
    qp = r_pos[:, None, :, None]  # [B, 1, R, 1]
    ok = jnp.concatenate([jnp.broadcast_to(cand_ok[:, :, None], (b, kh, r, c)),
                          (kpos[:, :, None, c:] >= 0) & (kpos[:, :, None, c:] <= qp)], axis=-1)
    if window is not None:
        ok &= (qp - kpos[:, :, None, :]) < window
    probs = jax.nn.softmax(jnp.where(ok[:, :, None], logits, -1e30), axis=-1)  # [B, K, G, R, C + R]
    if h_norm is not None:
        probs = probs / jnp.maximum(h_norm, 1e-30)[:, None, None, :, None] * wov[:, :, :, None, :]
    live = (r_pos >= 0)[:, None, None, :, None]
    return jnp.max(jnp.where(live, probs[..., c - s:c], 0.0), axis=(2, 3))  # [B, K, S]


def kvzip(k, v, attn, pos, *, n_sink: int = 4, **_):
    """KVzip (kvpress KVzipPress): each token's replay score (`replay_attention`, computed once when it
    entered and carried per slot); the first `n_sink` positions kept."""
    if attn.feature is None:
        raise ValueError("kvzip reads its replay scores from attn.feature: run it through the engine (the "
                         "programs replay every block; Policy.replay)")
    return jnp.where((pos >= 0) & (pos < n_sink), INF, attn.feature)

"""Fixed-size evicting KV cache and the pure eviction operators (`keep_mask`,
`topk_gather`, slot replacement).

Layers without a KV cache (Qwen3.5's Gated DeltaNet) keep a `LinearState` in the same tuple instead.

Slots hold tokens in no particular order; `pos` gives each slot's
absolute position (-1 = empty). """

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from vdjax.engine import quant as kvq
from vdjax.engine.quant import scatter_slots  # noqa: F401  (the cache's slot write, used by evict)
from vdjax.models.deltanet import LinearState


@flax.struct.dataclass
class QueryStats:
    """Running statistics of a layer's pre-RoPE queries, carried in the cache for scores that read them
    (expected attention): count n [B], mean [B, Nq, D] and the sum of centred outer products m2 [B, Nq, D, D]
    (covariance = m2 / n), all fp32."""

    n: jax.Array
    mean: jax.Array
    m2: jax.Array

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int) -> QueryStats:
        """No query seen yet."""
        return cls(jnp.zeros((batch,), jnp.float32), jnp.zeros((batch, heads, head_dim), jnp.float32),
                   jnp.zeros((batch, heads, head_dim, head_dim), jnp.float32))

    @staticmethod
    def of(q: jax.Array, use: jax.Array) -> QueryStats:
        """The statistics of the queries q [B, S, Nq, D] where use [B, S] (two-pass: centred, then summed)."""
        w = use.astype(jnp.float32)  # [B, S]
        n = jnp.sum(w, axis=1)
        q = q.astype(jnp.float32)
        mean = jnp.einsum("bsnd,bs->bnd", q, w) / jnp.maximum(n, 1.0)[:, None, None]
        c = (q - mean[:, None]) * w[:, :, None, None]
        return QueryStats(n, mean, jnp.einsum("bsni,bsnj->bnij", c, c))

    def merge(self, other: QueryStats) -> QueryStats:
        """Both sets of queries together (Chan et al.'s pairwise update: exact, no sum of squares)."""
        n = self.n + other.n
        safe = jnp.maximum(n, 1.0)[:, None, None]
        delta = other.mean - self.mean  # [B, Nq, D]
        mean = self.mean + delta * (other.n[:, None, None] / safe)
        cross = (self.n * other.n)[:, None, None, None] / safe[..., None]
        return QueryStats(n, mean, self.m2 + other.m2 + cross * delta[..., :, None] * delta[..., None, :])

    @property
    def cov(self) -> jax.Array:
        """Covariance [B, Nq, D, D] (divided by n, as kvpress's ExpectedAttentionPress)."""
        return self.m2 / jnp.maximum(self.n, 1.0)[:, None, None, None]


@flax.struct.dataclass
class LayerCache:
    """One layer's cache: k, v [B, K, N, D]; pos [B, K, N] int32 (-1 empty); acc [B, K, N] accumulated
    attention.

    A head-adaptive policy's layer holds a pool instead (`kv_heads` = K > 0): the K heads share P = K * N
    slots, k, v [B, 1, P, D], pos and acc [B, 1, P], and `head` [B, 1, P] int32 names the KV head each slot
    belongs to (-1 empty). `view` shows the pool as the usual [B, K, P, ...] layout, each head seeing only
    its own slots."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    acc: jax.Array
    head: Any = None  # [B, 1, P] int32 for a pool, else None
    kv_heads: int = flax.struct.field(pytree_node=False, default=0)  # K of a pool, 0 for per-head slots
    stats: Any = None  # `QueryStats` of the queries seen so far, for a policy that reads them; else None
    feat: Any = None  # [B, K, N] ([B, 1, P]) a per-token feature computed once when the token entered
    # (`Policy.token_feature`, e.g. CriticalKV's ||W_o v||_1); else None

    @property
    def pooled(self) -> bool:
        """Whether the layer's heads share one slot pool (head-adaptive budgets)."""
        return self.kv_heads > 0

    @property
    def valid(self) -> jax.Array:
        """Slots holding a token: [B, K, N] bool ([B, 1, P] for a pool)."""
        return self.pos >= 0

    @classmethod
    def empty(cls, batch: int, kv_heads: int, slots: int, head_dim: int, dtype, pooled: bool = False,
              quant: tuple[int, int, str, str] | None = None) -> LayerCache:
        """`slots` empty slots per head, or (`pooled`) one pool of kv_heads * slots slots; `quant` (bits,
        group, key layout, value layout): keys and values stored as `quant.QuantTensor`s (codes + per-group
        scales), never in `dtype`."""
        shape = (batch, 1, kv_heads * slots) if pooled else (batch, kv_heads, slots)

        def kv(layout=kvq.LAYOUT):
            if quant is None:
                return jnp.zeros(shape + (head_dim,), dtype)
            return kvq.empty(shape + (head_dim,), quant[0], quant[1], dtype, layout=layout)

        k_layout, v_layout = (kvq.LAYOUT, kvq.LAYOUT) if quant is None else quant[2:]
        return cls(k=kv(k_layout), v=kv(v_layout),
                   pos=jnp.full(shape, -1, jnp.int32), acc=jnp.zeros(shape, jnp.float32),
                   head=jnp.full(shape, -1, jnp.int32) if pooled else None,
                   kv_heads=kv_heads if pooled else 0)

    @property
    def quantized(self) -> bool:
        """Whether keys and values are stored quantized (`quant.QuantTensor`)."""
        return isinstance(self.k, kvq.QuantTensor)

    def dense(self) -> LayerCache:
        """The cache as attention and scores read it: a quantized cache's keys and values dequantized (in
        their logical dtype); the cache itself otherwise."""
        if not self.quantized:
            return self
        return self.replace(k=kvq.dequantize(self.k), v=kvq.dequantize(self.v))

    def kv_nbytes(self) -> int:
        """Bytes of the stored keys and values (a quantized cache's codes + scales + zeros)."""
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves((self.k, self.v)))

    def view(self) -> LayerCache:
        """The per-head layout attention and scores read: a pool's k, v, acc broadcast to [B, K, P, ...] and
        pos [B, K, P] with the other heads' slots shown empty (-1); the cache itself when not pooled (a
        quantized cache's keys and values dequantized first)."""
        if not self.pooled:
            return self
        if self.quantized:
            return self.dense().view()
        b, _, p = self.pos.shape
        kh = self.kv_heads
        mine = self.head == jnp.arange(kh, dtype=jnp.int32)[None, :, None]  # [B, K, P]
        return LayerCache(jnp.broadcast_to(self.k, (b, kh) + self.k.shape[2:]),
                          jnp.broadcast_to(self.v, (b, kh) + self.v.shape[2:]),
                          jnp.where(mine, self.pos, -1), jnp.broadcast_to(self.acc, (b, kh, p)),
                          stats=self.stats,
                          feat=None if self.feat is None else jnp.broadcast_to(self.feat, (b, kh, p)))

    def head_counts(self) -> jax.Array:
        """Valid slots per row and KV head: [B, K]."""
        if not self.pooled:
            return jnp.sum(self.pos >= 0, axis=-1)
        return jnp.sum(self.view().pos >= 0, axis=-1)

    def head_positions(self) -> list[list[np.ndarray]]:
        """Per row, per KV head: the sorted absolute positions held (int32 arrays)."""
        pos = np.asarray(self.pos)  # [B, K, N] or [B, 1, P]
        if not self.pooled:
            return [[np.sort(h[h >= 0]).astype(np.int32) for h in row] for row in pos]
        head = np.asarray(self.head)[:, 0]
        return [[np.sort(p[0][(hd == h) & (p[0] >= 0)]).astype(np.int32) for h in range(self.kv_heads)]
                for p, hd in zip(pos, head, strict=True)]


@flax.struct.dataclass
class KVCache:
    """Every layer's cache: a `LayerCache` per attention layer, a `LinearState` (no KV cache: a fixed-size
    recurrent state) per Gated DeltaNet layer. `cache[i]` / `cache.layer(i)` gives layer i's.

    `k`, `v`, `pos`, `acc` stack the attention layers ([La, B, K, N, ...], layer indices `attention_layers`)
    for inspection; they copy, so use them outside hot loops. Sliding-window layers of evicting policies hold
    `min(N, W - 1)` slots (at most W - 1 tokens are ever live there); the stacked views
    pad them to N with empty slots.
    """

    layers: tuple[Any, ...]

    @classmethod
    def empty(cls, num_layers, batch, kv_heads, slots, head_dim, dtype) -> KVCache:
        """An empty cache of `slots` slots per head in every layer (an int, or one int per layer)."""
        per_layer = (slots,) * num_layers if isinstance(slots, int) else tuple(slots)
        return cls(tuple(LayerCache.empty(batch, kv_heads, n, head_dim, dtype) for n in per_layer))

    @classmethod
    def for_model(cls, cfg, batch: int, slots, dtype, pooled: bool = False, stats: bool = False,
                  feat: bool = False, quant: tuple[int, int] | None = None) -> KVCache:
        """An empty cache for a model config: `slots[i]` slots per head on each attention layer (`pooled`: one
        pool of K * slots[i] slots shared by the K heads; `stats`: empty `QueryStats` carried; `feat`: a
        per-token feature slot), a zero state on each Gated DeltaNet layer."""
        def attention(i):
            lc = LayerCache.empty(batch, cfg.num_kv_heads, slots[i], cfg.head_dim, dtype, pooled, quant)
            if stats:
                lc = lc.replace(stats=QueryStats.empty(batch, cfg.num_heads, cfg.head_dim))
            return lc.replace(feat=jnp.zeros_like(lc.acc)) if feat else lc

        return cls(tuple(attention(i) if cfg.attends(i) else LinearState.empty(cfg, batch, dtype)
                         for i in range(cfg.num_layers)))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers with a KV cache."""
        return tuple(i for i, c in enumerate(self.layers) if isinstance(c, LayerCache))

    def _kv(self) -> list[LayerCache]:
        return [c for c in self.layers if isinstance(c, LayerCache)]

    @property
    def budget(self) -> int:
        """Slots per head N (the largest layer's; sliding layers may hold fewer)."""
        return max(c.pos.shape[-1] for c in self._kv())

    @property
    def slots(self) -> tuple[int, ...]:
        """Slots per head of each attention layer (a pool's total: K * N)."""
        return tuple(c.pos.shape[-1] for c in self._kv())

    def __len__(self) -> int:
        return len(self.layers)

    def layer(self, i: int):
        """Layer i's cache (a LayerCache, or a LinearState for a Gated DeltaNet layer)."""
        return self.layers[i]

    __getitem__ = layer

    def _stack(self, name: str, fill) -> jax.Array:
        """One field of every attention layer stacked on a leading axis, smaller layers padded at the end."""
        n = self.budget
        parts = []
        for c in self._kv():
            a = getattr(c.dense(), name)
            pad = [(0, 0)] * a.ndim
            pad[2] = (0, n - a.shape[2])
            parts.append(jnp.pad(a, pad, constant_values=fill))
        return jnp.stack(parts)

    @property
    def k(self) -> jax.Array:
        """Keys of all attention layers [La, B, K, N, D] (padded slots are zeros)."""
        return self._stack("k", 0)

    @property
    def v(self) -> jax.Array:
        """Values of all attention layers [La, B, K, N, D]."""
        return self._stack("v", 0)

    @property
    def pos(self) -> jax.Array:
        """Slot positions of all attention layers [La, B, K, N] (-1 empty or padded)."""
        return self._stack("pos", -1)

    @property
    def acc(self) -> jax.Array:
        """Accumulated attention of all attention layers [La, B, K, N]."""
        return self._stack("acc", 0.0)

    def valid_counts(self):
        """Valid slots per attention layer, row and KV head (a pool's counted by head): [La, B, K]."""
        return jnp.stack([c.head_counts() for c in self._kv()])

    def kept_positions(self) -> list[list[list[np.ndarray]] | None]:
        """Per layer, per row, per KV head: the sorted absolute positions the cache holds (int32 arrays); None
        for a layer without a KV cache (Gated DeltaNet). For inspecting decisions, whatever the slot order."""
        return [lc.head_positions() if isinstance(lc, LayerCache) else None for lc in self.layers]

    def nbytes(self) -> int:
        """Bytes held by the cache arrays (DeltaNet states included)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.layers))

    def kv_nbytes(self) -> int:
        """Bytes of the stored keys and values of every attention layer (quantized: codes + scales)."""
        return sum(c.kv_nbytes() for c in self._kv())

    def dense_nbytes(self, tokens: int, dtype=None) -> int:
        """Bytes a dense cache of `tokens` tokens would hold: keys and values of every attention layer in
        `dtype` (None: the cache's compute dtype)."""
        total = 0
        for c in self._kv():
            *_, d = c.k.shape
            heads = max(c.kv_heads, 1) if c.pooled else c.pos.shape[1]
            size = jnp.dtype(dtype or c.k.dtype).itemsize
            total += 2 * c.pos.shape[0] * heads * d * size * tokens
        return int(total)


def kept_positions(cache: KVCache) -> list[list[list[np.ndarray]] | None]:
    """Per layer, per row, per KV head: the sorted absolute positions `cache` holds (see
    `KVCache.kept_positions`)."""
    return cache.kept_positions()


def rank_keys(scores: jax.Array, pos: jax.Array) -> jax.Array:
    """Scores made eviction-ready: invalid candidates -inf, NaN -> -inf, fp32."""
    s = jnp.nan_to_num(scores.astype(jnp.float32), nan=-jnp.inf)
    return jnp.where(pos >= 0, s, -jnp.inf)


def keep_mask(scores: jax.Array, pos: jax.Array, budget) -> jax.Array:
    """Which candidates survive: the top `budget` by (score desc, position asc), valid only. [..., C] bool.

    `budget` is an int, or an int array [...] (one budget per leading index, e.g. per head). Exact ties keep
    the earlier position; invalid candidates are never kept, and a set of at most `budget` valid candidates
    is kept whole.
    """
    c = scores.shape[-1]
    if isinstance(budget, (int, np.integer)) and budget >= c:
        return pos >= 0
    if not isinstance(budget, (int, np.integer)):
        budget = jnp.asarray(budget)[..., None]
    s = rank_keys(scores, pos)
    idx = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), s.shape)
    # ascending (score, -pos), invalid before everything of equal score: the first C - budget entries go
    tie = jnp.where(pos >= 0, -pos, jnp.iinfo(jnp.int32).min)
    _, _, order = jax.lax.sort((s, tie, idx), dimension=-1, num_keys=2)
    rank = jnp.argsort(order, axis=-1)  # position of each candidate in that order
    return (rank >= c - budget) & (pos >= 0)


def topk_gather(k, v, pos, scores, budget: int):
    """Reference eviction: gather the kept candidates into `budget` slots (k, v [..., C, D], pos [..., C]).

    Returns (k [..., N, D], v, pos [..., N]) with empty slots at pos -1. The pipeline uses the equivalent,
    copy-free slot replacement (`block_destinations` + `select_slots`); this is the plain
    operator for research code and tests.
    """
    keep = keep_mask(scores, pos, budget)
    # kept first (in candidate order), then the rest
    order = jnp.argsort(~keep, axis=-1, stable=True)[..., :budget]
    kept = jnp.take_along_axis(keep, order, axis=-1)
    gk = jnp.take_along_axis(k, order[..., None], axis=-2)
    gv = jnp.take_along_axis(v, order[..., None], axis=-2)
    gp = jnp.where(kept, jnp.take_along_axis(pos, order, axis=-1), -1)
    return gk, gv, gp


def _free_slots(free: jax.Array, count: int) -> jax.Array:
    """Indices [..., count] of the first `count` True entries of free [..., N] (N where there are fewer)."""
    n = free.shape[-1]
    idx = jnp.where(free, jnp.arange(n, dtype=jnp.int32), n)
    return jnp.sort(idx, axis=-1)[..., :count]


def block_destinations(keep: jax.Array, pos: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Slot replacement plan from a keep mask over N + S candidates.

    Returns (cache_pos [B, K, N]: old slots' positions with evicted ones set to -1,
    dest [B, K, S]: the slot each new token is written to, N = dropped). Surviving new tokens take the slots
    freed by evicted (or empty) ones, in order, so no kept slot moves.
    """
    s = keep.shape[-1] - n
    kept_old = keep[..., :n]
    cache_pos = jnp.where(kept_old, pos[..., :n], -1)
    slots = _free_slots(~kept_old, s)  # [B, K, S]
    keep_new = keep[..., n:]
    rank = jnp.cumsum(keep_new, axis=-1) - 1  # [B, K, S]
    dest = jnp.take_along_axis(slots, jnp.clip(rank, 0, s - 1), axis=-1)
    return cache_pos, jnp.where(keep_new, dest, n)


def single_destination(scores: jax.Array, pos: jax.Array, n: int) -> jax.Array:
    """Decode-step plan (one new token): the slot [B, K] it replaces, N if the new token itself is evicted.

    The evicted candidate is the minimum by (score asc, position desc) — the same order as `keep_mask` —
    found with reductions instead of a sort. Below budget an empty slot is always the minimum.
    """
    s = rank_keys(scores, pos)  # [B, K, N + 1]
    low = jnp.min(s, axis=-1, keepdims=True)
    i32 = jnp.iinfo(jnp.int32)
    latest = jnp.where(s == low, jnp.where(pos >= 0, pos, i32.max), i32.min)  # empty slots go first
    victim = jnp.argmax(latest == jnp.max(latest, axis=-1, keepdims=True), axis=-1)  # first index of the max
    return victim.astype(jnp.int32)


def select_slots(buf: jax.Array, dest: jax.Array, new: jax.Array) -> jax.Array:
    """Same result as `scatter_slots` for k/v rows, as one fused select: buf [B, K, N, D], new [B, K, S, D].

    Each slot takes new row j where dest[j] == slot, else keeps its row. XLA fuses this into a single pass
    over the layer's cache (no aliasing copies around an in-place scatter inside the loop).
    """
    s = dest.shape[-1]
    rows_new = jnp.broadcast_to(jnp.arange(s), dest.shape)  # [B, K, S] each new token's row
    src = scatter_slots(jnp.full(buf.shape[:3], -1, jnp.int32), dest, rows_new)  # [B, K, N] row per slot
    rows = jnp.take_along_axis(new, jnp.clip(src, 0, s - 1)[..., None], axis=2)  # [B, K, N, D]
    return jnp.where((src >= 0)[..., None], rows, buf)

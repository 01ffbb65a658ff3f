"""Eviction: score a layer's candidates with the bound policy, plan which survive (all layers of a block at
once), and write the survivors into the slots of the evicted ones. How a policy's cache is sized and updated
(`CacheRule`) lives here too."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from vdjax.engine import quant as kvq
from vdjax.engine.adaptive import adakv_keep, criticaladakv_keep, wo_l1_norm
from vdjax.engine.cache import (
    LayerCache,
    QueryStats,
    block_destinations,
    keep_mask,
    scatter_slots,
    select_slots,
    single_destination,
)
from vdjax.engine.policies import BoundPolicy, output_norm
from vdjax.engine.scores import AttnInfo, standardize


@dataclasses.dataclass(frozen=True)
class CacheRule:
    """How a bound policy's cache works; `cache_rule` picks it: the one place dense and evicting part.

    Evicting: N slots per head (min(N, W - 1) on a sliding layer; N_l per layer with layer budgets), the
    candidates scored and cut back to N at every block and step, room added for the question-agnostic
    protocol's question. Head-adaptive (`heads`): a layer's K heads share one pool of K * N slots and the
    layer keeps its best K * N candidates across heads (`adaptive`). Dense: indexed by position with room for
    the whole sequence, nothing evicted, the prefill one causal pass per layer.
    """

    evicts: bool
    heads: str | None = None  # head-adaptive rule ("adakv", "criticaladakv"): pooled slots
    layer_budgets: tuple[int, ...] | None = None  # per-head budget of every layer; None: uniform
    hyper: tuple = ()  # the bound keywords (the head rule reads its own)

    @property
    def causal_prefill(self) -> bool:
        """Whether the prefill is one causal pass over the prompt (block boundaries change nothing)."""
        return not self.evicts

    @property
    def grows_for_question(self) -> bool:
        """Whether the question protocol adds slots for the question (dense has room for it already)."""
        return self.evicts

    @property
    def pooled(self) -> bool:
        """Whether a layer's heads share one pool of slots."""
        return self.heads is not None

    def slots(self, budget, sequence: int) -> int:
        """Slots per head: the budget (the largest layer's with layer budgets), or the whole sequence
        (padded prompt + tokens to come) for dense."""
        if not self.evicts:
            return sequence
        return max(self.layer_budgets) if self.layer_budgets else budget

    def head_budgets(self, cfg, slots: int) -> tuple[int, ...]:
        """Per-head budget of every layer: N (N_l with layer budgets), but min(N, W - 1) on a sliding layer of
        an evicting policy (a Gated DeltaNet layer has no KV cache: the entry is unused).

        After every block and step a sliding layer holds only live tokens (next_pos - pos < W), at most W - 1
        of them, so the smaller cache keeps exactly the same tokens. Dense caches are
        indexed by position: N everywhere.
        """
        if not self.evicts:
            return (slots,) * cfg.num_layers
        per = self.layer_budgets or (slots,) * cfg.num_layers
        return tuple(max(1, min(n, cfg.window(i) - 1)) if cfg.window(i) is not None else max(1, n)
                     for i, n in enumerate(per))

    def layer_slots(self, cfg, slots: int) -> tuple[int, ...]:
        """Cache slots of every layer as allocated: `head_budgets` per head, K times that in a pool."""
        k = cfg.num_kv_heads if self.pooled else 1
        return tuple(k * n for n in self.head_budgets(cfg, slots))

    def update(self, bound: BoundPolicy, lc: LayerCache, k_new, v_new, probs, q_pos, window,
               layer, weights=None, rope=None, feature=None) -> Pending:
        """One attention layer's cache update for a block (k_new, v_new [B, K, S, D], probs [B, K, G, S, C]
        over `lc.view()`'s slots, then the block): an evicting policy scores the C = N + S candidates (`evict`
        plans them together with the other layers of the block; a pool is planned here); dense writes each
        token at slot = its position (planned at once). `weights`: the layer's, for scores that read them;
        `rope`: (the block's pre-RoPE queries [B, S, Nq, D] for a policy that reads them, else None; the
        layer's inverse RoPE frequencies; the RoPE scale; `scores.rope_table` or None); `feature`: the block
        tokens' per-token feature [B, K, S] where the programs computed it (KVzip's replay scores), else the
        policy's `token_feature`."""
        if not self.evicts:
            return Pending(lc, k_new, v_new, *(None,) * 3, *_dense_plan(lc, q_pos, window))
        if lc.pooled:
            return _pool_update(self, bound, lc, k_new, v_new, probs, q_pos, window, layer, weights, rope,
                                feature)
        *scored, stats, feat_new = _candidates(bound, lc, k_new, v_new, probs, q_pos, window, layer, weights,
                                               rope, feature=feature)
        return Pending(lc, k_new, v_new, *scored, stats=stats, feat_new=feat_new)


def cache_rule(bound: BoundPolicy) -> CacheRule:
    """The cache rule of a bound policy: dense keeps everything, every other policy evicts (in a pool shared
    by the heads when the policy is head-adaptive, with its per-layer budgets when it has them)."""
    if bound.is_dense:
        return CacheRule(evicts=False)
    return CacheRule(True, bound.policy.heads, bound.layer_budgets, bound.hyper)


def _candidates(bound: BoundPolicy, lc: LayerCache, k_new, v_new, probs, q_pos, window, layer,
                weights=None, rope=None, slots: int | None = None, feature=None):
    """Score one layer's N + S candidates (the cache slots, then the block): (scores [B, K, C] fp32, their
    positions [B, K, C] (-1 invalid; dead tokens of a sliding layer dropped), accumulated attention, the
    query statistics after this block (None unless the policy reads queries)).
    `slots`: the per-head budget the score is told (default the cache's N)."""
    b, kh, s, _ = k_new.shape
    n = lc.pos.shape[-1]
    new_pos = jnp.broadcast_to(q_pos[:, None, :], (b, kh, s))  # [B, K, S]
    cand_pos = drop_dead(jnp.concatenate([lc.pos, new_pos], axis=-1), q_pos, window)  # [B, K, C]
    acc = jnp.concatenate([lc.acc, jnp.zeros((b, kh, s), jnp.float32)], axis=-1)
    if bound.accumulates:
        valid_q = (q_pos >= 0).astype(jnp.float32)[:, None, :, None]  # [B, 1, S, 1]
        acc = acc + jnp.sum(jnp.mean(probs, axis=2) * valid_q, axis=2)
    extra, stats = {}, None
    if rope is not None:
        queries, inv_freq, scale, table = rope  # queries: None unless the policy reads them
        extra = dict(queries=queries, inv_freq=inv_freq, rope_scale=scale, rope_table=table)
        if bound.policy.query_stats:
            n_sink = dict(bound.hyper).get("n_sink", 0)
            stats = lc.stats.merge(QueryStats.of(queries, q_pos >= n_sink))
            extra.update(stats=stats)
    feat_new = None
    if feature is not None:  # computed by the programs (KVzip's replay)
        feat_new = feature.astype(jnp.float32)
        extra["feature"] = jnp.concatenate([lc.feat, feat_new], axis=-1)
    elif bound.policy.token_feature is not None:  # for the new tokens only; the cache carries the rest
        feat_new = bound.policy.token_feature(v_new, weights, k=k_new, q_pos=q_pos, rope=rope,
                                              hyper=dict(bound.hyper)).astype(jnp.float32)  # [B, K, S]
        extra["feature"] = jnp.concatenate([lc.feat, feat_new], axis=-1)
    attn = AttnInfo(probs=probs, q_pos=q_pos, acc=acc, layer=layer, weights=weights, **extra)
    cand_k = jnp.concatenate([lc.k, k_new], axis=2)  # [B, K, C, D]
    cand_v = jnp.concatenate([lc.v, v_new], axis=2)
    scores = bound.score(cand_k, cand_v, attn, cand_pos, slots=n if slots is None else slots)  # [B, K, C]
    return scores.astype(jnp.float32), cand_pos, acc, stats, feat_new


def _pool_update(rule: CacheRule, bound: BoundPolicy, pool: LayerCache, k_new, v_new, probs, q_pos, window,
                 layer, weights, rope, feature=None) -> Pending:
    """A head-adaptive layer's update, planned at once: the candidates (each head's pool slots, then the
    block's tokens for every head) scored in the per-head view, the layer's K * N survivors chosen across
    heads (`adaptive`), and the surviving new (head, token) pairs written into the freed pool slots."""
    b, kh, s, d = k_new.shape
    p = pool.pos.shape[-1]
    n = p // kh  # per-head budget
    view = pool.view()
    scores, cand_pos, acc, stats, feat_new = _candidates(bound, view, k_new, v_new, probs, q_pos, window,
                                                         layer, weights, rope, slots=n,
                                                         feature=feature)  # [B, K, P + S]
    hyper = dict(rule.hyper)
    if hyper.get("standardize"):  # heads compared on one scale: each head's scores z-scored first
        scores = standardize(scores, cand_pos >= 0)
    if rule.heads == "adakv":
        keep = adakv_keep(scores, cand_pos, n, hyper["alpha_safeguard"])
    else:
        if bound.policy.token_feature is output_norm:  # ||W_o v||_1, computed once per token
            vnorm = jnp.concatenate([view.feat, feat_new], axis=-1)
        else:  # the base carries a feature of its own: ||W_o v||_1 of every candidate
            vnorm = wo_l1_norm(jnp.concatenate([view.v, v_new], axis=2), weights["wo"])
        keep = criticaladakv_keep(scores, cand_pos, n, vnorm,
                                  hyper["alpha_safeguard"], hyper["critical_epsilon"],
                                  hyper["first_stage_ratio"])

    def flat(a):  # view [B, K, P + S] -> the pool's own candidates [B, 1, P + K * S]
        old = jnp.take_along_axis(a[:, :, :p], jnp.clip(pool.head, 0, kh - 1), axis=1)  # [B, 1, P]
        return jnp.concatenate([old, a[:, :, p:].reshape(b, 1, kh * s)], axis=-1)

    keep_f = flat(keep) & jnp.concatenate([pool.head >= 0, jnp.ones((b, 1, kh * s), bool)], axis=-1)
    pos_f, acc_f = flat(cand_pos), flat(acc)
    old_pos, dest = block_destinations(keep_f, pos_f, p)  # dest [B, 1, K * S]
    new_head = jnp.broadcast_to(jnp.repeat(jnp.arange(kh, dtype=jnp.int32), s), (b, 1, kh * s))
    head = scatter_slots(jnp.where(old_pos >= 0, pool.head, -1), dest, new_head)
    old_acc = jnp.where(old_pos >= 0, acc_f[..., :p], 0.0)
    return Pending(pool, k_new.reshape(b, 1, kh * s, d), v_new.reshape(b, 1, kh * s, d), dest=dest,
                   pos=scatter_slots(old_pos, dest, pos_f[..., p:]),
                   acc=scatter_slots(old_acc, dest, acc_f[..., p:]), head=head, stats=stats,
                   feat_new=None if feat_new is None else feat_new.reshape(b, 1, kh * s))


def drop_dead(p, q_pos, window):
    """Positions [B, K, C] with the tokens no future query of a sliding layer can see set to -1 (empty)."""
    if window is None:
        return p
    last_pos = jnp.max(q_pos, axis=1)[:, None, None]  # [B, 1, 1]
    return jnp.where(last_pos + 1 - p >= window, -1, p)


def plan_eviction(scores, cand_pos, acc, n: int):
    """Which candidates stay, for a stack of layers with the same slot count N: scores, cand_pos, acc
    [..., B, K, N + S] -> (dest [..., B, K, S] (the slot each new token goes to, N = dropped), new pos and acc
    [..., B, K, N]). Survivors never move, so applying the plan writes only the new rows of k and v.

    Computed once for the stack of every layer of a block (not per layer): its sorts compile once."""
    s = cand_pos.shape[-1] - n
    if s == 1:  # decode: one victim per head, found by reductions
        victim = single_destination(scores, cand_pos, n)  # [..., B, K]
        dest = victim[..., None]  # [..., B, K, 1]
        old_pos, old_acc = cand_pos[..., :n], acc[..., :n]
    else:
        keep = keep_mask(scores, cand_pos, n)
        old_pos, dest = block_destinations(keep, cand_pos, n)
        old_acc = jnp.where(old_pos >= 0, acc[..., :n], 0.0)
    return dest, scatter_slots(old_pos, dest, cand_pos[..., n:]), scatter_slots(old_acc, dest, acc[..., n:])


def _dense_plan(lc: LayerCache, q_pos, window):
    """The dense cache is indexed by position: each new token goes to slot = its
    position (nothing evicted)."""
    b, kh, n = lc.pos.shape
    new_pos = jnp.broadcast_to(q_pos[:, None, :], (b, kh, q_pos.shape[1]))  # [B, K, S]
    dest = jnp.where(new_pos >= 0, new_pos, n)
    return dest, drop_dead(scatter_slots(lc.pos, dest, new_pos), q_pos, window), lc.acc


@dataclasses.dataclass
class Pending:
    """A layer's cache update waiting for its plan: the candidates' (scores, positions, accumulated attention)
    [B, K, N + S] of an evicting policy, or the plan itself (dest [B, K, S], the slot of each new token with N
    = dropped; pos and acc [B, K, N] after the update) once known (dense: at once)."""

    cache: LayerCache
    k_new: Any  # [B, K, S, D]
    v_new: Any
    scores: Any = None  # [B, K, N + S] fp32
    cand_pos: Any = None  # [B, K, N + S]
    cand_acc: Any = None  # [B, K, N + S]
    dest: Any = None  # [B, K, S]
    pos: Any = None  # [B, K, N]
    acc: Any = None  # [B, K, N]
    head: Any = None  # a pool's [B, 1, P] head of each slot after the update (k_new, v_new [B, 1, K * S, D])
    stats: Any = None  # the query statistics after the block (a policy that reads queries)
    feat_new: Any = None  # [B, K, S] the new tokens' per-token feature ([B, 1, K * S] for a pool)
    # the stored cache when `cache` is its dequantized reading (`LayerCache.dense`): the new tokens are
    # quantized into it
    store: Any = None

    @property
    def planned(self) -> bool:
        """Whether the plan is known (dense updates are planned when made)."""
        return self.dest is not None

    def apply(self, dest, pos, acc) -> LayerCache:
        """The new layer cache: the new tokens' k, v written at `dest` (a quantized store: quantized as they
        are written, codes and scales together), nothing else moved."""
        feat = None if self.feat_new is None else scatter_slots(self.cache.feat, dest, self.feat_new)
        if self.store is not None and self.store.quantized:
            kq, vq = self.store.k, self.store.v
            # a smooth-layout head not calibrated yet is calibrated on the new tokens it keeps
            kq = kvq.recalibrated(kq, self.k_new, dest < kq.data.shape[-2])
            k = kvq.put_slots(kq, dest, kvq.quantize_like(kq, self.k_new))
            v = kvq.put_slots(vq, dest, kvq.quantize_like(vq, self.v_new))
        else:
            k = select_slots(self.cache.k, dest, self.k_new)  # [B, K, N, D]
            v = select_slots(self.cache.v, dest, self.v_new)
        return LayerCache(k, v, pos, acc, self.head, self.cache.kv_heads, self.stats, feat)


def evict(x, updates: list):
    """Apply every layer's eviction of a block at once: the plans of the layers sharing a slot count are
    computed together (`plan_eviction` on their stacked scores). `updates` holds a `Pending` per attention
    layer (a Gated DeltaNet layer's new state as it is). Returns (x, the new per-layer caches)."""
    groups: dict[int, list[int]] = {}
    for i, u in enumerate(updates):
        if isinstance(u, Pending) and not u.planned:
            groups.setdefault(u.cache.pos.shape[-1], []).append(i)
    plans = {}
    for n, idx in groups.items():
        fields = ("scores", "cand_pos", "cand_acc")
        stacked = [jnp.stack([getattr(updates[i], f) for i in idx]) for f in fields]  # [L_n, B, K, N + S]
        dest, pos, acc = plan_eviction(*stacked, n)
        plans.update({i: (dest[j], pos[j], acc[j]) for j, i in enumerate(idx)})
    for i, u in enumerate(updates):
        if isinstance(u, Pending) and u.planned:
            plans[i] = (u.dest, u.pos, u.acc)
    # the writes wait for every layer's output, i.e. for every read of the old slots: XLA can write in place
    x, plans = jax.lax.optimization_barrier((x, plans))
    return x, tuple(u.apply(*plans[i]) if isinstance(u, Pending) else u for i, u in enumerate(updates))


def fill_tokens(cfg, bound: BoundPolicy, per_layer: tuple[int, ...], block: int, t: int) -> int:
    """How many leading prompt tokens an evicting prefill may run as one causal pass: whole blocks that fit
    every attention layer's slots, where nothing is evicted yet (a set of at most N valid candidates is kept
    whole, each new token in the next free slot, i.e. slot = position) and no token of a sliding layer dies.
    A per-token feature is computed there block by block (`programs._fill_feature`). 0 for a policy that
    accumulates attention, carries query statistics or replays (its state needs every block's scores)."""
    policy = bound.policy
    if bound.accumulates or policy.query_stats or policy.replay:
        return 0
    attending = [n for i, n in enumerate(per_layer) if cfg.attends(i)]
    room = min(attending) if attending else t
    return min(room // block * block, t)

"""Eviction: score a layer's candidates with the bound policy, plan which survive (all layers of a block at
once), and write the survivors into the slots of the evicted ones. How a policy's cache is sized and updated
(`CacheRule`) lives here too."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from vdjax.engine.cache import (
    LayerCache,
    block_destinations,
    keep_mask,
    scatter_slots,
    select_slots,
    single_destination,
)
from vdjax.engine.policies import BoundPolicy
from vdjax.engine.scores import AttnInfo


@dataclasses.dataclass(frozen=True)
class CacheRule:
    """How a bound policy's cache works; `cache_rule` picks it: the one place dense and evicting part.

    Evicting: N slots per head (min(N, W - 1) on a sliding layer), the candidates scored and cut back to N at
    every block and step, room added for the question-agnostic protocol's question. Dense: indexed by position
    with room for the whole sequence, nothing evicted, the prefill one causal pass per layer.
    """

    evicts: bool

    @property
    def causal_prefill(self) -> bool:
        """Whether the prefill is one causal pass over the prompt (block boundaries change nothing)."""
        return not self.evicts

    @property
    def grows_for_question(self) -> bool:
        """Whether the question protocol adds slots for the question (dense has room for it already)."""
        return self.evicts

    def slots(self, budget: int | None, sequence: int) -> int:
        """Slots per head: the budget, or the whole sequence (padded prompt + tokens to come) for dense."""
        return budget if self.evicts else sequence

    def layer_slots(self, cfg, slots: int) -> tuple[int, ...]:
        """Cache slots per layer: N, but min(N, W - 1) on a sliding layer of an evicting policy (a Gated
        DeltaNet layer has no KV cache: the entry is unused).

        After every block and step a sliding layer holds only live tokens (next_pos - pos < W), at most W - 1
        of them, so the smaller cache keeps exactly the same tokens. Dense caches are
        indexed by position: N everywhere.
        """
        return tuple(max(1, min(slots, cfg.window(i) - 1)) if self.evicts and cfg.window(i) is not None
                     else slots for i in range(cfg.num_layers))

    def update(self, bound: BoundPolicy, lc: LayerCache, k_new, v_new, probs, q_pos, window,
               layer) -> Pending:
        """One attention layer's cache update for a block (k_new, v_new [B, K, S, D], probs [B, K, G, S, C]):
        an evicting policy scores the C = N + S candidates (`evict` plans them together with the other layers
        of the block); dense writes each token at slot = its position (planned at once)."""
        if self.evicts:
            scored = _candidates(bound, lc, k_new, v_new, probs, q_pos, window, layer)
            return Pending(lc, k_new, v_new, *scored)
        return Pending(lc, k_new, v_new, *(None,) * 3, *_dense_plan(lc, q_pos, window))


def cache_rule(bound: BoundPolicy) -> CacheRule:
    """The cache rule of a bound policy: dense keeps everything, every other policy evicts."""
    return CacheRule(evicts=not bound.is_dense)


def _candidates(bound: BoundPolicy, lc: LayerCache, k_new, v_new, probs, q_pos, window, layer):
    """Score one layer's N + S candidates (the cache slots, then the block): (scores [B, K, C] fp32, their
    positions [B, K, C] (-1 invalid; dead tokens of a sliding layer dropped), accumulated attention)."""
    b, kh, s, _ = k_new.shape
    n = lc.pos.shape[-1]
    new_pos = jnp.broadcast_to(q_pos[:, None, :], (b, kh, s))  # [B, K, S]
    cand_pos = drop_dead(jnp.concatenate([lc.pos, new_pos], axis=-1), q_pos, window)  # [B, K, C]
    acc = jnp.concatenate([lc.acc, jnp.zeros((b, kh, s), jnp.float32)], axis=-1)
    if bound.accumulates:
        valid_q = (q_pos >= 0).astype(jnp.float32)[:, None, :, None]  # [B, 1, S, 1]
        acc = acc + jnp.sum(jnp.mean(probs, axis=2) * valid_q, axis=2)
    attn = AttnInfo(probs=probs, q_pos=q_pos, acc=acc, layer=layer)
    cand_k = jnp.concatenate([lc.k, k_new], axis=2)  # [B, K, C, D]
    cand_v = jnp.concatenate([lc.v, v_new], axis=2)
    scores = bound.score(cand_k, cand_v, attn, cand_pos, slots=n)  # [B, K, C]
    return scores.astype(jnp.float32), cand_pos, acc


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

    @property
    def planned(self) -> bool:
        """Whether the plan is known (dense updates are planned when made)."""
        return self.dest is not None

    def apply(self, dest, pos, acc) -> LayerCache:
        """The new layer cache: the new tokens' k, v written at `dest`, nothing else moved."""
        k = select_slots(self.cache.k, dest, self.k_new)  # [B, K, N, D]
        return LayerCache(k, select_slots(self.cache.v, dest, self.v_new), pos, acc)


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
    0 for a policy that accumulates attention (its scores need every block's probabilities)."""
    if bound.accumulates:
        return 0
    attending = [n for i, n in enumerate(per_layer) if cfg.attends(i)]
    room = min(attending) if attending else t
    return min(room // block * block, t)

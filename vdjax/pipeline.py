"""True block prompt processing and per-step decode eviction, each one jit-compiled program.

Prefill: `lax.scan` over blocks of S tokens with a fixed-shape carry (the KV cache); inside each block the
layers run in turn (unrolled): attend from the block to the layer's N cache slots + the block, score the N + S
candidates with the policy, keep the top N (new survivors overwrite the evicted slots; nothing else moves).
Decode: a `lax.while_loop` doing the same with one token per step.

Rows of a batch are aligned at their first real token (right padding inside); each row evicts on its own.
Prompt lengths are bucketed (block counts 1, 2, 3, 4, 6, 8, 12, ...) so nearby lengths share a program;
blocks holding only padding are skipped at run time.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from vdjax.cache import (KVCache, LayerCache, block_destinations, keep_mask, scatter_slots, select_slots,
                         single_destination)
from vdjax.checks import check_int
from vdjax.compilation import enable_compile_cache
from vdjax.models import transformer as tf
from vdjax.models.deltanet import LinearState
from vdjax.models.params import Params
from vdjax.policies import AttnInfo, Policy, get_policy
from vdjax.sampling import check_sampling, is_row_keys, sample, split
from vdjax.sharding import batch_sharding, check_mesh, constrain_cache, param_shardings, shard_params


def default_layer_scan() -> bool:
    """Whether prefill/decode scan over layer groups by default: not on XLA:CPU (measured, bench/README.md:
    SmolLM2's valuediff compiles 8.8 s scanned against 31.7 s unrolled on a slow host, but each scan step
    copies its layer's weight slice before the products: batch-1 decode runs ~1.9x slower), yes on GPU/TPU
    (one compiled group instead of L unrolled layers; a slice there is a cheap device copy)."""
    return jax.default_backend() != "cpu"


def bucket(n: int) -> int:
    """Smallest value of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (at most 1.5x apart) that is >= n."""
    p = 1
    while True:
        if p >= n:
            return p
        if p >= 2 and p * 3 // 2 >= n:
            return p * 3 // 2
        p *= 2


def _candidates(policy: Policy, hyper, lc: LayerCache, k_new, v_new, probs, q_pos, window, layer):
    """Score one layer's N + S candidates (the cache slots, then the block): (scores [B, K, C] fp32, their
    positions [B, K, C] (-1 invalid; dead tokens of a sliding layer dropped), accumulated attention)."""
    b, kh, s, _ = k_new.shape
    n = lc.pos.shape[-1]
    new_pos = jnp.broadcast_to(q_pos[:, None, :], (b, kh, s))  # [B, K, S]
    cand_pos = _drop_dead(jnp.concatenate([lc.pos, new_pos], axis=-1), q_pos, window)  # [B, K, C]
    acc = jnp.concatenate([lc.acc, jnp.zeros((b, kh, s), jnp.float32)], axis=-1)
    if policy.accumulates:
        valid_q = (q_pos >= 0).astype(jnp.float32)[:, None, :, None]  # [B, 1, S, 1]
        acc = acc + jnp.sum(jnp.mean(probs, axis=2) * valid_q, axis=2)
    attn = AttnInfo(probs=probs, q_pos=q_pos, acc=acc, layer=layer)
    cand_k = jnp.concatenate([lc.k, k_new], axis=2)  # [B, K, C, D]
    cand_v = jnp.concatenate([lc.v, v_new], axis=2)
    scores = policy(cand_k, cand_v, attn, cand_pos, slots=n, **dict(hyper))  # [B, K, C]
    return scores.astype(jnp.float32), cand_pos, acc


def _drop_dead(p, q_pos, window):
    """Positions [B, K, C] with the tokens no future query of a sliding layer can see set to -1 (empty)."""
    if window is None:
        return p
    last_pos = jnp.max(q_pos, axis=1)[:, None, None]  # [B, 1, 1]
    return jnp.where(last_pos + 1 - p >= window, -1, p)


def _plan(scores, cand_pos, acc, n: int):
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
    """The dense cache is indexed by position: each new token goes to slot = its position (nothing evicted)."""
    b, kh, n = lc.pos.shape
    new_pos = jnp.broadcast_to(q_pos[:, None, :], (b, kh, q_pos.shape[1]))  # [B, K, S]
    dest = jnp.where(new_pos >= 0, new_pos, n)
    return dest, _drop_dead(scatter_slots(lc.pos, dest, new_pos), q_pos, window), lc.acc


def _layer(cfg, policy: Policy, hyper, kind: int, index, lw: dict, lc, x, q_pos):
    """One layer over a block x [B, S, H]: attention and its candidates' scores, or a Gated DeltaNet step.
    `kind` (static) is a layer with this layer's settings (type, window, RoPE); `index` the layer's own index
    (a traced scalar inside the layer scan). Returns (x, the layer's new cache, or an eviction `_Pending`)."""
    if not cfg.attends(kind):  # Gated DeltaNet: its state carries the past, nothing to evict
        return tf.linear_layer_forward(lw, x, q_pos, lc, cfg)
    inv_freq, window = tf.layer_settings(cfg, kind)
    x, k_new, v_new, probs = tf.layer_forward(lw, x, q_pos, lc.k, lc.v, lc.pos, cfg, jnp.asarray(inv_freq), window)
    if policy.is_dense:
        return x, _Pending(lc, k_new, v_new, *_dense_plan(lc, q_pos, window), planned=True)
    return x, _Pending(lc, k_new, v_new, *_candidates(policy, hyper, lc, k_new, v_new, probs, q_pos, window,
                                                      index))


@dataclasses.dataclass
class _Pending:
    """A layer's cache update, waiting for its plan: (scores, cand_pos, acc) of its candidates, or the plan
    itself (dest, pos, acc) once `planned`."""

    lc: LayerCache
    k_new: Any
    v_new: Any
    a: Any
    b: Any
    c: Any
    planned: bool = False

    def apply(self, dest, pos, acc) -> LayerCache:
        return LayerCache(select_slots(self.lc.k, dest, self.k_new), select_slots(self.lc.v, dest, self.v_new),
                          pos, acc)


def _evict(x, updates: list):
    """Apply every layer's eviction of a block at once: the plans of the layers sharing a slot count are
    computed together (`_plan` on their stacked scores). Returns (x, the new per-layer caches)."""
    groups: dict[int, list[int]] = {}
    for i, u in enumerate(updates):
        if isinstance(u, _Pending) and not u.planned:
            groups.setdefault(u.lc.pos.shape[-1], []).append(i)
    plans = {}
    for n, idx in groups.items():
        stacked = [jnp.stack([getattr(updates[i], f) for i in idx]) for f in ("a", "b", "c")]
        dest, pos, acc = _plan(*stacked, n)
        plans.update({i: (dest[j], pos[j], acc[j]) for j, i in enumerate(idx)})
    for i, u in enumerate(updates):
        if isinstance(u, _Pending) and u.planned:
            plans[i] = (u.a, u.b, u.c)
    # the writes wait for every layer's output, i.e. for every read of the old slots: XLA can write in place
    x, plans = jax.lax.optimization_barrier((x, plans))
    return x, tuple(u.apply(*plans[i]) if isinstance(u, _Pending) else u for i, u in enumerate(updates))


def layer_period(cfg) -> int:
    """The smallest p dividing L such that layers i and i + p share type, window and RoPE (1 for Llama,
    6 for Gemma3's 5 sliding : 1 global, 4 for Qwen3.5): the layer scan's step is p layers."""
    sig = [(cfg.layer_types[i], cfg.window(i), cfg.rope(i)[0], tuple(sorted(cfg.rope(i)[1].items())))
           for i in range(cfg.num_layers)]
    return next(p for p in range(1, cfg.num_layers + 1)
                if cfg.num_layers % p == 0 and all(sig[i] == sig[i % p] for i in range(cfg.num_layers)))


def loop_form(cfg, layers: tuple, scan: bool) -> tuple:
    """Per-layer pytrees (weight dicts, caches) as the layer loop takes them: unchanged when unrolled; with the
    layer scan, one tree per position j of the period, its leaves stacked over the groups [L / p, ...]."""
    if not scan:
        return tuple(layers)
    p = layer_period(cfg)
    return tuple(jax.tree.map(lambda *a: jnp.stack(a), *layers[j::p]) for j in range(p))


def layer_weights(params: Params, scan: bool) -> tuple:
    """Inside a program: the layers' weight dicts in `loop_form`. Params from `scan_form` already hold them so
    (weights["layer_groups"]: read in place); plain params are stacked here, one copy of the layer weights per
    call of a scanned program."""
    if _in_scan_form(params, scan):
        return params.weights["layer_groups"]
    return loop_form(params.config, params.weights["layers"], scan)


def _in_scan_form(params: Params, scan: bool) -> bool:
    """Whether params hold their layers in `scan_form`; a clear error where the program unrolls them."""
    if "layer_groups" not in params.weights:
        return False
    if not scan:
        raise ValueError("params in scan form (weights['layer_groups'], from pipeline.scan_form) need "
                         "layer_scan=True; pass the params vdjax.load returned for unrolled layers")
    return True


def scan_form(params: Params, mesh=None) -> Params:
    """`params` (sharded on `mesh` when given) with its layers stacked in `loop_form` under
    weights["layer_groups"] instead of weights["layers"]: what the scanned programs read.

    Made once per params object and mesh and kept on that object, so a scanned program no longer stacks the
    L layers' weights in every call (SmolLM2-135M fp32: 540 MB copied, ~0.4 s a call on 2 CPU cores). The
    stacked copy lives as long as `params` does: one more copy of the layer weights at rest, the same peak
    (the programs held that copy while they ran).
    """
    if _in_scan_form(params, True):
        return params
    memo = params.__dict__.setdefault("_scan_forms", {})  # Params is frozen: the cache sits beside its fields
    if mesh in memo:
        return memo[mesh]
    base = params if mesh is None else shard_params(params, mesh)
    stack = functools.partial(loop_form, params.config, scan=True)
    if mesh is None:
        groups = jax.jit(stack)(base.weights["layers"])
    else:  # each stacked leaf: its layer's sharding behind a replicated leading axis of groups
        per_layer = param_shardings(base, mesh).weights["layers"]  # layers j, j + p, ... share their shardings
        shardings = tuple(jax.tree.map(lambda s: NamedSharding(mesh, P(None, *s.spec)), per_layer[j])
                          for j in range(layer_period(params.config)))
        groups = jax.jit(stack, out_shardings=shardings)(base.weights["layers"])
    weights = {k: v for k, v in base.weights.items() if k != "layers"} | {"layer_groups": groups}
    memo[mesh] = Params(weights, params.config, params.source)
    return memo[mesh]


@jax.jit
def _group(tree, g):
    """Group g [] of a loop-form pytree (leaves [L / p, ...]) -> its leaves [...]: one small program per tree
    shape, called once per group."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, g, keepdims=False), tree)


def unstack(cfg, cache: KVCache, scan: bool) -> KVCache:
    """Outside jit, the inverse of `loop_form`: a cache as the scanned programs pass it on -> one entry per layer.

    Inside a program the same split is one slice kernel per layer and array (120 for SmolLM2's 30 layers,
    ~1 s of XLA:CPU compile time per program); here it runs `_group` with a traced index, compiled once.
    """
    if not scan:
        return cache
    p = len(cache.layers)
    groups = [[_group(cache.layers[j], jnp.int32(g)) for j in range(p)] for g in range(cfg.num_layers // p)]
    return KVCache(tuple(lc for group in groups for lc in group))


def _run_layers(cfg, policy: Policy, hyper, lws: tuple, caches: tuple, x, q_pos, scan: bool):
    """All layers over one block x [B, S, H] at positions q_pos [B, S], evicting after each layer's attention;
    `lws`, `caches` in `loop_form`. Returns (x, new caches in loop form).

    Unrolled, every layer has its own weight and cache buffers: XLA reads weights in place and writes only the
    new rows of each cache, but compiles every layer. With `scan`, one step of `layer_period` layers is
    compiled once and scanned over the groups; XLA:CPU then copies each layer's weight slice before its
    matmuls (measured in bench/README.md).
    """
    if not scan:
        out = []
        for i, (lw, lc) in enumerate(zip(lws, caches)):
            x, update = _layer(cfg, policy, hyper, i, i, lw, lc, x, q_pos)
            out.append(update)
        return _evict(x, out)
    p = len(lws)

    def group(x, xs):
        g, ws, cs = xs
        out = []
        for j in range(p):
            x, update = _layer(cfg, policy, hyper, j, g * p + j, ws[j], cs[j], x, q_pos)
            out.append(update)
        return _evict(x, out)

    return jax.lax.scan(group, x, (jnp.arange(cfg.num_layers // p), lws, caches))


def layer_slots(cfg, slots: int, dense: bool) -> tuple[int, ...]:
    """Cache slots per layer: N, but min(N, W - 1) on a sliding layer of an evicting policy (a Gated DeltaNet
    layer has no KV cache: the entry is unused).

    After every block and step a sliding layer holds only live tokens (next_pos - pos < W), at most W - 1 of
    them, so the smaller cache keeps exactly the same tokens. Dense caches are indexed by position: N everywhere.
    """
    return tuple(slots if dense or cfg.window(i) is None else max(1, min(slots, cfg.window(i) - 1))
                 for i in range(cfg.num_layers))


def _constrain(caches: tuple, mesh, scan: bool) -> tuple:
    """Inside jit: pin the caches (in loop form) to `sharding.cache_sharding` (a no-op without a mesh)."""
    if mesh is None:
        return caches
    return constrain_cache(KVCache(caches), mesh, stacked=scan).layers


@functools.partial(jax.jit, static_argnames=("policy", "hyper", "slots", "block", "mesh", "scan"))
def _prefill(params: Params, tokens, lengths, *, policy: Policy, hyper, slots: int, block: int, mesh=None,
             scan: bool = False):
    """tokens [B, nb*S] (row r real up to lengths[r]) -> (cache with `slots` slots, last logits [B, V]).

    With a mesh the cache carry is pinned to `sharding.cache_sharding` (rows on "data", KV heads on "model").
    The cache comes back in `loop_form` (stacked over layer groups with `scan`: `unstack` splits it).
    """
    cfg = params.config
    b, t = tokens.shape
    nb = t // block
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    q_pos = jnp.where(pos < lengths[:, None], pos, -1)  # [B, T]
    if policy.is_dense:  # nothing is evicted, so block boundaries change nothing: one causal pass per layer
        return _dense_prefill(params, tokens, q_pos, lengths, slots, mesh, scan)
    per_layer = layer_slots(cfg, slots, policy.is_dense)
    fill = fill_tokens(cfg, policy, per_layer, block, t)
    if fill:  # the blocks before the first eviction: one causal pass (same tokens kept, in the same slots)
        caches, x = _dense_layers(params, tokens[:, :fill], q_pos[:, :fill], per_layer, scan)
        last = jnp.clip(lengths - 1, 0, fill - 1)[:, None, None]
        h_last = jnp.where((lengths <= fill)[:, None], jnp.take_along_axis(x, last, axis=1)[:, 0], 0)  # [B, H]
    else:
        caches = loop_form(cfg, KVCache.for_model(cfg, b, per_layer, params.dtype).layers, scan)
        h_last = jnp.zeros((b, cfg.hidden_size), params.dtype)
    nb -= fill // block
    if nb == 0:  # the whole prompt fits the cache: no block loop to compile
        return KVCache(_constrain(caches, mesh, scan)), tf.final_logits(params, h_last)
    xs = (tokens[:, fill:].reshape(b, nb, block).swapaxes(0, 1), q_pos[:, fill:].reshape(b, nb, block).swapaxes(0, 1))
    lws = layer_weights(params, scan)  # in loop form, outside the block loop
    caches = _constrain(caches, mesh, scan)

    def block_step(carry, xs):
        tok, qp = xs  # [B, S]

        def run(carry):
            caches, h_last = carry
            x, caches = _run_layers(cfg, policy, hyper, lws, caches, tf.embed(params, tok), qp, scan)
            caches = _constrain(caches, mesh, scan)
            is_last = qp == (lengths - 1)[:, None]  # [B, S]
            h = jnp.sum(jnp.where(is_last[..., None], x, 0), axis=1)
            return caches, jnp.where(jnp.any(is_last, axis=1)[:, None], h, h_last)

        return jax.lax.cond(jnp.any(qp >= 0), run, lambda c: c, carry), None

    (caches, h_last), _ = jax.lax.scan(block_step, (caches, h_last), xs)
    return KVCache(caches), tf.final_logits(params, h_last)


def fill_tokens(cfg, policy: Policy, per_layer: tuple[int, ...], block: int, t: int) -> int:
    """How many leading prompt tokens an evicting prefill may run as one causal pass: whole blocks that fit
    every attention layer's slots, where nothing is evicted yet (a set of at most N valid candidates is kept
    whole, each new token in the next free slot, i.e. slot = position) and no token of a sliding layer dies.
    0 for a policy that accumulates attention (its scores need every block's probabilities)."""
    if policy.accumulates:
        return 0
    attending = [n for i, n in enumerate(per_layer) if cfg.attends(i)]
    room = min(attending) if attending else t
    return min(room // block * block, t)


def _dense_layer(cfg, kind: int, lw: dict, x, q_pos, n: int):
    """One layer of the causal pass over x [B, T, H]: (x, its cache indexed by position with n >= T slots,
    padding tokens' rows zeroed, or a Gated DeltaNet layer's state). `kind` as in `_layer`."""
    b, t = q_pos.shape
    if not cfg.attends(kind):
        return tf.linear_layer_forward(lw, x, q_pos, LinearState.empty(cfg, b, x.dtype), cfg)
    inv_freq, window = tf.layer_settings(cfg, kind)
    x, k, v = tf.causal_layer_forward(lw, x, q_pos, cfg, jnp.asarray(inv_freq), window)  # k, v [B, K, T, D]
    pos = _drop_dead(jnp.broadcast_to(q_pos[:, None, :], k.shape[:3]), q_pos, window)
    live = (q_pos >= 0)[:, None, :, None]  # padding rows hold zeros, as the block path leaves them
    room = [(0, 0), (0, 0), (0, n - t)]
    return x, LayerCache(jnp.pad(jnp.where(live, k, 0), room + [(0, 0)]),
                         jnp.pad(jnp.where(live, v, 0), room + [(0, 0)]),
                         jnp.pad(pos, room, constant_values=-1), jnp.zeros((b, k.shape[1], n), jnp.float32))


def _dense_layers(params: Params, tokens, q_pos, slots, scan: bool = False) -> tuple[tuple, jax.Array]:
    """Every layer over tokens [B, T] at q_pos [B, T] in one causal pass: (caches in `loop_form`, indexed by
    position with `slots` (an int, or one per layer) >= T slots, padding tokens' rows zeroed; x [B, T, H]).
    With `scan` the layers run as a `lax.scan` over layer groups (one group compiled, as `_run_layers`)."""
    cfg = params.config
    per_layer = (slots,) * cfg.num_layers if isinstance(slots, int) else tuple(slots)
    x = tf.embed(params, tokens)
    if not scan:
        layers = []
        for i, lw in enumerate(layer_weights(params, False)):
            x, lc = _dense_layer(cfg, i, lw, x, q_pos, per_layer[i])
            layers.append(lc)
        return tuple(layers), x  # (unrolled, the loop form is one entry per layer)
    lws = layer_weights(params, True)
    p = len(lws)  # layers i and i + p share type, window and RoPE, hence slots

    def group(x, ws):
        out = []
        for j in range(p):
            x, lc = _dense_layer(cfg, j, ws[j], x, q_pos, per_layer[j])
            out.append(lc)
        return x, tuple(out)

    x, groups = jax.lax.scan(group, x, lws)
    return groups, x


def _dense_prefill(params: Params, tokens, q_pos, lengths, slots: int, mesh, scan: bool = False):
    """Dense prefill, layer by layer over the whole prompt: causal attention that reads only what each query
    sees (`transformer.causal_attention`), Gated DeltaNet layers in their chunked form. The cache is indexed
    by position (`slots` >= T: room for the tokens to come); sliding layers drop what no later query sees.
    The cache in `loop_form`."""
    layers, x = _dense_layers(params, tokens, q_pos, slots, scan)
    h_last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, H]
    return constrain_cache(KVCache(layers), mesh, stacked=scan), tf.final_logits(params, h_last)


@functools.partial(jax.jit, static_argnames=("policy", "hyper", "mesh", "scan"))
def _extend(params: Params, cache: KVCache, tokens, q_pos, *, policy: Policy, hyper, mesh=None, scan: bool = False):
    """Append one block tokens [B, S] at positions q_pos [B, S] (-1 = padding) -> (cache, last logits [B, V]).

    Used for the question of the question-agnostic protocol: the cache has room for every question token,
    so the policy scores them but evicts nothing. The cache in and out in `loop_form`.
    """
    cfg = params.config
    caches = _constrain(cache.layers, mesh, scan)
    x, caches = _run_layers(cfg, policy, hyper, layer_weights(params, scan), caches,
                            tf.embed(params, tokens), q_pos, scan)
    caches = _constrain(caches, mesh, scan)
    is_last = q_pos == jnp.max(q_pos, axis=1, keepdims=True)  # [B, S]
    return KVCache(caches), tf.final_logits(params, jnp.sum(jnp.where(is_last[..., None], x, 0), axis=1))


def _grow(cache: KVCache, extra: int, scan: bool = False) -> KVCache:
    """The cache (in `loop_form`) with `extra` empty slots appended to every attention layer and head."""
    lead = 3 if scan else 2  # [G,] B, K before the slot axis

    def pad(a, value):
        return jnp.pad(a, [(0, 0)] * lead + [(0, extra)] + [(0, 0)] * (a.ndim - lead - 1), constant_values=value)

    return KVCache(tuple(LayerCache(pad(lc.k, 0), pad(lc.v, 0), pad(lc.pos, -1), pad(lc.acc, 0))
                         if isinstance(lc, LayerCache) else lc for lc in cache.layers))


def prepare_question(params: Params, question: Any, batch: int) -> np.ndarray:
    """Validate question ids ([Q] for every row, or one list per row, all of one length) -> [batch, Q]."""
    rows = question if (isinstance(question, (list, tuple)) and question
                        and isinstance(question[0], (list, tuple, np.ndarray))) else [question] * batch
    if len(rows) != batch:
        raise ValueError(f"question has {len(rows)} rows, ids have {batch}; give one row per prompt or one for all")
    if len({len(r) for r in rows}) != 1 or len(rows[0]) == 0:
        raise ValueError(f"question rows must be non-empty and of one length, got {[len(r) for r in rows]}")
    arr, _ = prepare_ids(params, [list(r) for r in rows])
    return arr


QUESTION_PAD = 32  # question-agnostic protocol: the cache grows by the question length rounded up to this


@functools.partial(
    jax.jit,
    static_argnames=("policy", "hyper", "max_out", "temperature", "top_k", "top_p", "min_new", "mesh", "scan"),
    donate_argnums=(1,),
)
def _decode(params, cache, logits, lengths, key, eos, pad, max_new, *, policy, hyper, max_out, temperature, top_k,
            top_p, min_new=0, mesh=None, live=None, scan: bool = False):
    """Sample max_new (<= max_out, traced: one program per bucket) tokens into [B, max_out] from the prefill
    logits, evicting once per layer per step.

    The first `min_new` tokens cannot be EOS (their EOS logits are masked, as HF's min_new_tokens).
    `live` [B] bool (None = all): rows marked False (the mesh's padding rows) count as done from the start.
    With a mesh the cache carry is pinned to `sharding.cache_sharding`. The cache in and out in `loop_form`.
    """
    b = logits.shape[0]
    is_eos = jnp.zeros((logits.shape[-1],), bool).at[eos].set(True, mode="drop")  # [V]

    def no_eos_before_min(lg, i):
        return jnp.where(is_eos & (i < min_new), -jnp.inf, lg) if min_new else lg

    key, sub = split(key)
    first = sample(no_eos_before_min(logits, 0), sub, temperature, top_k, top_p)
    out = jnp.full((b, max_out), pad, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos)
    if live is not None:
        done = done | ~live

    def cond(state):
        i, _, _, done, _, _ = state
        return (i < max_new) & ~jnp.all(done)

    cfg = params.config
    lws = layer_weights(params, scan)  # in loop form, outside the token loop

    def body(state):
        i, caches, tok, done, out, key = state
        q_pos = (lengths + i - 1)[:, None]  # [B, 1] the fed token's position
        x, caches = _run_layers(cfg, policy, hyper, lws, caches, tf.embed(params, tok[:, None]), q_pos, scan)
        caches = _constrain(caches, mesh, scan)
        key, sub = split(key)
        nxt = sample(no_eos_before_min(tf.final_logits(params, x[:, 0]), i), sub, temperature, top_k, top_p)
        nxt = jnp.where(done, pad, nxt)
        return i + 1, caches, nxt, done | jnp.isin(nxt, eos), out.at[:, i].set(nxt), key

    caches = _constrain(cache.layers, mesh, scan)
    i, caches, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), caches, first, done, out, key))
    return out, i, KVCache(caches)


@functools.partial(jax.jit, static_argnames=("policy", "hyper", "scan"))
def _forced(params, cache, logits, lengths, cont, *, policy, hyper, scan: bool = False):
    """Teacher-forced log p(cont[:, j] | prompt, cont[:, :j]) [B, C] from the prefill's last logits [B, V]:
    each continuation token is fed as a decode step feeds its sample (one eviction per layer per token). The
    cache in `loop_form`."""
    cfg = params.config
    lws = layer_weights(params, scan)

    def logprob(lg, tok):  # lg [B, V], tok [B] -> [B]
        lp = jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(lp, tok[:, None], axis=1)[:, 0]

    def step(caches, xs):
        j, fed, nxt = xs  # fed [B] at position lengths + j; nxt [B] the token it should predict
        x, caches = _run_layers(cfg, policy, hyper, lws, caches, tf.embed(params, fed[:, None]),
                                (lengths + j)[:, None], scan)
        return caches, logprob(tf.final_logits(params, x[:, 0]), nxt)

    c = cont.shape[1]
    first = logprob(logits, cont[:, 0])
    xs = (jnp.arange(c - 1), cont[:, :-1].T, cont[:, 1:].T)  # step j feeds cont[:, j], predicts cont[:, j + 1]
    _, rest = jax.lax.scan(step, cache.layers, xs)  # rest [C - 1, B]
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def continuation_logprobs(
    params: Params,
    ids,
    continuation,
    policy: Policy | str = "valuediff",
    budget: int | None = None,
    block_size: int = 128,
    *,
    attention_mask=None,
    layer_scan: bool | None = None,
    **policy_kwargs,
) -> np.ndarray:
    """Log-probabilities [batch, C] of `continuation` (ids [C] for every row, or one row per prompt) after
    block-prefilling `ids` under eviction, teacher-forced with decode's semantics: the cache is cut to `budget`
    after each continuation token, so each row's argmax is what greedy `generate` would pick there."""
    tokens, _ = prepare_ids(params, ids, attention_mask)
    cont = prepare_question(params, continuation, tokens.shape[0])  # [B, C]
    p = plan(params, ids, policy, budget, block_size, cont.shape[1], attention_mask, layer_scan, **policy_kwargs)
    x = place(params, p.tokens, p.lengths, scan=p.scan)
    cache, logits = _prefill(x.params, x.tokens, x.lengths, policy=p.policy, hyper=p.hyper, slots=p.slots,
                             block=p.block, scan=p.scan)
    return np.asarray(_forced(x.params, cache, logits, x.lengths, jax.device_put(cont), policy=p.policy,
                              hyper=p.hyper, scan=p.scan))


# ---- input checking -------------------------------------------------------------------------------------
def prepare_ids(params: Params, ids: Any, attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Validate ids ([T], [batch, T] with optional left-padding mask, or ragged lists) -> (rows, lengths).

    Returns rows as a list-free int32 array [batch, T_max] with each row's tokens first, and lengths [batch].
    """
    vocab = params.config.vocab_size
    ragged = isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple, np.ndarray))
    if ragged and len({len(r) for r in ids}) > 1:
        if attention_mask is not None:
            raise ValueError("attention_mask needs ids of one length [batch, T]; ragged lists need no mask")
        rows = [np.asarray(r) for r in ids]
    else:
        arr = np.asarray(ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise ValueError(f"ids must be [T] or [batch, T], got shape {arr.shape}")
        if attention_mask is None:
            rows = list(arr)
        else:
            mask = np.asarray(attention_mask).astype(bool)
            if mask.shape != arr.shape:
                raise ValueError(f"attention_mask shape {mask.shape} must equal ids shape {arr.shape}")
            rows = []
            for r, (row, m) in enumerate(zip(arr, mask)):
                idx = np.flatnonzero(m)
                if idx.size and idx[-1] - idx[0] + 1 != idx.size:
                    raise ValueError(f"attention_mask row {r} has holes; only left (or right) padding is allowed")
                rows.append(row[idx])
    lengths = np.array([len(r) for r in rows], np.int32)
    if len(rows) == 0 or lengths.min() == 0:
        raise ValueError(f"ids must hold at least one token per row, got lengths {lengths.tolist()}")
    out = np.zeros((len(rows), int(lengths.max())), np.int32)
    for r, row in enumerate(rows):
        if not np.issubdtype(row.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {row.dtype}")
        bad = row[(row < 0) | (row >= vocab)]
        if bad.size:
            raise ValueError(f"ids row {r} has out-of-vocabulary id(s) {bad[:5].tolist()}; allowed 0..{vocab - 1}")
        out[r, : len(row)] = row
    return out, lengths


@dataclasses.dataclass
class Plan:
    """Static shapes of one call: padded tokens, block size S, block count, cache slots N."""

    tokens: np.ndarray
    lengths: np.ndarray
    block: int
    slots: int
    policy: Policy
    hyper: tuple
    scan: bool  # scan over layer groups (`default_layer_scan`) instead of unrolling the layers


def plan(params, ids, policy, budget, block_size, extra_tokens=0, attention_mask=None, layer_scan=None,
         **policy_kwargs) -> Plan:
    """Check the arguments and fix the shapes (bucketed) of a prefill/generate call; turns the persistent
    compile cache on (`enable_compile_cache`: VDJAX_COMPILE_CACHE=0 keeps it off)."""
    if not isinstance(params, Params):
        raise TypeError(f"params must be vdjax Params (from vdjax.load), got {type(params).__name__}")
    enable_compile_cache()
    pol = get_policy(policy)
    hyper = pol.bind_hyper(params, pol.hyper(**policy_kwargs), None if pol.is_dense else budget)
    block_size = check_int("block_size", block_size)
    tokens, lengths = prepare_ids(params, ids, attention_mask)
    t = int(lengths.max())
    if block_size >= t:
        block, nb = bucket(max(t, 16)), 1
    else:
        block, nb = block_size, bucket(-(-t // block_size))
    padded = np.zeros((tokens.shape[0], block * nb), np.int32)
    padded[:, :t] = tokens
    if pol.is_dense:
        slots = block * nb + extra_tokens
    else:
        if budget is None:
            raise ValueError(f"policy {pol.name!r} needs budget=N (cache slots per head); only 'dense' does not")
        slots = check_int("budget", budget)
    if layer_scan is None:
        layer_scan = default_layer_scan()
    elif not isinstance(layer_scan, bool):
        raise TypeError(f"layer_scan must be True, False or None (the backend's default), got {layer_scan!r}")
    return Plan(padded, lengths, block, slots, pol, hyper, layer_scan)


# ---- multi-device ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Placed:
    """Inputs of one call placed on a mesh (params sharded, rows padded to a multiple of the "data" size),
    or as they are without one."""

    params: Params
    tokens: jax.Array  # [B_pad, T] on the batch sharding
    lengths: jax.Array  # [B_pad]
    host_lengths: np.ndarray  # [B_pad] the same, on the host
    rows: int  # B, the real rows (the first B of B_pad)
    live: jax.Array | None  # [B_pad] bool, False on padding rows; None when nothing was padded
    mesh: Any = None

    @property
    def jit_kw(self) -> dict:
        """The jitted steps' sharding keywords: none without a mesh (an explicit mesh=None would be another
        cache entry of the same program: bench.py warms `_prefill` without it)."""
        return {} if self.mesh is None else {"mesh": self.mesh}

    def pad_rows(self, a: np.ndarray) -> np.ndarray:
        """Per-row numpy data [B, ...] padded to [B_pad, ...] with copies of row 0."""
        extra = self.tokens.shape[0] - a.shape[0]
        return a if not extra else np.concatenate([a, np.repeat(a[:1], extra, axis=0)])

    def real(self, tree):
        """The real rows [B, ...] of every array of a per-row pytree (a cache, logits, tokens)."""
        if self.live is None:
            return tree
        return jax.tree.map(lambda x: x[: self.rows], tree)


def place(params: Params, tokens: np.ndarray, lengths: np.ndarray, mesh=None, scan: bool = False) -> Placed:
    """Shard params on `mesh`, pad the batch to a multiple of its "data" size and split tokens and lengths
    over "data". Dummy rows hold row 0's first token, length 1 (rows evict independently: they change nothing).
    Without a mesh: the inputs as device arrays, nothing padded. With `scan` the params in `scan_form`.
    """
    if scan:
        params = scan_form(params, mesh)  # kept on params: stacked (and sharded) once, not in every program call
    else:
        _in_scan_form(params, False)  # unrolled programs refuse scan-form params before anything is sharded
    if mesh is None:
        # device_put, not jnp.asarray: the latter compiles a small staging program per new shape
        return Placed(params, jax.device_put(tokens), jax.device_put(lengths), lengths, tokens.shape[0], None)
    check_mesh(mesh)
    b = tokens.shape[0]
    extra = -b % mesh.shape["data"]
    if extra:
        tokens = np.concatenate([tokens, np.zeros((extra, tokens.shape[1]), tokens.dtype)])
        tokens[b:, 0] = tokens[0, 0]
        lengths = np.concatenate([lengths, np.ones(extra, lengths.dtype)])
    rows = batch_sharding(mesh)
    live = jax.device_put(np.arange(b + extra) < b, rows) if extra else None
    params = params if scan else shard_params(params, mesh)  # scan_form sharded them already
    return Placed(params, jax.device_put(tokens, rows), jax.device_put(lengths, rows), lengths, b, live, mesh)


# ---- public API -----------------------------------------------------------------------------------------
def prefill(
    params: Params,
    ids,
    policy: Policy | str = "valuediff",
    budget: int | None = None,
    block_size: int = 128,
    *,
    attention_mask=None,
    mesh=None,
    layer_scan: bool | None = None,
    **policy_kwargs,
) -> tuple[KVCache, jax.Array]:
    """Block-prefill a prompt under eviction; returns (cache, last-token logits [batch, V]).

    `mesh` (a jax Mesh with axes "data" and "model", see `vdjax.sharding`) splits the batch over "data" and
    attention heads / MLP width over "model"; the cache comes back sharded the same way.
    """
    p = plan(params, ids, policy, budget, block_size, 0, attention_mask, layer_scan, **policy_kwargs)
    x = place(params, p.tokens, p.lengths, mesh, p.scan)
    cache, logits = _prefill(x.params, x.tokens, x.lengths, policy=p.policy, hyper=p.hyper, slots=p.slots,
                             block=p.block, scan=p.scan, **x.jit_kw)
    return x.real((unstack(params.config, cache, p.scan), logits))


@dataclasses.dataclass
class PrefillProgram:
    """The compiled prefill of one call's (bucketed) shapes, with the call's placed inputs.

    `program()` runs it -> (cache, last logits) (rows of a mesh's padding included); `compiled` is the
    `jax.stages.Compiled` (`.cost_analysis()`, `.memory_analysis()`); `plan` holds the shapes.
    """

    compiled: Any
    inputs: tuple
    plan: Plan

    def __call__(self):
        cache, logits = self.compiled(*self.inputs)
        return unstack(self.inputs[0].config, cache, self.plan.scan), logits  # inputs[0]: the params


def compile_prefill(
    params: Params,
    ids,
    policy: Policy | str = "valuediff",
    budget: int | None = None,
    block_size: int = 128,
    *,
    attention_mask=None,
    mesh=None,
    layer_scan: bool | None = None,
    **policy_kwargs,
) -> PrefillProgram:
    """Compile the prefill program of this call without running it (arguments as `prefill`).

    Warms the jit cache: a later `prefill` / `generate` / `run` of the same length bucket compiles no prefill
    program (count with `vdjax.compilation.count_compiles`).
    """
    p = plan(params, ids, policy, budget, block_size, 0, attention_mask, layer_scan, **policy_kwargs)
    x = place(params, p.tokens, p.lengths, mesh, p.scan)
    statics = dict(policy=p.policy, hyper=p.hyper, slots=p.slots, block=p.block, scan=p.scan, **x.jit_kw)
    compiled = _prefill.lower(x.params, x.tokens, x.lengths, **statics).compile()
    return PrefillProgram(compiled, (x.params, x.tokens, x.lengths), p)


@dataclasses.dataclass
class Generation:
    """Result of `run`: tokens [batch, new] and what it cost."""

    tokens: np.ndarray
    cache: KVCache
    prefill_s: float  # time to first token (prefill + first sample), compile included on first call
    decode_s: float
    steps: int  # decode steps run (new tokens - 1)
    policy: str
    hyper: tuple
    budget: int


def _stop_tokens(cfg, eos_token_id) -> tuple[jax.Array, jax.Array]:
    """(EOS ids [E] int32: `eos_token_id`, else the model's; the pad id finished rows get)."""
    eos = cfg.eos_token_ids if eos_token_id is None else eos_token_id
    eos = np.atleast_1d(np.asarray(eos if eos is not None else [], np.int32)).reshape(-1)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (int(eos[0]) if eos.size else 0)
    return jax.device_put(eos), jax.device_put(np.int32(pad))


def _keys(key, x: Placed):
    """The sampling key(s): key(0) by default; one per row checked against the rows (and copied onto the
    mesh's padding rows)."""
    key = jax.random.key(0) if key is None else key
    if not is_row_keys(key):
        return key
    if key.shape[0] != x.rows:
        raise ValueError(f"key holds {key.shape[0]} row keys for {x.rows} rows; give one key, or one per row "
                         "(jax.random.split(key, rows))")
    extra = x.tokens.shape[0] - x.rows
    return key if not extra else jnp.concatenate([key, jnp.repeat(key[:1], extra, axis=0)])


def _append_question(x: Placed, p: Plan, cache: KVCache, q_ids: np.ndarray, extra_q: int):
    """Question-agnostic protocol: append the question ids [B, Q] whole after the context was cut to budget
    (the cache grows by `extra_q` >= Q slots, nothing is evicted). Returns (cache, last logits, slots)."""
    q_ids = x.pad_rows(q_ids)
    q_len = q_ids.shape[1]
    q_tokens = np.zeros((q_ids.shape[0], extra_q), np.int32)
    q_tokens[:, :q_len] = q_ids
    steps_q = np.arange(extra_q)[None]
    q_pos = np.where(steps_q < q_len, x.host_lengths[:, None] + steps_q, -1)
    slots = p.slots
    if not p.policy.is_dense:
        cache, slots = _grow(cache, extra_q, p.scan), slots + extra_q
    cache, logits = _extend(x.params, cache, jax.device_put(q_tokens), jax.device_put(q_pos.astype(np.int32)),
                            policy=p.policy, hyper=p.hyper, scan=p.scan, **x.jit_kw)
    return cache, logits, slots


_BEHIND: set = set()  # signatures compile_behind has compiled (a later call finds them in the jit cache)


def compile_behind(fn, args: tuple, kwargs: dict) -> threading.Thread:
    """Trace, lower and compile the jitted `fn` for these arguments in a thread (returned, started), so that a
    program compiles while the device still runs the one before it; a later `fn(*args, **kwargs)` then finds it
    compiled. The arrays may still be computing: only their shapes, types and shardings are read. A signature
    seen before starts an empty thread (its program is compiled already)."""
    def aval(a):  # an array's shape, type and placement; a static argument as it is (hashable, as jit needs)
        return (a.shape, a.dtype, getattr(a, "sharding", None)) if isinstance(a, (jax.Array, np.ndarray)) else a

    leaves, tree = jax.tree.flatten(args)
    sig = (fn, tree, tuple(map(aval, leaves)), tuple(sorted((k, aval(v)) for k, v in kwargs.items())))

    def work():
        try:
            fn.lower(*args, **kwargs).compile()
            _BEHIND.add(sig)
        except Exception:  # noqa: BLE001 -- the call itself compiles again and raises the same error there
            pass

    thread = threading.Thread(target=None if sig in _BEHIND else work, name=f"compile-{fn.__name__}", daemon=True)
    thread.start()
    return thread


def run(
    params: Params,
    ids,
    policy: Policy | str = "valuediff",
    budget: int | None = None,
    block_size: int = 128,
    max_new_tokens: int = 64,
    *,
    attention_mask=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    key: jax.Array | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    min_new_tokens: int = 0,
    question=None,
    mesh=None,
    layer_scan: bool | None = None,
    **policy_kwargs,
) -> Generation:
    """`generate` plus timings and the final cache.

    `question` (ids, [Q] or one row per prompt, all of one length) selects the question-agnostic protocol:
    `ids` (the context) is block-prefilled and cut to `budget`, then the question is appended whole (the cache
    grows by Q rounded up to QUESTION_PAD slots, nothing evicted) and decoding evicts within that larger cache.

    `mesh` (a jax Mesh with axes "data" and "model", see `vdjax.sharding`): rows split over "data" (padded
    to a multiple of its size with dummy rows, dropped again), heads / MLP width over "model". `layer_scan`:
    scan over layer groups (fewer programs to compile) instead of unrolling the layers; None picks
    `default_layer_scan()` (off on XLA:CPU, where it is slower, on for GPU/TPU).
    """
    max_new = check_int("max_new_tokens", max_new_tokens)
    min_new = check_int("min_new_tokens", min_new_tokens, 0)
    if min_new > max_new:
        raise ValueError(f"min_new_tokens={min_new} must be <= max_new_tokens={max_new}")
    check_sampling(temperature, top_k, top_p, key)
    q_ids = None
    if question is not None:
        q_ids = prepare_question(params, question, prepare_ids(params, ids, attention_mask)[0].shape[0])
    extra_q = 0 if q_ids is None else -(-q_ids.shape[1] // QUESTION_PAD) * QUESTION_PAD
    max_out = bucket(max_new)  # nearby max_new_tokens share one decode program (and dense cache size)
    p = plan(params, ids, policy, budget, block_size, max_out + extra_q, attention_mask, layer_scan,
             **policy_kwargs)
    eos, pad = _stop_tokens(params.config, eos_token_id)
    x = place(params, p.tokens, p.lengths, mesh, p.scan)
    key = _keys(key, x)
    params, lengths = x.params, x.lengths
    t0 = time.perf_counter()
    cache, logits = _prefill(params, x.tokens, lengths, policy=p.policy, hyper=p.hyper, slots=p.slots,
                             block=p.block, scan=p.scan, **x.jit_kw)
    slots = p.slots
    if q_ids is not None:
        cache, logits, slots = _append_question(x, p, cache, q_ids, extra_q)
        lengths = lengths + q_ids.shape[1]
    padded = {} if x.live is None else {"live": x.live}
    args = (params, cache, logits, lengths, key, eos, pad, jax.device_put(np.int32(max_new)))
    kw = dict(policy=p.policy, hyper=p.hyper, max_out=max_out, temperature=float(temperature), top_k=int(top_k),
              top_p=float(top_p), min_new=min_new, scan=p.scan, **x.jit_kw, **padded)
    behind = compile_behind(_decode, args, kw)  # while the prefill runs
    logits.block_until_ready()
    t1 = time.perf_counter()
    behind.join()
    out, steps, cache = _decode(*args, **kw)
    out = np.asarray(out)
    t2 = time.perf_counter()
    steps = int(steps)
    out, cache = x.real((out, unstack(params.config, cache, p.scan)))
    return Generation(out[:, :steps], cache, t1 - t0, t2 - t1, steps - 1, p.policy.name, p.hyper, slots)


def generate(
    params: Params,
    ids,
    policy: Policy | str = "valuediff",
    budget: int | None = None,
    block_size: int = 128,
    max_new_tokens: int = 64,
    **kwargs,
) -> np.ndarray:
    """Generate up to `max_new_tokens` tokens [batch, new] with block prefill + per-step eviction to `budget`.

    Keywords: attention_mask (left padding), temperature/top_k/top_p with an explicit `key` (one key, or one
    per row: `jax.random.split(key, batch)`), eos_token_id,
    min_new_tokens (EOS masked before), question (question-agnostic protocol, see `run`), mesh (several
    devices, see `vdjax.sharding`), layer_scan (see `run`) and the policy's hyper-parameters (e.g. n_sink=4 for streaming).
    """
    return run(params, ids, policy, budget, block_size, max_new_tokens, **kwargs).tokens

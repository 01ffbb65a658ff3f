"""The jit-compiled programs: block prefill (a `lax.scan` over blocks with a fixed-shape cache carry), the
dense causal prefill, appending a block without eviction, decode (a `lax.while_loop`, one eviction per layer
per token) and teacher forcing. Caches enter and leave them in `forms.loop_form`.

Rows of a batch are aligned at their first real token (right padding inside); each row evicts on its own.
Blocks holding only padding are skipped at run time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from vdjax.engine import quant as kvq
from vdjax.engine.cache import KVCache, LayerCache
from vdjax.engine.evict import cache_rule, drop_dead, evict, fill_tokens
from vdjax.engine.forms import layer_period, layer_weights, loop_form
from vdjax.engine.policies import BoundPolicy
from vdjax.engine.replay import PREV_POSTFIX, main, stream
from vdjax.engine.sampling import sample, split
from vdjax.engine.scores import replay_attention, rope_table, rotate
from vdjax.engine.sharding import constrain_cache
from vdjax.models import transformer as tf
from vdjax.models.deltanet import LinearState
from vdjax.models.params import Params


def _layer(cfg, bound: BoundPolicy, kind: int, index, lw: dict, lc, x, q_pos, tables=None):
    """One layer over a block x [B, S, H]: attention and its candidates' scores, or a Gated DeltaNet step.
    `kind` (static) is a layer with this layer's settings (type, window, RoPE); `index` the layer's own index
    (a traced scalar inside the layer scan); `tables`: `rope_tables` (None: none). x may be (x, x_replay,
    replay positions): KVzip's replay stream (`replay`) runs through the layer beside the block. Returns (x,
    the layer's new cache, or an eviction `evict.Pending`)."""
    replaying = isinstance(x, tuple)
    if replaying:
        x, xr, r_pos = x
    if not cfg.attends(kind):  # Gated DeltaNet: its state carries the past, nothing to evict
        x, state = tf.linear_layer_forward(lw, x, q_pos, lc, cfg)
        if replaying:  # the replay reads the state after the block and leaves it unchanged
            xr, _ = tf.linear_layer_forward(lw, xr, r_pos, state, cfg)
            return (x, xr, r_pos), state
        return x, state
    inv_freq, window = tf.layer_settings(cfg, kind)
    store, lc = lc, lc.dense()  # a quantized cache read dequantized: attention and scores see the same values
    view = lc.view()  # a head-adaptive pool as [B, K, P, ...], each head seeing its own slots
    inv_freq = jnp.asarray(inv_freq)
    rule = cache_rule(bound)
    if rule.evicts and bound.policy.reads_queries:  # the score reads the block's pre-RoPE queries
        x, k_new, v_new, probs, q_pre = tf.layer_forward(lw, x, q_pos, view.k, view.v, view.pos, cfg,
                                                         inv_freq, window, with_queries=True)
    else:
        x, k_new, v_new, probs = tf.layer_forward(lw, x, q_pos, view.k, view.v, view.pos, cfg, inv_freq,
                                                  window)
        q_pre = None
    rope = (q_pre, inv_freq, cfg.rope_attention_factor, None if tables is None else tables[kind])
    feature = None
    if replaying:
        xr, feature = _replay_layer(cfg, bound, lw, view, k_new, v_new, q_pos, xr, r_pos, inv_freq, window)
        x = (x, xr, r_pos)
    update = rule.update(bound, lc, k_new, v_new, probs, q_pos, window, index, lw, rope, feature=feature)
    return x, (dataclasses.replace(update, store=store) if store.quantized else update)


def _replay_layer(cfg, bound: BoundPolicy, lw: dict, view, k_new, v_new, q_pos, xr, r_pos, inv_freq, window):
    """KVzip's replay xr [B, R, H] through one attention layer over the candidates (the cache view, then the
    block k_new, v_new [B, K, S, D]) and itself: (its output, the block tokens' scores [B, K, S])."""
    cand_k = jnp.concatenate([view.k, k_new], axis=2)  # [B, K, C, D]
    cand_v = jnp.concatenate([view.v, v_new], axis=2)
    cand_pos = jnp.concatenate([view.pos, jnp.broadcast_to(q_pos[:, None], k_new.shape[:3])], axis=-1)
    out, k_r, v_r, _, qr_pre = tf.layer_forward(lw, xr, r_pos, cand_k, cand_v, cand_pos, cfg, inv_freq,
                                                window, with_queries=True)
    hyper = dict(bound.hyper)
    q_r = rotate(qr_pre, r_pos, inv_freq, cfg.rope_attention_factor)
    h_norm = wov = None
    if hyper.get("kvzip_plus_normalization"):  # KVzip+: / ||h|| per query, x ||W_o v|| per key
        h = tf.rms_norm(xr, lw["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        h_norm = jnp.sqrt(jnp.sum(jnp.square(h.astype(jnp.float32)), axis=-1))  # [B, R]
        kh = k_new.shape[1]
        wo = lw["wo"].reshape(kh, -1, *lw["wo"].shape[1:]).astype(jnp.float32)  # [K, G, D, H]
        vals = jnp.concatenate([cand_v, v_r], axis=2).astype(jnp.float32)  # [B, K, C + R, D]
        wov = jnp.sqrt(jnp.sum(jnp.square(jnp.einsum("bkcd,kgdh->bkgch", vals, wo)), axis=-1))
    feat = replay_attention(q_r, r_pos, k_r, cand_k, cand_pos, q_pos, n_sink=hyper["n_sink"], window=window,
                            h_norm=h_norm, wov=wov)
    return out, feat


def rope_tables(cfg, positions: int, scan: bool) -> dict | None:
    """`scores.rope_table` of positions 0 .. positions - 1 for each layer kind `_run_layers` passes to
    `_layer` (one table per distinct RoPE setting, shared), for a policy with `rope_table`; None when
    positions is 0 (then `unrotate` computes cos and sin itself)."""
    if not positions:
        return None
    kinds = range(layer_period(cfg) if scan else cfg.num_layers)
    tables, made = {}, {}
    for kind in kinds:
        if cfg.attends(kind):
            inv_freq = tf.layer_settings(cfg, kind)[0]
            key = inv_freq.tobytes()
            if key not in made:
                made[key] = rope_table(jnp.asarray(inv_freq), positions)
            tables[kind] = made[key]
    return tables


def _run_layers(cfg, bound: BoundPolicy, lws: tuple, caches: tuple, x, q_pos, scan: bool, tables=None):
    """All layers over one block x [B, S, H] at positions q_pos [B, S], evicting after each layer's attention;
    `lws`, `caches` in `loop_form`; `tables`: `rope_tables` (a prefill's). Returns (x, new caches in loop
    form).

    Unrolled, every layer has its own weight and cache buffers: XLA reads weights in place and writes only the
    new rows of each cache, but compiles every layer. With `scan`, one step of `layer_period` layers is
    compiled once and scanned over the groups; XLA:CPU then copies each layer's weight slice before its
    matmuls (the cost per host: bench/README.md).
    """
    if not scan:
        out = []
        for i, (lw, lc) in enumerate(zip(lws, caches, strict=True)):
            x, update = _layer(cfg, bound, i, i, lw, lc, x, q_pos, tables)
            out.append(update)
        return evict(x, out)
    p = len(lws)

    def group(x, xs):
        g, ws, cs = xs
        out = []
        for j in range(p):
            x, update = _layer(cfg, bound, j, g * p + j, ws[j], cs[j], x, q_pos, tables)
            out.append(update)
        return evict(x, out)

    return jax.lax.scan(group, x, (jnp.arange(cfg.num_layers // p), lws, caches))


def _constrain(caches: tuple, mesh, scan: bool) -> tuple:
    """Inside jit: pin the caches (in loop form) to `sharding.cache_sharding` (a no-op without a mesh)."""
    if mesh is None:
        return caches
    return constrain_cache(KVCache(caches), mesh, stacked=scan).layers


@functools.partial(jax.jit, static_argnames=("bound", "slots", "block", "mesh", "scan"))
def prefill_program(params: Params, tokens, lengths, *, bound: BoundPolicy, slots: int, block: int,
                    mesh=None, scan: bool = False):
    """tokens [B, nb*S] (row r real up to lengths[r]) -> (cache with `slots` slots, last logits [B, V]).

    With a mesh the cache carry is pinned to `sharding.cache_sharding` (rows on "data", KV heads on "model").
    The cache comes back in `loop_form` (stacked over layer groups with
    `scan`: `unstack` splits it). """
    cfg = params.config
    b, t = tokens.shape
    nb = t // block
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    q_pos = jnp.where(pos < lengths[:, None], pos, -1)  # [B, T]
    rule = cache_rule(bound)
    # nothing is evicted, block boundaries change nothing: one causal pass a layer. A quantized cache keeps
    # the blocks: each attends to the cache as stored (quantized) after the blocks before it.
    if rule.causal_prefill and bound.quant is None:
        return _dense_prefill(params, tokens, q_pos, lengths, slots, mesh, scan)
    per_head = rule.head_budgets(cfg, slots)
    fill = 0 if bound.quant is not None else fill_tokens(cfg, bound, per_head, block, t)
    tables = rope_tables(cfg, t, scan) if bound.policy.rope_table else None  # outside the block loop
    if fill:  # the blocks before the first eviction: one causal pass (same tokens kept, in the same slots)
        features = None if bound.policy.token_feature is None else (bound, block, tables)
        caches, x = _dense_layers(params, tokens[:, :fill], q_pos[:, :fill], per_head, scan, features)
        if rule.pooled:
            caches = tuple(to_pool(c) for c in caches)
        last = jnp.clip(lengths - 1, 0, fill - 1)[:, None, None]
        h_fill = jnp.take_along_axis(x, last, axis=1)[:, 0]  # [B, H]
        h_last = jnp.where((lengths <= fill)[:, None], h_fill, 0)  # [B, H]
    else:
        caches = KVCache.for_model(cfg, b, per_head, params.dtype, rule.pooled, bound.policy.query_stats,
                                   bound.policy.token_feature is not None, bound.quant)
        caches = loop_form(cfg, caches.layers, scan)
        h_last = jnp.zeros((b, cfg.hidden_size), params.dtype)
    nb -= fill // block
    if nb == 0:  # the whole prompt fits the cache: no block loop to compile
        return KVCache(_constrain(caches, mesh, scan)), tf.final_logits(params, h_last)
    def by_block(a):  # [B, T] -> [nb, B, S]
        return a[:, fill:].reshape(b, nb, block).swapaxes(0, 1)

    xs = (by_block(tokens), by_block(q_pos))
    if bound.policy.replay:  # KVzip: each block's first position and the PREV_POSTFIX tokens before it
        starts = fill + block * jnp.arange(nb)
        before = jnp.pad(tokens, ((0, 0), (PREV_POSTFIX, 0)))
        prev = jax.vmap(lambda s0: jax.lax.dynamic_slice_in_dim(before, s0, PREV_POSTFIX, axis=1))(starts)
        xs = xs + (prev, starts == 0)  # [nb, B, 8], [nb]
    lws = layer_weights(params, scan)  # in loop form, outside the block loop
    caches = _constrain(caches, mesh, scan)

    def block_step(carry, xs):
        tok, qp, *replayed = xs  # [B, S] each (and KVzip's [B, 8] tokens before the block, first-block flag)

        def run(carry):
            caches, h_last = carry
            x = stream(params, bound, tok, qp, *replayed)
            x, caches = _run_layers(cfg, bound, lws, caches, x, qp, scan, tables)
            x = main(x)
            caches = _constrain(caches, mesh, scan)
            is_last = qp == (lengths - 1)[:, None]  # [B, S]
            h = jnp.sum(jnp.where(is_last[..., None], x, 0), axis=1)
            return caches, jnp.where(jnp.any(is_last, axis=1)[:, None], h, h_last)

        return jax.lax.cond(jnp.any(qp >= 0), run, lambda c: c, carry), None

    (caches, h_last), _ = jax.lax.scan(block_step, (caches, h_last), xs)
    return KVCache(caches), tf.final_logits(params, h_last)


def to_pool(lc):
    """A per-head cache (k, v [..., K, N, D], pos, acc [..., K, N]; leading layer-group axes allowed) as a
    head-adaptive pool of K * N slots holding the same tokens (head h's in slots h*N .. h*N + N - 1); a Gated
    DeltaNet state as it is."""
    if not isinstance(lc, LayerCache):
        return lc
    *lead, kh, n = lc.pos.shape

    def merge(a):  # [..., K, N, *E] -> [..., 1, K * N, *E]
        nd = len(lead)
        return a.reshape(*a.shape[:nd], 1, kh * n, *a.shape[nd + 2:])

    owner = jnp.broadcast_to(jnp.repeat(jnp.arange(kh, dtype=jnp.int32), n), (*lead, 1, kh * n))
    pos = merge(lc.pos)
    return LayerCache(merge(lc.k), merge(lc.v), pos, merge(lc.acc), jnp.where(pos >= 0, owner, -1), kh,
                      lc.stats, None if lc.feat is None else merge(lc.feat))


def _fill_feature(cfg, bound: BoundPolicy, lw: dict, k, v, q_pre, q_pos, inv_freq, table, block: int):
    """The policy's per-token feature [B, K, T] of a fill's tokens (k, v [B, K, T, D], pre-RoPE queries
    q_pre [B, T, Nq, D], T a multiple of `block`), block by block as the block loop computes it."""
    b, kh, t, _ = k.shape
    nb = t // block

    def blocks(a, axis):  # [..., T, ...] -> [nb, ..., block, ...]
        return jnp.moveaxis(a.reshape(*a.shape[:axis], nb, block, *a.shape[axis + 1:]), axis, 0)

    def one(kb, vb, qb, pb):  # one block: [B, K, S, D] twice, [B, S, Nq, D], [B, S] -> [B, K, S]
        return bound.policy.token_feature(vb, lw, k=kb, q_pos=pb, hyper=dict(bound.hyper),
                                          rope=(qb, inv_freq, cfg.rope_attention_factor, table))

    feat = jax.vmap(one)(blocks(k, 2), blocks(v, 2), blocks(q_pre, 1), blocks(q_pos, 1))  # [nb, B, K, S]
    return jnp.moveaxis(feat, 0, 2).reshape(b, kh, t).astype(jnp.float32)


def _dense_layer(cfg, kind: int, lw: dict, x, q_pos, n: int, fill=None):
    """One layer of the causal pass over x [B, T, H]: (x, its cache indexed by position with n >= T slots,
    padding tokens' rows zeroed, or a Gated DeltaNet layer's state). `kind` as in `_layer`. `fill`: (bound
    policy, block size, `rope_tables` or None) for a policy with a `token_feature`, computed block by block
    into the cache's `feat` (`_fill_feature`); None: no feature."""
    b, t = q_pos.shape
    if not cfg.attends(kind):
        return tf.linear_layer_forward(lw, x, q_pos, LinearState.empty(cfg, b, x.dtype), cfg)
    inv_freq, window = tf.layer_settings(cfg, kind)
    inv_freq = jnp.asarray(inv_freq)
    x, k, v, *q_pre = tf.causal_layer_forward(lw, x, q_pos, cfg, inv_freq, window,
                                              with_queries=fill is not None)  # k, v [B, K, T, D]
    pos = drop_dead(jnp.broadcast_to(q_pos[:, None, :], k.shape[:3]), q_pos, window)
    live = (q_pos >= 0)[:, None, :, None]  # padding rows hold zeros, as the block path leaves them
    room = [(0, 0), (0, 0), (0, n - t)]
    feat = None
    if fill is not None:
        bound, block, tables = fill
        feat = _fill_feature(cfg, bound, lw, k, v, q_pre[0], q_pos, inv_freq,
                             None if tables is None else tables[kind], block)
        feat = jnp.pad(jnp.where(live[..., 0], feat, 0), room)
    return x, LayerCache(jnp.pad(jnp.where(live, k, 0), room + [(0, 0)]),
                         jnp.pad(jnp.where(live, v, 0), room + [(0, 0)]),
                         jnp.pad(pos, room, constant_values=-1), jnp.zeros((b, k.shape[1], n), jnp.float32),
                         feat=feat)


def _dense_layers(params: Params, tokens, q_pos, slots, scan: bool = False, fill=None
                  ) -> tuple[tuple, jax.Array]:
    """Every layer over tokens [B, T] at q_pos [B, T] in one causal pass: (caches in `loop_form`, indexed by
    position with `slots` (an int, or one per layer) >= T slots, padding tokens' rows zeroed; x [B, T, H]).
    With `scan` the layers run as a `lax.scan` over layer groups (one group compiled, as `_run_layers`).
    `fill` as `_dense_layer`'s."""
    cfg = params.config
    per_layer = (slots,) * cfg.num_layers if isinstance(slots, int) else tuple(slots)
    x = tf.embed(params, tokens)
    if not scan:
        layers = []
        for i, lw in enumerate(layer_weights(params, False)):
            x, lc = _dense_layer(cfg, i, lw, x, q_pos, per_layer[i], fill)
            layers.append(lc)
        return tuple(layers), x  # (unrolled, the loop form is one entry per layer)
    lws = layer_weights(params, True)
    p = len(lws)  # layers i and i + p share type, window and RoPE, hence slots

    def group(x, ws):
        out = []
        for j in range(p):
            x, lc = _dense_layer(cfg, j, ws[j], x, q_pos, per_layer[j], fill)
            out.append(lc)
        return x, tuple(out)

    x, groups = jax.lax.scan(group, x, lws)
    return groups, x


def _dense_prefill(params: Params, tokens, q_pos, lengths, slots: int, mesh, scan: bool = False):
    """Dense prefill, layer by layer over the whole prompt: causal attention that reads only what each query
    sees (`transformer.causal_attention`), Gated DeltaNet layers in their chunked form. The cache is indexed
    by position (`slots` >= T: room for the tokens to come); sliding layers drop what no later query
    sees. The cache in `loop_form`."""
    layers, x = _dense_layers(params, tokens, q_pos, slots, scan)
    h_last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, H]
    return constrain_cache(KVCache(layers), mesh, stacked=scan), tf.final_logits(params, h_last)


@functools.partial(jax.jit, static_argnames=("bound", "mesh", "scan", "positions"))
def extend_program(params: Params, cache: KVCache, tokens, q_pos, *, bound: BoundPolicy, mesh=None,
                   scan: bool = False, positions: int = 0):
    """Append one block tokens [B, S] at positions q_pos [B, S] (-1 = padding) -> (cache, last logits [B, V]).

    Used for the question of the question-agnostic protocol: the cache has room for every question token,
    so the policy scores them but evicts nothing. `positions`: a bound on every position (`rope_tables`;
    0: none). The cache in and out in `loop_form`.
    """
    cfg = params.config
    caches = _constrain(cache.layers, mesh, scan)
    x = stream(params, bound, tokens, q_pos)
    x, caches = _run_layers(cfg, bound, layer_weights(params, scan), caches, x, q_pos, scan,
                            rope_tables(cfg, positions, scan))
    x = main(x)
    caches = _constrain(caches, mesh, scan)
    is_last = q_pos == jnp.max(q_pos, axis=1, keepdims=True)  # [B, S]
    return KVCache(caches), tf.final_logits(params, jnp.sum(jnp.where(is_last[..., None], x, 0), axis=1))


def grow(cache: KVCache, extra: int, scan: bool = False) -> KVCache:
    """The cache (in `loop_form`) with `extra` empty slots appended to every attention layer and head."""
    lead = 3 if scan else 2  # [G,] B, K before the slot axis

    def pad(a, value, more=extra):  # a quantized k / v: its codes, scales and zeros alike
        if isinstance(a, kvq.QuantTensor):
            return kvq.pad_slots(a, lead, more)

        def one(x):
            return jnp.pad(x, [(0, 0)] * lead + [(0, more)] + [(0, 0)] * (x.ndim - lead - 1),
                           constant_values=value)

        return jax.tree.map(one, a)

    def grown(lc):  # a pool grows by K * extra: every head's question tokens fit
        if lc.pooled:
            more = extra * lc.kv_heads
            return LayerCache(*(pad(a, f, more)
                                for a, f in ((lc.k, 0), (lc.v, 0), (lc.pos, -1), (lc.acc, 0), (lc.head, -1))),
                              lc.kv_heads, lc.stats,
                              None if lc.feat is None else jnp.pad(
                                  lc.feat, [(0, 0)] * lead + [(0, more)], constant_values=0))
        return LayerCache(pad(lc.k, 0), pad(lc.v, 0), pad(lc.pos, -1), pad(lc.acc, 0), stats=lc.stats,
                          feat=None if lc.feat is None else pad(lc.feat, 0))

    return KVCache(tuple(grown(lc) if isinstance(lc, LayerCache) else lc for lc in cache.layers))


@functools.partial(
    jax.jit,
    static_argnames=("bound", "max_out", "temperature", "top_k", "top_p", "min_new", "mesh", "scan",
                     "positions"),
    donate_argnums=(1,),
)
def decode_program(params, cache, logits, lengths, key, eos, pad, max_new, *, bound: BoundPolicy, max_out,
                   temperature, top_k, top_p, min_new=0, mesh=None, live=None, scan: bool = False,
                   positions: int = 0):
    """Sample max_new (<= max_out, traced: one program per bucket) tokens into [B, max_out] from the prefill
    logits, evicting once per layer per step.
    `positions`: a bound on every position (`rope_tables`, built once outside the token loop; 0: none).

    The first `min_new` tokens cannot be EOS (their EOS logits are masked, as HF's min_new_tokens).
    `live` [B] bool (None = all): rows marked False (the mesh's padding rows) count as done from the start.
    With a mesh the cache carry is pinned to `sharding.cache_sharding`. The cache
    in and out in `loop_form`. """
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
    tables = rope_tables(cfg, positions, scan)

    def body(state):
        i, caches, tok, done, out, key = state
        q_pos = (lengths + i - 1)[:, None]  # [B, 1] the fed token's position
        x, caches = _run_layers(cfg, bound, lws, caches, stream(params, bound, tok[:, None], q_pos), q_pos,
                                scan, tables)
        x = main(x)
        caches = _constrain(caches, mesh, scan)
        key, sub = split(key)
        nxt = sample(no_eos_before_min(tf.final_logits(params, x[:, 0]), i), sub, temperature, top_k, top_p)
        nxt = jnp.where(done, pad, nxt)
        return i + 1, caches, nxt, done | jnp.isin(nxt, eos), out.at[:, i].set(nxt), key

    caches = _constrain(cache.layers, mesh, scan)
    i, caches, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), caches, first, done, out, key))
    return out, i, KVCache(caches)


@functools.partial(jax.jit, static_argnames=("bound", "scan", "positions"))
def forced_program(params, cache, logits, lengths, cont, *, bound: BoundPolicy, scan: bool = False,
                   positions: int = 0):
    """Teacher-forced log p(cont[:, j] | prompt, cont[:, :j]) [B, C] from the prefill's last logits [B, V]:
    each continuation token is fed as a decode step feeds its sample (one eviction per layer per
    token). `positions` as `decode_program`'s. The cache in `loop_form`."""
    cfg = params.config
    lws = layer_weights(params, scan)
    tables = rope_tables(cfg, positions, scan)

    def logprob(lg, tok):  # lg [B, V], tok [B] -> [B]
        lp = jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(lp, tok[:, None], axis=1)[:, 0]

    def step(caches, xs):
        j, fed, nxt = xs  # fed [B] at position lengths + j; nxt [B] the token it should predict
        q_pos = (lengths + j)[:, None]
        x, caches = _run_layers(cfg, bound, lws, caches, stream(params, bound, fed[:, None], q_pos), q_pos,
                                scan, tables)
        x = main(x)
        return caches, logprob(tf.final_logits(params, x[:, 0]), nxt)

    c = cont.shape[1]
    first = logprob(logits, cont[:, 0])
    xs = (jnp.arange(c - 1), cont[:, :-1].T, cont[:,
                                                  1:].T)  # step j feeds cont[:, j], predicts cont[:, j + 1]
    _, rest = jax.lax.scan(step, cache.layers, xs)  # rest [C - 1, B]
    return jnp.concatenate([first[:, None], rest.T], axis=1)

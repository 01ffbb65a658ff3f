"""One decoder-only transformer as pure functions over a params pytree; family
differences are config switches.

Layers attend (full or sliding window; optionally gated, with partial RoPE) or, where `layer_types` says
"linear_attention", run a Gated DeltaNet mixer (`models/deltanet.py`); every layer then has the same MLP.

Shape letters: B batch, S block (query) length, N cache slots, C = N + S candidates, H hidden, Nq query heads,
K kv heads, G = Nq // K query heads per kv head, D head dim, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from vdjax.models.config import ModelConfig
from vdjax.models.deltanet import LinearState, deltanet
from vdjax.models.moe import moe
from vdjax.models.params import Params

MASK_VALUE = -1e30  # finite, so a fully masked (padding) query row gives no NaN


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in fp32, scaled by (offset + w), returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (offset + w.astype(jnp.float32))).astype(x.dtype)
    return w * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None) -> np.ndarray:
    """Inverse RoPE frequencies [D/2] in fp32 for `theta` (default the global one) with llama3 or linear
    scaling applied when `scaling` (default the global one) asks for it."""
    theta = cfg.rope_theta if theta is None else theta
    scaling = cfg.rope_scaling_dict if scaling is None else scaling
    dim = cfg.rotary_dim or cfg.head_dim  # partial RoPE (Qwen3.5) rotates the first rotary_dim dims
    inv = (1.0 / (np.float32(theta)
                  ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)
    if scaling.get("rope_type") == "linear":
        inv = (inv / np.float32(scaling["factor"])).astype(np.float32)
    elif scaling.get("rope_type") == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif scaling.get("rope_type") == "yarn":
        inv = _yarn_inv_freq(inv, float(theta), dim, scaling)
    return inv


def _yarn_inv_freq(inv: np.ndarray, theta: float, dim: int, scaling: dict) -> np.ndarray:
    """YaRN (HF `_compute_yarn_parameters`): dims rotating faster than `beta_fast` turns over the original
    context keep their frequency, those slower than `beta_slow` turns are divided by `factor`, a linear ramp
    in between (bounds floored/ceiled unless truncate=False). The attention factor goes into cos/sin."""
    factor, old = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(turns):
        return dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (the original frequency), 0: interpolate
    return ((inv / np.float32(factor)) * (1 - keep) + inv * keep).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotate x [B, S, heads, D] at absolute positions [B, S] (HF rotate_half convention) over its first
    R = 2 len(inv_freq) dims (all of them but for partial RoPE); the other D - R pass through. `scale`
    multiplies cos and sin (YaRN's attention factor)."""
    rd = 2 * inv_freq.shape[-1]
    if rd < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rd], positions, inv_freq, scale), x[..., rd:]], axis=-1)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, R/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, S, 1, R]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def embed(params: Params, ids: jax.Array) -> jax.Array:
    """Token embeddings [B, S, H] (scaled by sqrt(H) where the family does)."""
    x = params.weights["embed"][ids]
    if params.config.embed_scale:
        x = x * jnp.asarray(math.sqrt(params.config.hidden_size), dtype=x.dtype)
    return x


def project_qkv(lw: dict, x: jax.Array, positions: jax.Array, cfg: ModelConfig, inv_freq: jax.Array,
                with_queries: bool = False):
    """Project normed hidden states [B, S, H] to q [B, S, Nq, D], k and v [B, S, K, D], and the output gate
    [B, S, Nq, D] (None unless `attn_gate`: Qwen3.5's wq yields [query | gate] per head).

    Biases added where the family has them (Qwen2), per-head q/k RMSNorm where it has it (Qwen3, Gemma3,
    Qwen3.5), then RoPE on q and k. `with_queries`: the pre-RoPE q is appended to the tuple.
    """
    q = jnp.einsum("bsh,hnd->bsnd", x, lw["wq"])
    gate = None
    if cfg.attn_gate:
        q, gate = q[..., : cfg.head_dim], q[..., cfg.head_dim:]
    k = jnp.einsum("bsh,hkd->bskd", x, lw["wk"])
    v = jnp.einsum("bsh,hkd->bskd", x, lw["wv"])
    if cfg.qkv_bias:
        q, k, v = q + lw["bq"], k + lw["bk"], v + lw["bv"]
    if cfg.qk_norm:
        q = rms_norm(q, lw["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        k = rms_norm(k, lw["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    scale = cfg.rope_attention_factor
    out = (apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale), v, gate)
    return out + (q,) if with_queries else out


def attend(
    q: jax.Array,  # [B, S, Nq, D] after RoPE
    q_pos: jax.Array,  # [B, S] absolute positions, -1 = padding
    k_cache: jax.Array,  # [B, K, N, D]
    v_cache: jax.Array,  # [B, K, N, D]
    pos_cache: jax.Array,  # [B, K, N], -1 = empty slot
    k_new: jax.Array,  # [B, K, S, D]
    v_new: jax.Array,  # [B, K, S, D]
    cfg: ModelConfig,
    window: jax.Array | int | None = None,  # sliding window W (tokens with q_pos - kv_pos >= W are masked)
    sinks: jax.Array | None = None,  # [Nq] learned sink logits (GPT-OSS), or None
):
    """Attention of the block's queries over cache slots + the block itself; returns (out [B,S,Nq,D], probs).

    probs [B, K, G, S, N + S] fp32 are the softmax weights over the candidates (cache slots first, then the
    block's tokens), the input every attention-based eviction score reads. With `sinks`, each head's sink
    logit joins the softmax (unscaled, never masked) and is dropped: a row's
    probs sum to less than one. """
    b, s, nq, d = q.shape
    kh, n = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, s, kh, nq // kh, d)  # [B, S, K, G, D]
    logits = jnp.concatenate(
        [
            jnp.einsum("bskgd,bknd->bkgsn", qg, k_cache, preferred_element_type=jnp.float32),
            jnp.einsum("bskgd,bktd->bkgst", qg, k_new, preferred_element_type=jnp.float32),
        ],
        axis=-1,
    ) * cfg.attn_scale  # [B, K, G, S, C]
    if cfg.attn_softcap:
        logits = jnp.tanh(logits / cfg.attn_softcap) * cfg.attn_softcap
    new_pos = jnp.broadcast_to(q_pos[:, None, :], (b, kh, s))  # [B, K, S]
    kv_pos = jnp.concatenate([pos_cache, new_pos], axis=-1)  # [B, K, C]
    qp = q_pos[:, None, :, None]  # [B, 1, S, 1]
    kp = kv_pos[:, :, None, :]  # [B, K, 1, C]
    mask = (kp >= 0) & (kp <= qp)  # [B, K, S, C]
    if window is not None:
        mask &= (qp - kp) < window
    logits = jnp.where(mask[:, :, None], logits, MASK_VALUE)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1)  # [B, K, G, S, C]
    else:
        sink = sinks.astype(jnp.float32).reshape(kh, nq // kh)[None, :, :, None, None]  # [1, K, G, 1, 1]
        top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
        e = jnp.exp(logits - top)
        probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    if s == 1:  # decode: [G, N] x [N, D] per head as multiply + reduce in fp32, reading V where it lies (as a
        # dot, XLA:CPU first copies the whole V cache into [K, D, N] every step; bench/README.md, decode)
        p1 = probs[:, :, :, 0]  # [B, K, G, C]
        out = jnp.sum(p1[..., :n, None] * v_cache[:, :, None].astype(jnp.float32), axis=-2) + (
            p1[..., n:] * v_new[:, :, None, 0].astype(jnp.float32))  # [B, K, G, D]
        return out.reshape(b, 1, nq, d).astype(q.dtype), probs
    pv = probs.astype(v_cache.dtype)
    out = jnp.einsum("bkgsn,bknd->bskgd", pv[..., :n], v_cache) + jnp.einsum(
        "bkgst,bktd->bskgd", pv[..., n:], v_new
    )
    return out.reshape(b, s, nq, d), probs


CHUNK = 512  # query and key chunk of `causal_attention`


def _chunk_logits(qi: jax.Array, kj: jax.Array, cfg: ModelConfig, folded: bool) -> jax.Array:
    """Logits [B, K, Gc, c] of one query chunk's rows qi [B, K, Gc, D] against key chunk kj [B, K, c, D]
    (fp32; scaled unless the scale was `folded` into q, then soft-capped)."""
    s = jnp.einsum("bkqd,bkpd->bkqp", qi, kj, preferred_element_type=jnp.float32)
    if not folded:
        s = s * cfg.attn_scale
    if cfg.attn_softcap:
        s = jnp.tanh(s / cfg.attn_softcap) * cfg.attn_softcap
    return s


def _online_softmax(carry, s: jax.Array, vj: jax.Array):
    """One key chunk of the online softmax: carry (running max, sum [B, K, Gc], weighted values
    [B, K, Gc, D]), logits s [B, K, Gc, c], values vj [B, K, c, D] -> the carry after it."""
    m, denom, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    scale = jnp.exp(m - m_new)
    acc = acc * scale[..., None] + jnp.einsum("bkqp,bkpd->bkqd", p.astype(vj.dtype), vj,
                                              preferred_element_type=jnp.float32)
    return m_new, denom * scale + jnp.sum(p, axis=-1), acc


def _softmax_start(sinks: jax.Array | None, shape: tuple, g: int, c: int, d: int):
    """The online softmax's first carry for rows of G heads x c queries: max MASK_VALUE and sum 0, or
    learned `sinks` [Nq] as each row's max and a sum of 1 (head g's sink on rows g c .. g c + c - 1)."""
    if sinks is None:
        m0, l0 = jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32)
    else:
        rows = jnp.repeat(sinks.astype(jnp.float32).reshape(shape[1], g), c, axis=1)  # [K, Gc]
        m0, l0 = jnp.broadcast_to(rows, shape), jnp.ones(shape, jnp.float32)
    return m0, l0, jnp.zeros(shape + (d,), jnp.float32)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array, cfg: ModelConfig,
                     window: int | None = None, chunk: int | None = None, sinks: jax.Array | None = None
                     ) -> jax.Array:
    """Causal attention of a whole sequence, reading only what each query can see: q [B, T, Nq, D], k, v
    [B, T, K, D] (after RoPE), pos [B, T] (-1 = padding) -> out [B, T, Nq, D].

    Flash-style: a scan over query chunks; each runs an online softmax (fp32) over the key chunks from the
    window's start (sliding layers) up to its own, so the work is the causal half, not T x T. A chunk's G
    query heads of one KV head are one [G c, D] matmul operand. The running max starts at MASK_VALUE, so a
    masked logit adds exactly 0 once a visible key has been seen (every real query sees itself); padding
    queries give 0. Learned `sinks` [Nq] start each row's running max and sum (a logit with no value).
    Without a window, the key chunks below the diagonal are seen whole by every query of the chunk: they get
    only a per-key padding bias (0 or MASK_VALUE, which absorbs any logit exactly) instead of the causal
    mask, and the diagonal chunk runs the masked body in a loop of its own (the same compiled body as
    before, so the output is bit-identical). A power-of-two `attn_scale` is applied to q (exact)
    instead of to each chunk's logits.
    """
    b, t, nq, d = q.shape
    kh, g = k.shape[2], nq // k.shape[2]
    c = min(chunk or CHUNK, t)
    pad = -t % c
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        pos = jnp.pad(pos, ((0, 0), (0, pad)), constant_values=-1)
    n = (t + pad) // c
    folded = math.frexp(cfg.attn_scale)[0] == 0.5 and not cfg.attn_softcap  # scale is 2^e: q * scale is exact
    if folded:
        q = q * jnp.asarray(cfg.attn_scale, q.dtype)
    # qh [n, B, K, Gc, D]
    qh = q.reshape(b, n, c, kh, g, d).transpose(1, 0, 3, 4, 2, 5).reshape(n, b, kh, g * c, d)
    kc = k.reshape(b, n, c, kh, d).transpose(1, 0, 3, 2, 4)  # [n, B, K, c, D]
    vc = v.reshape(b, n, c, kh, d).transpose(1, 0, 3, 2, 4)
    pc = pos.reshape(b, n, c).transpose(1, 0, 2)  # [n, B, c]
    bias = jnp.where(pc >= 0, 0.0, MASK_VALUE).astype(jnp.float32)[:, :, None, None, :]  # [n, B, 1, 1, c]

    def query_chunk(_, xs):
        qi, pq, i = xs  # [B, K, Gc, D], [B, c]
        qp = jnp.tile(pq, (1, g))[:, None, :, None]  # [B, 1, Gc, 1]: the rows are G heads x c queries

        def below(j, carry):  # key chunk j < i: every key precedes every query, so only padding is masked
            return _online_softmax(carry, _chunk_logits(qi, kc[j], cfg, folded) + bias[j], vc[j])

        def key_chunk(j, carry):
            kp = pc[j][:, None, None, :]  # [B, 1, 1, c]
            mask = (kp >= 0) & (kp <= qp)
            if window is not None:
                mask &= (qp - kp) < window
            return _online_softmax(carry, jnp.where(mask, _chunk_logits(qi, kc[j], cfg, folded), MASK_VALUE),
                                   vc[j])

        first = 0 if window is None else jnp.maximum(0, (i * c - window + 1) // c)
        carry = _softmax_start(sinks, (b, kh, g * c), g, c, d)
        if window is None:
            carry = jax.lax.fori_loop(0, i, below, carry)
            first = i
        m, denom, acc = jax.lax.fori_loop(first, i + 1, key_chunk, carry)
        out = jnp.where(qp[..., 0, None] >= 0, acc / denom[..., None], 0.0)  # [B, K, Gc, D]
        return None, out.reshape(b, kh, g, c, d).transpose(0, 3, 1, 2, 4).reshape(b, c, nq, d).astype(q.dtype)

    _, out = jax.lax.scan(query_chunk, None, (qh, pc, jnp.arange(n)))  # [n, B, c, Nq, D]
    return out.transpose(1, 0, 2, 3, 4).reshape(b, n * c, nq, d)[:, :t]


def mlp(lw: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gated MLP [B, S, H] -> [B, S, H] (SwiGLU, or GELU-tanh for Gemma)."""
    gate = jnp.einsum("bsh,hf->bsf", x, lw["w_gate"])
    up = jnp.einsum("bsh,hf->bsf", x, lw["w_up"])
    act = jax.nn.silu(gate) if cfg.mlp_act == "silu" else jax.nn.gelu(gate, approximate=True)
    return jnp.einsum("bsf,fh->bsh", act * up, lw["w_down"])


def mlp_block(lw: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The second half of every layer: x + MLP(norm(x)) (post-norm on the MLP output where the family has it;
    a mixture of experts where the config has experts)."""
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    h = rms_norm(x, lw["mlp_norm"], eps, off)
    m = moe(lw, h, cfg) if cfg.num_experts else mlp(lw, h, cfg)
    if cfg.post_norms:
        m = rms_norm(m, lw["post_mlp_norm"], eps, off)
    return x + m


def layer_forward(
    lw: dict,  # one layer's weights (no leading L axis)
    x: jax.Array,  # [B, S, H]
    q_pos: jax.Array,  # [B, S]
    k_cache: jax.Array,  # [B, K, N, D]
    v_cache: jax.Array,  # [B, K, N, D]
    pos_cache: jax.Array,  # [B, K, N]
    cfg: ModelConfig,
    inv_freq: jax.Array,  # [D/2]
    window: jax.Array | int | None = None,
    with_queries: bool = False,
):
    """One attention layer over a block; returns (x_out [B,S,H], k_new [B,K,S,D], v_new [B,K,S,D], probs),
    and with `with_queries` the block's pre-RoPE queries [B, S, Nq, D] too."""
    h = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    q, k, v, gate, q_pre = project_qkv(lw, h, q_pos, cfg, inv_freq, with_queries=True)
    k_new, v_new = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, D]
    o, probs = attend(q, q_pos, k_cache, v_cache, pos_cache, k_new, v_new, cfg, window, lw.get("sinks"))
    out = (layer_output(lw, x, o, gate, cfg), k_new, v_new, probs)
    return out + (q_pre,) if with_queries else out


def layer_output(lw: dict, x: jax.Array, o: jax.Array, gate: jax.Array | None, cfg: ModelConfig) -> jax.Array:
    """The rest of an attention layer after attention: (gate,) o_proj, post-norm, residual, MLP block.
    x [B, S, H], o [B, S, Nq, D] -> [B, S, H]."""
    if gate is not None:  # gated attention (Qwen3.5): the output times sigmoid(gate), before o_proj
        o = o * jax.nn.sigmoid(gate)
    b, s, nq, d = o.shape  # flatten heads so XLA transposes the small activation, not the weight
    a = jnp.einsum("bsx,xh->bsh", o.reshape(b, s, nq * d), lw["wo"].reshape(nq * d, -1))
    if cfg.o_bias:
        a = a + lw["bo"]
    if cfg.post_norms:
        a = rms_norm(a, lw["post_attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    return mlp_block(lw, x + a, cfg)


def causal_layer_forward(lw: dict, x: jax.Array, pos: jax.Array, cfg: ModelConfig, inv_freq: jax.Array,
                         window: int | None = None, with_queries: bool = False):
    """One attention layer over a whole sequence x [B, T, H] with `causal_attention` (no cache, no weights
    kept): returns (x_out [B, T, H], k [B, K, T, D], v [B, K, T, D]) -- the dense prefill's layer -- and with
    `with_queries` the pre-RoPE queries [B, T, Nq, D] after them."""
    h = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    q, k, v, gate, *pre = project_qkv(lw, h, pos, cfg, inv_freq, with_queries=with_queries)
    o = causal_attention(q, k, v, pos, cfg, window, sinks=lw.get("sinks"))
    return layer_output(lw, x, o, gate, cfg), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), *pre


def linear_layer_forward(lw: dict, x: jax.Array, q_pos: jax.Array, state: LinearState, cfg: ModelConfig):
    """One Gated DeltaNet layer over a block x [B, S, H] (no KV cache: its state carries the past);
    returns (x_out [B, S, H], new state)."""
    h = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    a, state = deltanet(lw, h, q_pos, state, cfg)
    return mlp_block(lw, x + a, cfg), state


def final_logits(params: Params, x: jax.Array) -> jax.Array:
    """Final norm + LM head: hidden [..., H] -> fp32 logits [..., V]."""
    cfg, w = params.config, params.weights
    x = rms_norm(x, w["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    head = w["embed"] if cfg.tie_embeddings else w["lm_head"]  # [V, H]
    logits = jnp.einsum("...h,vh->...v", x, head, preferred_element_type=jnp.float32)
    if cfg.final_softcap:
        logits = jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits


def layer_settings(cfg: ModelConfig, layer: int) -> tuple[np.ndarray, int | None]:
    """(inverse RoPE frequencies [D/2], sliding window or None) of one layer."""
    theta, scaling = cfg.rope(layer)
    return rope_inv_freq(cfg, theta, scaling), cfg.window(layer)


def dense_layer(lw: dict, x: jax.Array, pos: jax.Array, cfg: ModelConfig, inv_freq: jax.Array,
                window: int | None = None):
    """One layer over a whole sequence x [B, T, H] at positions pos [B, T], no cache: causal attention among
    its own tokens. Returns (x_out [B, T, H], k [B, K, T, D], v [B, K, T, D], probs [B, K, G, T, T])."""
    b = x.shape[0]
    empty_kv = jnp.zeros((b, cfg.num_kv_heads, 0, cfg.head_dim), x.dtype)
    empty_pos = jnp.zeros((b, cfg.num_kv_heads, 0), jnp.int32)
    return layer_forward(lw, x, pos, empty_kv, empty_kv, empty_pos, cfg, inv_freq, window)


def dense_linear_layer(lw: dict, x: jax.Array, pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """One Gated DeltaNet layer over a whole sequence x [B, T, H] from a zero state -> x_out [B, T, H]."""
    return linear_layer_forward(lw, x, pos, LinearState.empty(cfg, x.shape[0], x.dtype), cfg)[0]


def forward(params: Params, ids: jax.Array, logits_at: jax.Array | None = None) -> jax.Array:
    """Plain dense causal forward of ids [B, T] -> fp32 logits [B, T, V] (no cache, no eviction).

    `logits_at` [P] (positions) computes the LM head there only -> [B, P, V]
    (large vocabularies, long T). """
    cfg = params.config
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = embed(params, ids)
    for i, lw in enumerate(params.weights["layers"]):
        if not cfg.attends(i):
            x = dense_linear_layer(lw, x, pos, cfg)
            continue
        inv_freq, window = layer_settings(cfg, i)
        x, _, _ = causal_layer_forward(lw, x, pos, cfg, jnp.asarray(inv_freq), window)
    return final_logits(params, x if logits_at is None else x[:, logits_at])

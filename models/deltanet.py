"""Gated DeltaNet (Qwen3.5's linear-attention layers): no KV cache, a fixed-size state per row.

Shape letters: B batch, S tokens, C conv channels (= 2 Hk dk + Hv dv, the [q | k | v] projection), K the conv
kernel, Hk / Hv key / value heads, dk / dv their dims, H hidden.

Per token t and value head (key head = value head // (Hv / Hk)), with state S [dk, dv]:

    S = exp(g_t) S;  delta = beta_t (v_t - k_t^T S);  S = S + k_t delta^T;  o_t = q_t^T S

g_t = -exp(A_log) softplus(a_t + dt_bias) <= 0, beta_t = sigmoid(b_t), q and k L2-normalised (eps 1e-6 on the
sum of squares) after a depthwise causal conv + SiLU over all C channels, q scaled by dk^-1/2. The output goes
through an RMSNorm with a plain weight, gated by SiLU(z), then `w_out`. Everything of the rule runs in fp32.

A block of S tokens uses the chunked form (chunks of CHUNK tokens: the within-chunk part as matmuls and a
unit-lower-triangular solve, a `lax.scan` over chunks carries the state); one decode token the recurrent form.
Padding tokens (q_pos < 0, always after a row's real tokens) get g = 0 and beta = 0 and never enter the conv
state, so they change no state: a row's state is what its own tokens make of it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

CHUNK = 64
L2_EPS = 1e-6
RULE = jnp.float32  # the dtype the rule runs in (fp32 as HF; tests raise it to fp64 to measure rounding)


@flax.struct.dataclass
class LinearState:
    """One DeltaNet layer's per-row state: conv [B, K - 1, C] (the last K - 1 projected inputs, model dtype)
    and rec [B, Hv, dk, dv] (the delta-rule state, fp32)."""

    conv: jax.Array
    rec: jax.Array

    @classmethod
    def empty(cls, cfg, batch: int, dtype) -> LinearState:
        """Zero state (no token seen)."""
        return cls(conv=jnp.zeros((batch, cfg.linear_conv_kernel - 1, conv_channels(cfg)), dtype),
                   rec=jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim), RULE))


def conv_channels(cfg) -> int:
    """C: the [q | k | v] projection width that the conv runs over."""
    return (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim)


def causal_conv(x: jax.Array, conv: jax.Array, w: jax.Array,
                n_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv of x [B, S, C] after the previous inputs conv [B, K-1, C]; w [K, C] (tap K-1 is
    the current token). Returns (y [B, S, C] before the activation, the new conv state: the last K - 1 inputs
    up to each row's last real token, n_valid [B] of the S)."""
    k = w.shape[0]
    xx = jnp.concatenate([conv, x], axis=1)  # [B, K-1+S, C]
    s = x.shape[1]
    y = sum(xx[:, j:j + s] * w[j] for j in range(k))
    idx = n_valid[:, None] + jnp.arange(k - 1)[None]  # [B, K-1]
    return y, jnp.take_along_axis(xx, idx[:, :, None], axis=1)


def _l2(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def project(lw: dict, h: jax.Array, q_pos: jax.Array, state: LinearState, cfg):
    """Projections, conv + SiLU, L2 norms, beta and g of a block h [B, S, H] (normed hidden states).

    Returns (q, k [B, S, Hv, dk] fp32 (key heads repeated per value head, q scaled), v [B, S, Hv, dv] fp32,
    g, beta [B, S, Hv] fp32 (0 on padding), z [B, S, Hv, dv], new conv state).
    """
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    b, s, _ = h.shape
    valid = q_pos >= 0  # [B, S]
    qkv = jnp.einsum("bsh,hc->bsc", h, lw["w_qkv"])
    y, conv = causal_conv(qkv, state.conv, lw["conv_w"], jnp.sum(valid, axis=1))
    y = jax.nn.silu(y).astype(RULE)  # SiLU in the model dtype, the rule in fp32 (as HF)
    q = y[..., : hk * dk].reshape(b, s, hk, dk)
    k = y[..., hk * dk: 2 * hk * dk].reshape(b, s, hk, dk)
    v = y[..., 2 * hk * dk:].reshape(b, s, hv, dv)
    rep = hv // hk  # value head j reads key head j // rep
    q = jnp.repeat(_l2(q), rep, axis=2) * dk ** -0.5
    k = jnp.repeat(_l2(k), rep, axis=2)
    z = jnp.einsum("bsh,hnd->bsnd", h, lw["w_z"])
    beta = jax.nn.sigmoid(jnp.einsum("bsh,hn->bsn", h, lw["w_b"])).astype(RULE)
    a = jnp.einsum("bsh,hn->bsn", h, lw["w_a"]).astype(RULE)
    g = -jnp.exp(lw["A_log"].astype(RULE)) * jax.nn.softplus(a + lw["dt_bias"].astype(RULE))
    keep = valid[..., None]
    return q, k, v, jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0), z, conv


def recurrent_step(q, k, v, g, beta, rec):
    """One token per row: q, k [B, Hv, dk], v [B, Hv, dv], g, beta [B, Hv], rec [B, Hv, dk, dv]
    -> (o [B, Hv, dv], new rec)."""
    rec = rec * jnp.exp(g)[..., None, None]
    pred = jnp.einsum("bnk,bnkv->bnv", k, rec)
    rec = rec + jnp.einsum("bnk,bnv->bnkv", k, (v - pred) * beta[..., None])
    return jnp.einsum("bnk,bnkv->bnv", q, rec), rec


def chunked(q, k, v, g, beta, rec, chunk: int = CHUNK):
    """The delta rule over S tokens in chunks: q, k [B, S, Hv, dk], v [B, S, Hv, dv], g, beta [B, S, Hv],
    rec [B, Hv, dk, dv] -> (o [B, S, Hv, dv], final rec). Exact (up to fp32 rounding) to S recurrent steps."""
    b, s, hv, dk = k.shape
    dv = v.shape[-1]
    c = min(chunk, s)
    pad = -s % c
    if pad:  # g = 0, beta = 0: padded steps change nothing
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    n = (s + pad) // c

    def split(x):  # [B, S, Hv, ...] -> [N, B, Hv, c, ...]
        return jnp.moveaxis(x.reshape(b, n, c, hv, *x.shape[3:]), (1, 3), (0, 2))

    q, k, v, g, beta = (split(x) for x in (q, k, v, g, beta))  # g, beta [N, B, Hv, c]
    cum = jnp.cumsum(g, axis=-1)  # log-decay from the chunk start
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    kb = k * beta[..., None]
    a = jnp.where(lower & ~jnp.eye(c, dtype=bool), jnp.einsum("...ik,...jk->...ij", kb, k) * decay, 0.0)
    eye = jnp.eye(c, dtype=RULE)
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(cum)[..., None]],
                          axis=-1)  # [N, B, Hv, c, dv+dk]
    uw = jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True, unit_diagonal=True)
    u, w = uw[..., :dv], uw[..., dv:]  # the chunk's corrections: u_t = U_t - W_t S0
    intra = jnp.einsum("...ik,...jk->...ij", q, k) * decay
    qd = q * jnp.exp(cum)[..., None]
    kd = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    cd = jnp.exp(cum[..., -1])[..., None, None]  # [N, B, Hv, 1, 1]

    def step(state, xs):
        u_n, w_n, qd_n, kd_n, intra_n, cd_n = xs
        v_new = u_n - jnp.einsum("bnck,bnkv->bncv", w_n, state)
        o = jnp.einsum("bnck,bnkv->bncv", qd_n, state) + jnp.einsum("bncj,bnjv->bncv", intra_n, v_new)
        return state * cd_n + jnp.einsum("bnck,bncv->bnkv", kd_n, v_new), o

    rec, o = jax.lax.scan(step, rec, (u, w, qd, kd, intra, cd))  # o [N, B, Hv, c, dv]
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(b, n * c, hv, dv)
    return o[:, :s], rec


def gated_norm(o: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over dv with a plain weight w [dv], then times SiLU(z): o (fp32),
    z [B, S, Hv, dv] -> z's dtype.

    As HF: the rule's output comes back in the model dtype, the norm is computed in fp32."""
    o = o.astype(z.dtype).astype(RULE)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    o = (w * o.astype(z.dtype)).astype(RULE) * jax.nn.silu(z.astype(RULE))
    return o.astype(z.dtype)


def deltanet(lw: dict, h: jax.Array, q_pos: jax.Array, state: LinearState,
             cfg) -> tuple[jax.Array, LinearState]:
    """A DeltaNet layer's mixer on normed hidden states h [B, S, H] at positions q_pos [B, S] (-1 padding),
    continuing from `state`. Returns (out [B, S, H], new state)."""
    q, k, v, g, beta, z, conv = project(lw, h, q_pos, state, cfg)
    if h.shape[1] == 1:  # decode: one recurrent step
        o, rec = recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.rec)
        o = o[:, None]
    else:
        o, rec = chunked(q, k, v, g, beta, state.rec)
    o = gated_norm(o, z, lw["dn_norm"], cfg.rms_norm_eps)  # [B, S, Hv, dv]
    b, s = h.shape[:2]
    out = jnp.einsum("bsx,xh->bsh", o.reshape(b, s, -1), lw["w_out"].reshape(-1, lw["w_out"].shape[-1]))
    return out, LinearState(conv=conv, rec=rec)

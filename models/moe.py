"""Mixture of experts (GPT-OSS): router top-k, softmax over the k selected logits, clamped-SwiGLU experts.

Shape letters: N tokens (B x S flattened), H hidden, E experts, k experts per token, F expert width,
A = N k (token, expert) assignments.

Dispatch runs only the experts a token selected. `grouped` sorts the assignments by expert and, on XLA:CPU,
loops over the experts that received rows, multiplying each one's rows in tiles (its weights are read once,
an unselected expert costs nothing); on GPU/TPU it is one `jax.lax.ragged_dot` per projection (XLA:CPU lowers
ragged_dot to a dense product over every group: E x the FLOPs). `dense_moe` runs every expert on every token:
the reference the tests compare the dispatch with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(lw: dict, x: jax.Array, cfg) -> tuple[jax.Array, jax.Array]:
    """Router of tokens x [N, H] -> (expert ids [N, k] int32, weights [N, k]:
    softmax over the top-k logits)."""
    logits = jnp.einsum("nh,he->ne", x, lw["router_w"], preferred_element_type=jnp.float32) + lw["router_b"]
    top, idx = jax.lax.top_k(logits, cfg.experts_per_token)
    return idx.astype(jnp.int32), jax.nn.softmax(top, axis=-1).astype(x.dtype)


def swiglu(h: jax.Array, cfg) -> jax.Array:
    """Clamped SwiGLU of gate|up [..., 2F] -> [..., F]: gate <= limit, |up| <= limit,
    (up + 1) * gate * sigmoid(alpha * gate)."""
    f = h.shape[-1] // 2
    gate = jnp.minimum(h[..., :f], cfg.swiglu_limit)
    up = jnp.clip(h[..., f:], -cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def _tile(assignments: int, experts: int) -> int:
    """Rows per matmul tile of the CPU loop: about the mean rows per expert, 8 to 128."""
    mean = -(-assignments // experts)
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def _loop_experts(xs, counts, starts, lw, cfg):
    """Expert outputs of the sorted rows xs [A, H] (expert e owns rows starts[e] .. + counts[e]) -> [A, H]:
    a loop over the experts, skipping those without rows, each one's rows in tiles (the last one masked)."""
    a, hdim = xs.shape
    t = _tile(a, cfg.num_experts)
    xs = jnp.pad(xs, ((0, t), (0, 0)))  # a tile may run past the last row
    out = jnp.zeros_like(xs)

    def expert(e, out):
        w_gu, b_gu, w_d, b_d = (lw["moe_gate_up"][e], lw["moe_gate_up_b"][e], lw["moe_down"][e],
                                lw["moe_down_b"][e])

        def tile(j, out):
            r0 = starts[e] + j * t
            rows = jax.lax.dynamic_slice(xs, (r0, 0), (t, hdim))  # [t, H]
            h = jnp.dot(rows, w_gu, preferred_element_type=jnp.float32).astype(xs.dtype) + b_gu  # [t, 2F]
            y = jnp.dot(swiglu(h, cfg), w_d, preferred_element_type=jnp.float32).astype(xs.dtype) + b_d
            valid = (jnp.arange(t) < counts[e] - j * t)[:, None]
            old = jax.lax.dynamic_slice(out, (r0, 0), (t, hdim))
            return jax.lax.dynamic_update_slice(out, jnp.where(valid, y, old), (r0, 0))

        return jax.lax.fori_loop(0, (counts[e] + t - 1) // t, tile, out)

    return jax.lax.fori_loop(0, cfg.num_experts, expert, out)[:a]


def _ragged_experts(xs, counts, expert_of_row, lw, cfg):
    """Expert outputs of the sorted rows xs [A, H] with `jax.lax.ragged_dot` (GPU/TPU) -> [A, H]."""
    h = jax.lax.ragged_dot(xs, lw["moe_gate_up"], counts, preferred_element_type=jnp.float32).astype(xs.dtype)
    h = h + lw["moe_gate_up_b"][expert_of_row]
    y = jax.lax.ragged_dot(swiglu(h, cfg), lw["moe_down"], counts, preferred_element_type=jnp.float32)
    return y.astype(xs.dtype) + lw["moe_down_b"][expert_of_row]


def grouped(lw: dict, x: jax.Array, idx: jax.Array, weights: jax.Array, cfg, ragged: bool | None = None):
    """Sparse dispatch: tokens x [N, H] with their experts idx [N, k] and weights [N, k] -> [N, H].

    `ragged`: ragged_dot (default off XLA:CPU) or the loop over selected experts (default on XLA:CPU)."""
    n, k = idx.shape
    flat = idx.reshape(-1)  # [A]
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // k  # [A]
    counts = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)  # [E]
    xs = x[token]  # [A, H]
    if ragged is None:
        ragged = jax.default_backend() != "cpu"
    if ragged:
        ys = _ragged_experts(xs, counts, flat[order], lw, cfg)
    else:
        ys = _loop_experts(xs, counts, jnp.cumsum(counts) - counts, lw, cfg)
    ys = ys * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(ys)


def dense_moe(lw: dict, x: jax.Array, idx: jax.Array, weights: jax.Array, cfg) -> jax.Array:
    """Every expert on every token, combined with the routing weights (zero for unselected experts):
    the reference of `grouped`. x [N, H] -> [N, H]."""
    h = jnp.einsum("nh,ehf->enf", x, lw["moe_gate_up"]) + lw["moe_gate_up_b"][:, None]  # [E, N, 2F]
    y = jnp.einsum("enf,efh->enh", swiglu(h, cfg), lw["moe_down"]) + lw["moe_down_b"][:, None]  # [E, N, H]
    full = (jnp.zeros((x.shape[0], cfg.num_experts), x.dtype)
            .at[jnp.arange(x.shape[0])[:, None], idx].set(weights))
    return jnp.einsum("enh,ne->nh", y, full)


def moe(lw: dict, x: jax.Array, cfg) -> jax.Array:
    """The mixture-of-experts MLP of normed hidden states [B, S, H] -> [B, S, H]."""
    b, s, h = x.shape
    flat = x.reshape(b * s, h)
    idx, weights = route(lw, flat, cfg)
    return grouped(lw, flat, idx, weights, cfg).reshape(b, s, h)

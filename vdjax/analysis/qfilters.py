"""Q-Filters from calibration prompts (arXiv 2503.02812), as the paper computes them: per layer and KV head,
the principal direction u of the post-RoPE queries of the head's query group (first right singular vector of
the stacked queries), oriented so that the queries project positively on it (E<q, u> > 0); the filter is
f = -u, so that the score -<f, k> = <u, k> keeps the keys the queries' dominant direction attends to most.
`vdjax analyze --model M --qfilters` saves them beside the checkpoint (`vdjax.engine.qfilters`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vdjax.models import transformer as tf
from vdjax.models.params import Params


@jax.jit
def _gram(q):
    """Sum of q^T q over a prompt's queries: q [T, G, D] -> [D, D] (fp32), and their sum [D]."""
    q = q.reshape(-1, q.shape[-1]).astype(jnp.float32)
    return q.T @ q, jnp.sum(q, axis=0)


@functools.partial(jax.jit, static_argnames=("cfg", "window"))
def _layer(lw, x, pos, inv_freq, *, cfg, window):
    """One dense layer on x [1, T, H] -> (x, its post-RoPE queries [T, Nq, D])."""
    h = tf.rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    q = tf.project_qkv(lw, h, pos, cfg, inv_freq)[0]
    return tf.dense_layer(lw, x, pos, cfg, inv_freq, window)[0], q[0]


_linear_layer = jax.jit(tf.dense_linear_layer, static_argnames=("cfg",))


def _queries(params: Params, ids: Sequence[int]):
    """Run one prompt densely; yield (layer, post-RoPE queries [T, Nq, D]) for every attention layer."""
    cfg = params.config
    x = tf.embed(params, jnp.asarray(np.asarray(ids, np.int32)[None]))
    pos = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    for i, lw in enumerate(params.weights["layers"]):
        if not cfg.attends(i):
            x = _linear_layer(lw, x, pos, cfg=cfg)
            continue
        inv_freq, window = tf.layer_settings(cfg, i)
        x, q = _layer(lw, x, pos, jnp.asarray(inv_freq), cfg=cfg, window=window)
        yield i, q


def fit_qfilters(params: Params, prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """Filters [L, K, D] (zeros on layers without a KV cache) from the prompts' queries: per KV head the top
    eigenvector of the uncentred second moment of its group's queries (= the first right singular vector of
    the stacked queries), signed so the queries' mean projects positively, then negated (kvpress scores
    -<f, k>)."""
    cfg = params.config
    kh, g, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    gram = np.zeros((cfg.num_layers, kh, d, d))
    total = np.zeros((cfg.num_layers, kh, d))
    for ids in prompts:
        for i, q in _queries(params, ids):
            for h in range(kh):
                m, s = _gram(q[:, h * g:(h + 1) * g])
                gram[i, h] += np.asarray(m, np.float64)
                total[i, h] += np.asarray(s, np.float64)
    filters = np.zeros((cfg.num_layers, kh, d))
    for i in range(cfg.num_layers):
        if not cfg.attends(i):
            continue
        for h in range(kh):
            u = np.linalg.eigh(gram[i, h])[1][:, -1]
            filters[i, h] = -u if total[i, h] @ u > 0 else u
    return filters


def orientation(params: Params, filters: np.ndarray, ids: Sequence[int], keep: float = 0.25) -> float:
    """The share of KV heads (over every attention layer) in which the `keep` fraction of one prompt's tokens
    with the highest -<f, k> receives more attention (summed over the queries, mean over the head's query
    group) than the rest, BOS left out: near 1 when the filters are oriented as the paper orients them."""
    from vdjax.analysis.geometry import capture

    good = total = 0
    for i, k, _, probs in capture(params, ids):
        score = -np.einsum("ktd,kd->kt", np.asarray(k), filters[i])[:, 1:]
        kh, t = k.shape[0], k.shape[1]
        received = np.asarray(probs).reshape(kh, -1, t, t).mean(axis=1).sum(axis=1)[:, 1:]  # [K, T - 1]
        top = max(1, int(keep * (t - 1)))
        for h in range(kh):
            order = np.argsort(-score[h])
            good += received[h][order[:top]].mean() > received[h][order[top:]].mean()
            total += 1
    return good / max(total, 1)

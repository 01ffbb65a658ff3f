"""KV-geometry diagnostics of the paper (§3.1, §4.4, Appendices C and D) as pure functions, and their driver.

Per layer and head, over calibration prompts run densely (no eviction):

- sigma_k, sigma_v: std over tokens i of ||k_i - mean(k)||_2 (resp. v), keys after RoPE (what the cache holds)
  (Table 4); the model's sigma_v/sigma_k is the ratio of the means over layers and heads.
- sink rate: fraction of query heads whose leading token (position 0) gets mean weight > tau = 0.3 from the
  non-leading queries t >= 1; bos_attn: that mean weight (Table 5). Sliding layers count the zeros of queries
  the leading token is outside the window of (what the attention weights are).
- bos_cos: cos(k_0, mean_{i>=1} k_i) per KV head (Table 5).
- w_ratio: ||W_V||_2 / ||W_K||_2, spectral norms of each KV head's [H, D] projection (Table 6, data-free).
- s1_ratio: sigma_1(V) / sigma_1(K), largest singular values of the head's [T, D] value / key matrices
  (Table 6).
- jaccard: Appendix D. 128 query positions evenly spaced over [k + 32, T - 1]; for each ordered pair the top-k
  (k = 256) sets of both rows over the shared prefix [0, min(t_i, t_j)); s(t_i) = mean_j J(t_i, t_j); the
  layer's value is the mean of s over positions and query heads (Table 8). Ties (e.g. the zero weights beyond
  a sliding window) go to the earlier position.

Everything is averaged over prompts; model-level ratios are ratios of means
(as Table 4's columns are). """

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vdjax.models import transformer as tf
from vdjax.models.params import Params

TAU = 0.3
TOPK = 256
N_QUERIES = 128
MARGIN = 32
_EPS = 1e-12


# ---- statistics (pure, jit-able) ------------------------------------------------------------------------
def dispersion(x: jax.Array) -> jax.Array:
    """std over tokens of ||x_i - mean(x)||_2: x [..., T, D] -> [...] (population std, fp32)."""
    x = x.astype(jnp.float32)
    dist = jnp.linalg.norm(x - jnp.mean(x, axis=-2, keepdims=True), axis=-1)  # [..., T]
    return jnp.std(dist, axis=-1)


def top_singular(x: jax.Array) -> jax.Array:
    """Largest singular value of each [T, D] matrix: x [..., T, D] -> [...]."""
    return jnp.linalg.svd(x.astype(jnp.float32), compute_uv=False)[..., 0]


def bos_key_cosine(k: jax.Array) -> jax.Array:
    """cos(k_0, mean_{i>=1} k_i): k [..., T, D] -> [...]."""
    k = k.astype(jnp.float32)
    k0, rest = k[..., 0, :], jnp.mean(k[..., 1:, :], axis=-2)
    return jnp.sum(k0 * rest, -1) / jnp.maximum(jnp.linalg.norm(k0, axis=-1) * jnp.linalg.norm(rest, axis=-1),
                                                _EPS)


def bos_attention(probs: jax.Array) -> jax.Array:
    """Mean weight of position 0 over the queries t >= 1: probs [..., T, T] (query, key) -> [...]."""
    return jnp.mean(probs[..., 1:, 0].astype(jnp.float32), axis=-1)


def jaccard_positions(t: int, k: int = TOPK, n: int = N_QUERIES, margin: int = MARGIN) -> np.ndarray:
    """Appendix D's query positions: n evenly spaced over [k + margin, t - 1]
    (fewer if the range is short)."""
    lo = k + margin
    if t - 1 < lo:
        raise ValueError(f"top-{k} Jaccard needs prompts of more than k + {margin} = {lo} tokens, got {t}")
    return np.unique(np.round(np.linspace(lo, t - 1, n)).astype(np.int64))


@functools.partial(jax.jit, static_argnames=("k",))
def topk_jaccard(rows: jax.Array, positions: jax.Array, *, k: int = TOPK) -> jax.Array:
    """Positional stability s(t_i) of Appendix D: rows [H, n, T] (attention of the n query positions),
    positions [n] ascending -> [H, n], s(t_i) = mean over j != i of |A_i ∩ A_j| / |A_i ∪ A_j| with
    A = top-k of each row over the shared prefix [0, min(t_i, t_j)).

    Each row is sorted once (descending, ties to the earlier position); the top-k over a prefix c is then
    the first k sorted entries whose position is < c.
    """
    h, n, t = rows.shape
    order = jnp.argsort(-rows.astype(jnp.float32), axis=-1, stable=True)  # [H, n, T] position at sorted index
    hi, ni = jnp.arange(h)[:, None, None], jnp.arange(n)[None, :, None]
    # [H, n, T] sorted index of each position
    rank = jnp.zeros_like(order).at[hi, ni, order].set(jnp.arange(t))
    bs = 32  # the k-th prefix entry is found bucket by bucket (a full cumsum over T is slow on CPU)
    nb = -(-t // bs)
    padded = jnp.pad(order, ((0, 0), (0, 0), (0, nb * bs - t)), constant_values=t).reshape(h, n, nb, bs)
    where = jnp.arange(t)

    def kth(c):  # [H, n] sorted index of the k-th entry whose position is < c
        first = padded < c  # [H, n, nb, bs]
        cum = jnp.cumsum(jnp.sum(first, axis=-1), axis=-1)  # [H, n, nb]
        b = jnp.sum(cum < k, axis=-1)  # the bucket holding the k-th entry
        before = jnp.where(b > 0, jnp.take_along_axis(cum, jnp.maximum(b - 1, 0)[..., None], -1)[..., 0], 0)
        inside = jnp.take_along_axis(first, b[..., None, None], axis=2)[:, :, 0]  # [H, n, bs]
        return b * bs + jnp.sum(jnp.cumsum(inside, axis=-1) < (k - before)[..., None], axis=-1)

    def against(i):  # pairs (i, j) with c = t_i, for every j: |A_i ∩ A_j|
        c = positions[i]
        sel = (rank <= kth(c)[..., None]) & (where < c)  # [H, n, T] top-k over the prefix, in position order
        return jnp.sum(sel & jax.lax.dynamic_slice_in_dim(sel, i, 1, axis=1), axis=-1)  # [H, n]

    inter = jax.lax.map(against, jnp.arange(n)).transpose(1, 0, 2)  # [H, i, j] (valid where t_i <= t_j)
    inter = jnp.where(positions[:, None] <= positions[None, :], inter, inter.transpose(0, 2, 1))
    jac = inter / (2 * k - inter)
    off = 1.0 - jnp.eye(n)
    return jnp.sum(jac * off, axis=-1) / (n - 1)


def weight_norms(wk: np.ndarray, wv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Spectral norms [K] of each KV head's key and value projections (wk, wv [H, K, D])."""
    def per_head(w):
        w = np.asarray(w, np.float32)
        return np.array([np.linalg.norm(w[:, j, :], 2) for j in range(w.shape[1])])

    return per_head(wk), per_head(wv)


# ---- dense capture of one prompt ------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg", "window"))
def _layer(lw, x, pos, inv_freq, *, cfg, window):
    """One dense layer on x [1, T, H] -> (x, k [K, T, D], v [K, T, D], probs [Nq, T, T])."""
    x, k, v, probs = tf.dense_layer(lw, x, pos, cfg, inv_freq, window)
    t = x.shape[1]
    return x, k[0].astype(jnp.float32), v[0].astype(jnp.float32), probs[0].reshape(-1, t, t)


# Gated DeltaNet layers over the whole prompt (no statistics: no keys, no attention)
_linear_layer = jax.jit(tf.dense_linear_layer, static_argnames=("cfg",))


def capture(params: Params, ids: Sequence[int]) -> Iterator[tuple[int, jax.Array, jax.Array, jax.Array]]:
    """Run one prompt densely and yield (layer, k [K, T, D], v [K, T, D], probs [Nq, T, T]) for every
    attention layer (Gated DeltaNet layers run, yield nothing: no keys, no attention).

    Query head n reads KV head n // G (HF order). Keys are after RoPE
    (and q/k-norm), as cached. """
    cfg = params.config
    ids = jnp.asarray(np.asarray(ids, np.int32)[None])
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    x = tf.embed(params, ids)
    for i, lw in enumerate(params.weights["layers"]):
        if not cfg.attends(i):
            x = _linear_layer(lw, x, pos, cfg=cfg)
            continue
        inv_freq, window = tf.layer_settings(cfg, i)
        x, k, v, probs = _layer(lw, x, pos, jnp.asarray(inv_freq), cfg=cfg, window=window)
        yield i, k, v, probs


@jax.jit
def _kv_stats(k, v, probs):
    """The per-head statistics of one layer of one prompt (everything but Jaccard)."""
    return dict(sigma_k=dispersion(k), sigma_v=dispersion(v), s1_k=top_singular(k), s1_v=top_singular(v),
                bos_cos=bos_key_cosine(k), bos_attn=bos_attention(probs))


def layer_stats(k, v, probs, *, tau: float = TAU, topk: int | None = TOPK, n_queries: int = N_QUERIES,
                margin: int = MARGIN) -> dict[str, np.ndarray]:
    """Per-head statistics of one layer of one prompt: k, v [K, T, D], probs
    [Nq, T, T] -> {name: [K] or [Nq]}.

    Keys: sigma_k, sigma_v, s1_k, s1_v, bos_cos ([K]); bos_attn, sink, learned_sink (the mass a learned sink
    logit takes: 1 - a row's weights, averaged over the queries; 0 without
    sinks), and jaccard when topk ([Nq]).
    """
    out = {name: np.asarray(a, np.float64) for name, a in _kv_stats(k, v, probs).items()}
    out["learned_sink"] = 1.0 - np.asarray(jnp.mean(jnp.sum(probs, axis=-1), axis=-1), np.float64)
    out["sink"] = (out["bos_attn"] > tau).astype(np.float64)
    if topk:
        where = jaccard_positions(probs.shape[-1], topk, n_queries, margin)
        rows = probs[:, where, :]  # [Nq, n, T]
        out["jaccard"] = np.asarray(jnp.mean(topk_jaccard(rows, jnp.asarray(where), k=topk), axis=-1),
                                    np.float64)
    return out


# ---- the model-level report -----------------------------------------------------------------------------
HEAD_FIELDS = ("sigma_k", "sigma_v", "s1_k", "s1_v", "bos_cos", "wk_norm", "wv_norm")  # per KV head
QHEAD_FIELDS = ("bos_attn", "sink", "learned_sink", "jaccard")  # per query head


@dataclasses.dataclass
class Geometry:
    """Per-layer, per-head statistics averaged over prompts, and their model-level aggregates."""

    model: str
    heads: dict[str, np.ndarray]  # name -> [L, K] (HEAD_FIELDS) or [L, Nq] (QHEAD_FIELDS), NaN = not measured
    windows: list[int | None]  # sliding window per layer
    prompts: list[dict[str, Any]]  # name, category, tokens
    settings: dict[str, Any]  # tau, topk, n_queries, margin, jaccard_prompts
    layer_types: list[str] | None = None  # per layer; "linear_attention" (Gated DeltaNet) rows are NaN

    def measured(self, layer: int) -> bool:
        """Whether `layer` has attention (and so statistics)."""
        return self.layer_types is None or self.layer_types[layer] != "linear_attention"

    def per_layer(self) -> dict[str, np.ndarray]:
        """Layer means [L] of every statistic, plus the per-layer ratios and per-head spreads."""
        h = self.heads
        with warnings.catch_warnings():  # layers without attention (Gated DeltaNet) are all-NaN rows
            warnings.simplefilter("ignore", RuntimeWarning)
            out = {name: np.nanmean(a, axis=1) if np.isfinite(a).any() else np.full(a.shape[0], np.nan)
                   for name, a in h.items()}
            out["sigma_k_std"] = np.nanstd(h["sigma_k"], axis=1)  # across heads (Figure 5's error bars)
            out["sigma_v_std"] = np.nanstd(h["sigma_v"], axis=1)
        out["sink_rate"] = out.pop("sink")
        out.setdefault("learned_sink", np.full(out["sink_rate"].shape, np.nan))  # (files written before it)
        out["ratio"] = out["sigma_v"] / out["sigma_k"]  # per-layer sigma_v / sigma_k (Figure 7)
        out["s1_ratio"] = out["s1_v"] / out["s1_k"]
        out["w_ratio"] = out["wv_norm"] / out["wk_norm"]
        return out

    def aggregate(self) -> dict[str, float]:
        """Model-level numbers of Tables 4, 5, 6 and 8 (ratios of means over layers and heads)."""
        h, pl = self.heads, self.per_layer()
        mean = {name: float(np.nanmean(a)) if np.isfinite(a).any() else float("nan") for name, a in h.items()}
        jac_layers = pl["jaccard"][np.isfinite(pl["jaccard"])]
        return {
            "sink_rate": mean["sink"], "sigma_k": mean["sigma_k"], "sigma_v": mean["sigma_v"],
            "ratio": mean["sigma_v"] / mean["sigma_k"], "bos_attn": mean["bos_attn"],
            "bos_cos": mean["bos_cos"], "w_ratio": mean["wv_norm"] / mean["wk_norm"],
            "s1_ratio": mean["s1_v"] / mean["s1_k"], "jaccard": mean["jaccard"],
            "jaccard_std": float(np.std(jac_layers)) if jac_layers.size else float("nan"),
            "ratio_std": float(np.nanstd(pl["ratio"])), "sink_rate_std": float(np.nanstd(pl["sink_rate"])),
            "learned_sink": mean.get("learned_sink", float("nan")),  # NaN: no learned sinks
        }

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN -> null)."""
        def clean(a):
            return [[None if not np.isfinite(x) else float(x) for x in row] for row in np.asarray(a)]

        return {"format": "vdjax-geometry/1", "model": self.model, "settings": self.settings,
                "prompts": self.prompts, "windows": self.windows, "layer_types": self.layer_types,
                "aggregate": {k: (None if not np.isfinite(v) else v) for k, v in self.aggregate().items()},
                "heads": {name: clean(a) for name, a in self.heads.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Geometry:
        """Inverse of `to_json`."""
        heads = {name: np.array([[np.nan if x is None else x for x in row] for row in rows], np.float64)
                 for name, rows in data["heads"].items()}
        return cls(data["model"], heads, list(data["windows"]), list(data["prompts"]), dict(data["settings"]),
                   data.get("layer_types"))


def analyze(params: Params, prompts: Sequence, *, model: str = "model", tau: float = TAU, topk: int = TOPK,
            n_queries: int = N_QUERIES, margin: int = MARGIN, jaccard_prompts: int = 8,
            progress: bool = False) -> Geometry:
    """Measure every statistic over `prompts` (CalibrationPrompt-like objects with .ids/.name/.category,
    or plain id lists); Jaccard on the first `jaccard_prompts` prompts long enough for it (0 = skip)."""
    from tqdm.auto import tqdm

    cfg = params.config
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    if not 0 < tau < 1:
        raise ValueError(f"tau must be in (0, 1), got {tau!r}")
    items = [p if hasattr(p, "ids") else _Plain(f"prompt-{i}", "given", tuple(p))
             for i, p in enumerate(prompts)]
    for p in items:
        if len(p.ids) < 2:
            raise ValueError(f"prompt {p.name!r} has {len(p.ids)} tokens; the statistics need at least 2")
    nl, kh, nq = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads
    sums = {f: np.zeros((nl, kh)) for f in HEAD_FIELDS[:5]} | {f: np.zeros((nl, nq)) for f in QHEAD_FIELDS}
    counts = {f: 0 for f in sums}
    jac_counts = np.zeros(nl)
    jac_done = 0
    bar = tqdm(total=len(items) * len(cfg.attention_layers), desc="analyze", unit="layer",
               disable=not progress)
    for p in items:
        want_jac = bool(topk) and jac_done < jaccard_prompts and len(p.ids) - 1 >= topk + margin
        for i, k, v, probs in capture(params, p.ids):
            st = layer_stats(k, v, probs, tau=tau, topk=topk if want_jac else None, n_queries=n_queries,
                             margin=margin)
            for name, val in st.items():
                sums[name][i] += val
            if want_jac:
                jac_counts[i] += 1
            bar.update(1)
        jac_done += want_jac
        for name in sums:
            if name != "jaccard":
                counts[name] += 1
    bar.close()
    heads = {name: sums[name] / counts[name] for name in sums if name != "jaccard"}
    heads["jaccard"] = np.where(jac_counts[:, None] > 0, sums["jaccard"] / np.maximum(jac_counts[:, None], 1),
                                np.nan)
    wk = np.full((nl, kh), np.nan)
    wv = np.full((nl, kh), np.nan)
    for i in cfg.attention_layers:
        wk[i], wv[i] = weight_norms(params.weights["layers"][i]["wk"], params.weights["layers"][i]["wv"])
    heads["wk_norm"], heads["wv_norm"] = wk, wv
    if not cfg.sinks:
        heads["learned_sink"][:] = np.nan  # no learned sink logit: the rows sum to one
    for i in set(range(nl)) - set(cfg.attention_layers):  # Gated DeltaNet layers: no keys, nothing measured
        for name in heads:
            heads[name][i] = np.nan
    return Geometry(
        model=model, heads=heads, windows=[cfg.window(i) for i in range(nl)],
        prompts=[{"name": p.name, "category": p.category, "tokens": len(p.ids)} for p in items],
        settings={"tau": tau, "topk": topk, "n_queries": n_queries, "margin": margin,
                  "jaccard_prompts": int(jac_done)},
        layer_types=list(cfg.layer_types),
    )


@dataclasses.dataclass(frozen=True)
class _Plain:
    name: str
    category: str
    ids: tuple[int, ...]


# ---- the paper's reference values (Tables 4, 5, 6, 8) ---------------------------------------------------
def mechanism(cfg) -> str:
    """The paper's sink-suppression mechanism of a config (Table 4's column): gated attention, learned sink,
    softcapping, QK-norm, or none."""
    if cfg.attn_gate:
        return "gated attention"
    if cfg.sinks:
        return "learned sink"
    if cfg.attn_softcap:
        return "softcapping"
    return "QK-norm" if cfg.qk_norm else "none"


# model: (mechanism, sink rate, sigma_k, sigma_v, sigma_v/sigma_k, bos_attn, bos_cos, w_ratio, s1_ratio,
# jaccard)
PAPER: dict[str, tuple] = {
    "Llama 3.1-8B": ("None", 0.801, 1.783, 0.583, 0.33, 0.591, -0.604, 0.192, 0.057, 0.347),
    "Llama 3.2-3B": ("None", 0.835, 1.478, 0.584, 0.40, 0.612, -0.586, 0.195, 0.071, 0.339),
    "Qwen2.5-3B": ("None", 0.446, 1.561, 1.851, 1.19, 0.317, -0.091, 0.668, 0.216, 0.338),
    "Qwen2.5-7B": ("None", 0.392, 1.597, 2.133, 1.34, 0.279, -0.337, 0.743, 0.194, 0.334),
    "Gemma2-2B": ("Softcapping", 0.464, 1.807, 1.590, 0.88, 0.333, -0.350, 0.550, 0.257, None),
    "Gemma2-9B": ("Softcapping", 0.542, 1.808, 1.808, 1.00, 0.396, -0.424, 0.632, 0.288, 0.347),
    "Qwen3-4B": ("QK-norm", 0.548, 2.322, 2.263, 0.97, 0.408, -0.182, 0.651, 0.320, 0.347),
    "Gemma3-4B": ("QK-norm", 0.271, 12.506, 8.377, 0.67, 0.199, -0.555, 0.497, 0.397, 0.398),
    "Qwen3.5-4B": ("Gated attn", 0.015, 1.596, 2.164, 1.36, 0.034, -0.115, 1.174, 1.358, 0.319),
    "Qwen3.5-9B": ("Gated attn", 0.012, 2.344, 3.488, 1.49, 0.031, -0.137, 1.134, 1.339, None),
    "GPT-OSS-20B": ("Learned sink", 0.029, 2.191, 3.652, 1.67, 0.030, -0.663, 1.120, 0.815, 0.477),
}
PAPER_COLUMNS = ("mechanism", "sink_rate", "sigma_k", "sigma_v", "ratio", "bos_attn", "bos_cos", "w_ratio",
                 "s1_ratio", "jaccard")

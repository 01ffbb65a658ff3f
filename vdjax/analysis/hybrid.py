"""Key/value hybrid eviction: a per layer (and KV head) mix w of standardised ValueDiff and KeyDiff.

The policy `hybrid` (its score and saved mixes: `vdjax.engine.mixes`) scores w * z(ValueDiff) + (1 - w) *
z(KeyDiff), z = per-head standardisation over the valid candidates; w = 1 is ValueDiff and w = 0 KeyDiff,
exactly. Its keyword `mix` is w per layer and KV head ([L][K]); this module makes it:

- `geometry_mix`: from measured geometry, the paper's two-axis picture (§4.4, Figure 2). KeyDiff leads only
  where the BOS key is a geometric outlier (bos_cos < 0) *and* keys are more dispersed than values
  (sigma_v / sigma_k < 1); everywhere else ValueDiff leads. With a = clip((r - r_lo) / (r_hi - r_lo), 0, 1)
  (value dominance, r = sigma_v / sigma_k) and b = clip(bos_cos / cos_lo, 0, 1) (anchor strength),

      w = 1 - (1 - a) * b

  so w = 1 when r >= r_hi or bos_cos >= 0, w = 0 when r <= r_lo and bos_cos <= cos_lo, linear in between
  (defaults r_lo = 0.5, r_hi = 1.0 (the paper's regime boundaries), cos_lo = -0.3).
- `fit`: fitted with optax to minimise the attention-output error of block eviction on calibration prompts.
  Each layer is simulated teacher-forced (the dense K/V of the prompt): blocks of B tokens, the cache cut to N
  after each block by the hybrid score; the error of block b's eviction is measured on the queries of block
  b + 1, which attend to the kept cache plus their own block: sum ||o_full - o_kept||^2 / sum ||o_full||^2.
  Hard top-N is relaxed for the gradient (the current block's keep decision becomes
  sigmoid((s - threshold) / temperature), temperature annealed; earlier blocks follow the hard decisions).
  The relaxed optimum is then compared with w = 0, w = 1 and the geometry mix by the exact hard error, and
  the best of them is kept, so a fitted layer is never worse on the calibration prompts than either endpoint.
- `select`: that per-layer objective is local (the next block's attention), and on RULER it did not track
  retrieval (Gemma3-270M at N=512: the per-layer fit kept 16.8 % of dense, both endpoints ~25 %). So the fit
  ends with an end-to-end check: each candidate mix (the per-layer fit, the geometry rule, ValueDiff, KeyDiff,
  an even 0.5 mix) runs the whole model with block eviction at the budget on retrieval probes (a key-value
  haystack, the question last), and the one with the lowest teacher-forced answer NLL is saved.

Mixes are saved as small JSON files next to the model (`<checkpoint>/vdjax-hybrid/{fitted,geometry}.json`, and
`fitted-N<budget>.json` for a mix selected at that budget); `generate(params, ids, policy="hybrid", budget=N)`
uses the mix fitted at N if there is one, else the fitted one, else the geometry one (the policy declares this
calibration: `Policy.calibration`, so `vdjax eval` runs it only where it exists). A mix selected at one budget
need not be best at another (Gemma3-270M: the selection at N=512 and at N=1024
differ), hence one per budget. """

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vdjax.engine.cache import keep_mask
from vdjax.engine.mixes import (  # noqa: F401
    FOLDER,
    FORMAT,
    METHODS,
    calibrated,
    check_mix,
    hybrid,
    load_mix,
    mix_path,
    mix_scores,
    resolve_mix,
    save_mix,
)
from vdjax.engine.scores import keydiff, standardize, valuediff
from vdjax.models import transformer as tf
from vdjax.models.params import Params


def geometry_rule(ratio, bos_cos, *, r_lo: float = 0.5, r_hi: float = 1.0,
                  cos_lo: float = -0.3) -> np.ndarray:
    """w = 1 - (1 - a) * b with a = clip((ratio - r_lo) / (r_hi - r_lo)), b =
    clip(bos_cos / cos_lo) (see module)."""
    if not (r_lo < r_hi and cos_lo < 0):
        raise ValueError(f"geometry_rule needs r_lo < r_hi and cos_lo < 0, got {r_lo}, {r_hi}, {cos_lo}")
    a = np.clip((np.asarray(ratio, np.float64) - r_lo) / (r_hi - r_lo), 0.0, 1.0)
    b = np.clip(np.asarray(bos_cos, np.float64) / cos_lo, 0.0, 1.0)
    return 1.0 - (1.0 - a) * b


def geometry_mix(geo, *, per_head: bool = False, **rule) -> np.ndarray:
    """The mix [L, K] from a `vdjax.analysis.geometry.Geometry` by `geometry_rule`, per layer (default) or per
    head; 1 on layers without attention (Gated DeltaNet: nothing measured there, the mix is never used)."""
    h = geo.heads
    if per_head:
        w = geometry_rule(h["sigma_v"] / h["sigma_k"], h["bos_cos"], **rule)
    else:
        pl = geo.per_layer()
        w = np.repeat(geometry_rule(pl["ratio"], pl["bos_cos"], **rule)[:, None], h["sigma_k"].shape[1],
                      axis=1)
    return np.where(np.isfinite(w), w, 1.0)


# ---- teacher-forced simulation of one layer -------------------------------------------------------------
def query_rows(t: int, block: int, per_block: int) -> np.ndarray:
    """Query positions [nb - 1, q] where errors are measured: `per_block` evenly
    spaced in each block b >= 1."""
    nb = t // block
    if nb < 2:
        raise ValueError(f"fitting needs prompts of at least 2 blocks: {t} tokens < 2 x block_size={block}")
    q = min(per_block, block)
    offsets = np.unique(np.round(np.linspace(0, block - 1, q)).astype(np.int64))
    return np.arange(1, nb)[:, None] * block + offsets[None, :]


def _candidates(m, b, block, t, window):
    """Candidate mask [P, K, T] at block b: tokens kept so far plus the block's, minus dead ones."""
    idx = jnp.arange(t)
    end = (b + 1) * block
    cand = (m | ((idx >= b * block) & (idx < end))) & (idx < end)
    if window is not None:
        cand &= (end - idx) < window
    return cand, end


def _errors(rows, v, a, end):
    """Error and energy [P, K] of the next block's queries: rows [P, K, G, q, T] over v [P, K, T, D] with
    earlier tokens (< end) weighted by a [P, K, T] and the block's own tokens fully present."""
    t = v.shape[2]
    present = jnp.where(jnp.arange(t) < end, a, 1.0)[:, :, None, None, :]  # [P, K, 1, 1, T]
    full = jnp.einsum("pkgqt,pktd->pkgqd", rows, v)
    w = rows * present
    kept = jnp.einsum("pkgqt,pktd->pkgqd", w, v) / jnp.maximum(jnp.sum(w, -1), 1e-30)[..., None]
    return jnp.sum((full - kept) ** 2, axis=(2, 3, 4)), jnp.sum(full ** 2, axis=(2, 3, 4))


def _scores(k, v, cand, w):
    """Hybrid scores [P, K, T] of the candidates (as the policy computes them) and their two parts."""
    pos = jnp.where(cand, jnp.arange(cand.shape[-1]), -1)
    vd, kd = valuediff(k, v, None, pos), keydiff(k, v, None, pos)
    return mix_scores(vd, kd, cand, w), vd, kd, pos


@functools.partial(jax.jit, static_argnames=("budget", "block", "window"))
def eviction_error(k, v, rows, w, *, budget: int, block: int, window: int | None = None):
    """Exact (hard top-N) attention-output error of block eviction of one layer, per prompt and KV head.

    k, v [P, K, T, D]; rows [P, K, G, nb - 1, q, T] the attention of the measured queries (`query_rows`);
    w [K] hybrid mix. Returns (error [P, K], energy [P, K]) summed over
    blocks, queries and query heads. """
    p, kh, t, _ = k.shape
    nb = rows.shape[3] + 1

    def step(m, b):
        cand, end = _candidates(m, b, block, t, window)
        s, _, _, pos = _scores(k, v, cand, w)
        keep = keep_mask(s, pos, budget)
        err, energy = _errors(rows[:, :, :, b], v, keep.astype(jnp.float32), end)
        return keep, (err, energy)

    _, (err, energy) = jax.lax.scan(step, jnp.zeros((p, kh, t), bool), jnp.arange(nb - 1))
    return jnp.sum(err, 0), jnp.sum(energy, 0)


@functools.partial(jax.jit, static_argnames=("budget", "block", "window"))
def kept_after(k, v, w, *, budget: int, block: int, window: int | None = None):
    """Keep mask [P, K, T] after block-evicting all T // block blocks of one layer's k, v [P, K, T, D]
    with hybrid mix w [K] (the same decisions `eviction_error` measures)."""
    p, kh, t, _ = k.shape

    def step(m, b):
        cand, _ = _candidates(m, b, block, t, window)
        s, _, _, pos = _scores(k, v, cand, w)
        return keep_mask(s, pos, budget), None

    m, _ = jax.lax.scan(step, jnp.zeros((p, kh, t), bool), jnp.arange(t // block))
    return m


def _soft_loss(theta, k, v, rows, temp, *, budget, block, window):
    """Relaxed error / energy of the whole layer for mix sigmoid(theta) (broadcast to [K])."""
    p, kh, t, _ = k.shape
    w = jnp.broadcast_to(jax.nn.sigmoid(theta), (kh,))
    nb = rows.shape[3] + 1

    def step(m, b):
        cand, end = _candidates(m, b, block, t, window)
        _, vd, kd, pos = _scores(k, v, cand, w)
        wv = w[None, :, None]
        # smooth in w at the endpoints too
        s = wv * standardize(vd, cand) + (1.0 - wv) * standardize(kd, cand)
        keep = keep_mask(jax.lax.stop_gradient(s), pos, budget)
        top = jax.lax.top_k(jnp.where(cand, jax.lax.stop_gradient(s), -jnp.inf), min(budget + 1, t))[0]
        evicts = jnp.sum(cand, -1, keepdims=True) > budget
        threshold = 0.5 * (top[..., budget - 1 : budget] + top[..., -1:]) if budget < t else top[..., -1:]
        soft = jnp.where(evicts, jax.nn.sigmoid((s - threshold) / temp), 1.0) * cand
        err, energy = _errors(rows[:, :, :, b], v, soft, end)
        return keep, (err, energy)

    _, (err, energy) = jax.lax.scan(step, jnp.zeros((p, kh, t), bool), jnp.arange(nb - 1))
    return jnp.sum(err) / jnp.maximum(jnp.sum(energy), 1e-30)


# one compiled program per (shapes, budget, block, window), shared by every layer and call
_loss_and_grad = jax.jit(jax.value_and_grad(_soft_loss), static_argnames=("budget", "block", "window"))


def fit_layer(k, v, rows, *, budget: int, block: int, window: int | None = None, per_head: bool = False,
              w0=None, steps: int = 60, lr: float = 0.1, temps: tuple[float, float] = (0.5, 0.05)):
    """Fit one layer's mix [K] with optax (Adam on the relaxed error), then keep the best of {fitted, w0,
    0, 1} by exact error (per head when per_head, else for the whole layer). Returns (w [K], errors dict)."""
    import optax

    kh = k.shape[1]
    w0 = np.full(kh, 0.5) if w0 is None else np.broadcast_to(np.asarray(w0, np.float64), (kh,))
    start = np.log(np.clip(w0, 0.05, 0.95) / (1 - np.clip(w0, 0.05, 0.95)))
    theta = jnp.asarray(start if per_head else start.mean(keepdims=True), jnp.float32)
    opt = optax.adam(lr)
    state = opt.init(theta)
    kw = dict(budget=budget, block=block, window=window)
    for i in range(steps):
        temp = temps[0] * (temps[1] / temps[0]) ** (i / max(steps - 1, 1))
        _, g = _loss_and_grad(theta, k, v, rows, jnp.float32(temp), **kw)
        updates, state = opt.update(g, state)
        theta = optax.apply_updates(theta, updates)
    fitted = np.broadcast_to(np.asarray(jax.nn.sigmoid(theta), np.float64), (kh,))
    candidates = {"fitted": fitted, "geometry": w0, "keydiff": np.zeros(kh), "valuediff": np.ones(kh)}
    errs = {}
    for name, w in candidates.items():
        e, energy = eviction_error(k, v, rows, jnp.asarray(w, jnp.float32), **kw)
        errs[name] = np.asarray(jnp.sum(e, 0) / jnp.maximum(jnp.sum(energy, 0), 1e-30), np.float64)  # [K]
    names = list(candidates)
    table = np.stack([errs[n] for n in names])  # [4, K]
    if per_head:
        best = np.argmin(table, axis=0)
        w = np.array([candidates[names[b]][h] for h, b in enumerate(best)])
        chosen = [names[b] for b in best]
    else:
        b = int(np.argmin(table.sum(axis=1)))
        w, chosen = candidates[names[b]].copy(), [names[b]] * kh
    return w, {"relative_error": {n: errs[n].tolist() for n in names}, "chosen": chosen,
               "relaxed": fitted.tolist()}


# ---- capture and fit over a model -----------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg", "window"))
def _layer(lw, x, pos, inv_freq, where, *, cfg, window):
    """One dense layer on x [P, T, H] -> (x, k [P, K, T, D], v, rows [P, K, G, nb-1, q, T] at `where`)."""
    t = x.shape[1]
    x, k, v, probs = tf.dense_layer(lw, x, pos, cfg, inv_freq, window)
    rows = probs[:, :, :, where.reshape(-1), :]  # [P, K, G, R, T]
    rows = rows.reshape(rows.shape[:3] + where.shape + (t,))
    return x, k.astype(jnp.float32), v.astype(jnp.float32), rows


_linear_layer = jax.jit(tf.dense_linear_layer, static_argnames=("cfg",))


def layer_data(params: Params, ids, block: int, per_block: int) -> Iterator[tuple]:
    """Dense pass of prompts ids [P, T] (T a multiple of `block`); yields (layer, window, k, v,
    rows) of every attention layer."""
    cfg = params.config
    ids = jnp.asarray(np.asarray(ids, np.int32))
    p, t = ids.shape
    where = jnp.asarray(query_rows(t, block, per_block))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
    x = tf.embed(params, ids)
    for i, lw in enumerate(params.weights["layers"]):
        if not cfg.attends(i):  # Gated DeltaNet: no cache to evict, nothing to fit; its mix stays unused
            x = _linear_layer(lw, x, pos, cfg=cfg)
            continue
        inv_freq, window = tf.layer_settings(cfg, i)
        x, k, v, rows = _layer(lw, x, pos, jnp.asarray(inv_freq), where, cfg=cfg, window=window)
        yield i, window, k, v, rows


def trim(prompts: Sequence[Sequence[int]], block: int) -> np.ndarray:
    """Prompts cut to one common length, a multiple of `block` -> [P, T]."""
    t = min(len(p) for p in prompts) // block * block
    if t < 2 * block:
        raise ValueError(f"fitting needs prompts of at least 2 x block_size={block} tokens, shortest has "
                         f"{min(len(p) for p in prompts)}")
    return np.asarray([list(p)[:t] for p in prompts], np.int32)


def fit(params: Params, prompts: Sequence[Sequence[int]], *, budget: int, block: int = 128,
        per_head: bool = False, w0=None, steps: int = 60, per_block: int = 16, progress: bool = False):
    """Fit [L, K] hybrid mix on calibration prompts (id lists); returns (mix, info per layer)."""
    from tqdm.auto import tqdm

    cfg = params.config
    ids = trim(prompts, block)
    w0 = np.full((cfg.num_layers, cfg.num_kv_heads), 0.5) if w0 is None else np.asarray(w0, np.float64)
    mix, info = np.ones((cfg.num_layers, cfg.num_kv_heads)), []  # 1 where nothing attends (unused)
    for i, window, k, v, rows in tqdm(layer_data(params, ids, block, per_block),
                                      total=len(cfg.attention_layers), desc="fit hybrid", unit="layer",
                                      disable=not progress):
        mix[i], layer_info = fit_layer(k, v, rows, budget=budget, block=block, window=window,
                                       per_head=per_head, w0=w0[i], steps=steps)
        info.append(layer_info)
    return mix, info


def held_out_error(params: Params, prompts: Sequence[Sequence[int]], mixes: dict[str, Any], *, budget: int,
             block: int = 128, per_block: int = 16) -> dict[str, np.ndarray]:
    """Exact relative attention-output error [L] of each named mix ([L, K] arrays) on `prompts`."""
    cfg = params.config
    ids = trim(prompts, block)
    out = {name: np.full(cfg.num_layers, np.nan) for name in mixes}  # NaN: a layer without attention
    for i, window, k, v, rows in layer_data(params, ids, block, per_block):
        for name, w in mixes.items():
            e, energy = eviction_error(k, v, rows, jnp.asarray(np.asarray(w)[i], jnp.float32), budget=budget,
                                       block=block, window=window)
            out[name][i] = float(jnp.sum(e) / jnp.maximum(jnp.sum(energy), 1e-30))
    return out


def candidate_mixes(fitted, geometry) -> dict[str, np.ndarray]:
    """The mixes [L, K] `select` compares: the per-layer fit, the geometry rule,
    both endpoints and an even mix."""
    w = np.asarray(fitted, np.float64)
    return {"fitted": w, "geometry": np.asarray(geometry, np.float64), "valuediff": np.ones_like(w),
            "keydiff": np.zeros_like(w), "even": np.full_like(w, 0.5)}


def select(params: Params, probes, candidates: dict[str, Any], *, budget: int, block: int = 128,
           layer_scan: bool = True, reference: bool = True) -> tuple[str, dict[str, float]]:
    """The candidate mix [L, K] whose block eviction at `budget` gives the lowest answer NLL (nats per answer
    token, mean over `calibration.Probe`s, teacher-forced with decode's per-token eviction) -> (name, {name:
    NLL}); with `reference` the dense NLL is reported as "dense" (never selected)."""
    from vdjax.engine.api import continuation_logprobs

    if not candidates:
        raise ValueError("select needs at least one candidate mix")
    groups: dict[int, list] = {}
    for p in probes:  # rows of one call share the answer length
        groups.setdefault(len(p.answer), []).append(p)
    if not groups:
        raise ValueError("select needs at least one probe")
    runs = {name: ("hybrid", {"mix": np.asarray(w).tolist()}) for name, w in candidates.items()}
    if reference:
        runs["dense"] = ("dense", {})
    nll = {}
    for name, (policy, kw) in runs.items():
        total, count = 0.0, 0
        for group in groups.values():
            lp = continuation_logprobs(params, [list(p.ids) for p in group], [list(p.answer) for p in group],
                                       policy, None if policy == "dense" else budget, block,
                                       layer_scan=layer_scan, **kw)
            total, count = total - float(lp.sum()), count + lp.size
        nll[name] = total / count
    best = min(candidates, key=lambda n: nll[n])
    return best, nll


def describe(mix) -> str:
    """A one-line summary of mix [L, K]: mean and how many layers lean to values / keys."""
    w = np.asarray(mix)
    lw = w.mean(axis=1)
    return (f"mean w {w.mean():.2f}; layers mostly ValueDiff (w > 0.5): {int((lw > 0.5).sum())}/{len(lw)}, "
            f"pure ValueDiff {int((lw == 1).sum())}, pure KeyDiff {int((lw == 0).sum())}")

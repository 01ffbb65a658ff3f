"""The hybrid policy's score and its saved mixes: w * z(ValueDiff) + (1 - w) *
z(KeyDiff) per layer and KV head.

z = per-head standardisation over the valid candidates; w = 1 is ValueDiff and w = 0 KeyDiff, exactly. The
keyword `mix` is w per layer and KV head ([L][K]). Mixes are small JSON files next to the model
(`<checkpoint>/vdjax-hybrid/{fitted,geometry}.json`, and `fitted-N<budget>.json` for a mix selected at that
budget); `mix=None` uses the mix for the run's budget if there is one, else the fitted one, else the geometry
one. How mixes are made (the geometry rule, the fit, the end-to-end
selection): `vdjax.analysis.hybrid`. """

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vdjax.checks import check_int
from vdjax.engine.scores import keydiff, standardize, valid_mask, valuediff
from vdjax.models.params import Params

FORMAT = "vdjax-hybrid/1"
FOLDER = "vdjax-hybrid"
METHODS = ("fitted", "geometry")


# ---- the score -----------------------------------------------------------------------------------------
def mix_scores(vd: jax.Array, kd: jax.Array, valid: jax.Array, w) -> jax.Array:
    """w * z(vd) + (1 - w) * z(kd) per head (w [K] or scalar); exactly vd where w == 1 and kd where w == 0."""
    w = jnp.asarray(w, jnp.float32).reshape(-1)[None, :, None]  # [1, K or 1, 1]
    mixed = w * standardize(vd, valid) + (1.0 - w) * standardize(kd, valid)
    return jnp.where(w == 1.0, vd, jnp.where(w == 0.0, kd, mixed))


def hybrid(k, v, attn, pos, *, mix=None, **_):
    """Hybrid: w * z(ValueDiff) + (1 - w) * z(KeyDiff), w per layer and KV head (mix [L][K] in [0, 1])."""
    if mix is None:
        raise ValueError("policy 'hybrid' needs its mix: pass mix=[...] or load a model with saved mixes "
                         "(`vdjax analyze --model M --fit`)")
    vd, kd = valuediff(k, v, attn, pos), keydiff(k, v, attn, pos)
    if not isinstance(attn.layer, int):  # inside the layer scan: this layer's row, picked on the device
        return mix_scores(vd, kd, valid_mask(pos), jnp.asarray(mix, jnp.float32)[attn.layer])
    w = mix[attn.layer]  # [K] static floats
    if all(x == 1.0 for x in w):
        return vd
    if all(x == 0.0 for x in w):
        return kd
    return mix_scores(vd, kd, valid_mask(pos), w)


def bind_mix(params, hyper, budget=None):
    """Resolve hybrid's `mix` keyword (None, "fitted", "geometry", a JSON path, numbers) against the
    model and the run's budget."""
    hyper = dict(hyper)
    hyper["mix"] = resolve_mix(params, hyper.get("mix"), budget)
    return tuple(sorted(hyper.items()))


def calibrated(folder) -> bool:
    """Whether a checkpoint folder holds saved mixes (`vdjax analyze --model M [--fit]`)."""
    return folder is not None and any(any((Path(folder) / FOLDER).glob(f"{m}*.json")) for m in METHODS)


# ---- mixes: checking, saving, loading -----------------------------------------------------------------
def check_mix(mix: Any, num_layers: int, num_kv_heads: int) -> tuple[tuple[float, ...], ...]:
    """Weights as a [L][K] tuple of floats in [0, 1] from a number, [L] or [L][K]; ValueError otherwise."""
    arr = np.asarray(mix, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full((num_layers, num_kv_heads), float(arr))
    elif arr.ndim == 1 and arr.shape[0] == num_layers:
        arr = np.repeat(arr[:, None], num_kv_heads, axis=1)
    if arr.shape != (num_layers, num_kv_heads):
        raise ValueError(f"hybrid mix must be a number, [num_layers={num_layers}] or "
                         f"[num_layers={num_layers}][num_kv_heads={num_kv_heads}], got shape {np.shape(mix)}")
    if not np.all((arr >= 0) & (arr <= 1)):
        raise ValueError(f"hybrid mix must lie in [0, 1] (1 = ValueDiff, 0 = KeyDiff), got min {arr.min()} "
                         f"max {arr.max()}")
    return tuple(tuple(float(x) for x in row) for row in arr)


def save_mix(path: str | os.PathLike, mix, *, method: str, model: str, info: dict | None = None) -> Path:
    """Write a mix [L][K] with its provenance to a JSON file; returns the path."""
    w = np.asarray(mix, np.float64)
    data = {"format": FORMAT, "method": method, "model": model, "num_layers": int(w.shape[0]),
            "num_kv_heads": int(w.shape[1]), "weights": w.tolist(), **(info or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


def load_mix(path: str | os.PathLike) -> dict[str, Any]:
    """Read a mix JSON file written by `save_mix` (ValueError if it is not one)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"hybrid mix file {str(path)!r} does not exist")
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a vdjax hybrid mix file (format {FORMAT!r})")
    return data


def mix_path(params: Params, method: str, budget: int | None = None) -> Path | None:
    """Where the `method` mix of this model lives, the one for `budget` when given (None when params
    were not loaded from a folder)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    name = method if budget is None else f"{method}-N{check_int('budget', budget)}"
    return None if params.source is None else Path(params.source) / FOLDER / f"{name}.json"


def resolve_mix(params: Params, mix: Any, budget: int | None = None) -> tuple[tuple[float, ...], ...]:
    """The [L][K] mix meant by `mix`: None (the model's fitted, else geometry file), "fitted",
    "geometry", a path to a mix JSON file, or numbers (one, [L] or [L][K]). A saved mix is the one for
    `budget` (`mix_path(..., budget)`) where it exists, else the method's own file."""
    cfg = params.config
    if mix is None or (isinstance(mix, str) and mix in METHODS):
        methods = METHODS if mix is None else (mix,)
        for method in methods:
            for b in ((budget, None) if budget is not None else (None,)):
                path = mix_path(params, method, b)
                if path is not None and path.is_file():
                    return resolve_mix(params, str(path))
        where = "its checkpoint folder" if params.source is None else f"{params.source}/{FOLDER}/"
        raise ValueError(f"policy 'hybrid' found no {'/'.join(methods)} mix in {where}: run "
                         f"`vdjax analyze --model M [--fit]` first, or pass mix= a number, [L], [L][K] or a "
                         "mix JSON path")
    if isinstance(mix, (str, os.PathLike)):
        data = load_mix(mix)
        if (data["num_layers"], data["num_kv_heads"]) != (cfg.num_layers, cfg.num_kv_heads):
            raise ValueError(f"hybrid mix {str(mix)!r} is for {data['num_layers']} layers x "
                             f"{data['num_kv_heads']} KV heads; this model has {cfg.num_layers} x "
                             f"{cfg.num_kv_heads}")
        mix = data["weights"]
    return check_mix(mix, cfg.num_layers, cfg.num_kv_heads)

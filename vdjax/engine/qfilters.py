"""Q-Filters (arXiv 2503.02812; kvpress `QFilterPress`): score `-<f_h, k>` with the cached (post-RoPE) keys
and one filter f_h per layer and KV head.

kvpress downloads the filters from the Hub; here they are computed from calibration prompts by
`vdjax analyze --model M --qfilters` (`vdjax.analysis.qfilters`) and saved beside the checkpoint
(`<checkpoint>/vdjax-qfilters/qfilters.json`), as the hybrid's mixes are. `policy="qfilter"` finds them there
(keyword `filters=None`), or takes `filters=` as an [L][K][D] nested list or a JSON path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from vdjax.models.params import Params

FORMAT = "vdjax-qfilters/1"
FOLDER = "vdjax-qfilters"
FILE = "qfilters.json"


def qfilter(k, v, attn, pos, *, filters=None, **_):
    """Q-Filters: -<f_h, k_j> with the layer's filter of the candidate's KV head (filters [L][K][D])."""
    if filters is None:
        raise ValueError("policy 'qfilter' needs Q-filters: run `vdjax analyze --model M --qfilters` (saves "
                         f"them in the checkpoint's {FOLDER}/) or pass filters=[L][K][D]")
    f = jnp.asarray(filters, jnp.float32)[attn.layer]  # [K, D] (a traced layer index inside the layer scan)
    return -jnp.einsum("bkcd,kd->bkc", k.astype(jnp.float32), f)


def qfilter_path(folder) -> Path:
    """Where a checkpoint folder's Q-filters live."""
    return Path(folder) / FOLDER / FILE


def has_qfilters(folder) -> bool:
    """Whether the checkpoint folder has saved Q-filters."""
    return folder is not None and qfilter_path(folder).is_file()


def check_filters(filters: Any, num_layers: int, num_kv_heads: int, head_dim: int) -> tuple:
    """Filters as a hashable [L][K][D] tuple of floats, or a ValueError naming the expected shape."""
    arr = np.asarray(filters, np.float64)
    if arr.shape != (num_layers, num_kv_heads, head_dim) or not np.isfinite(arr).all():
        raise ValueError(f"filters must be finite numbers of shape [layers={num_layers}][kv_heads="
                         f"{num_kv_heads}][head_dim={head_dim}], got shape {arr.shape}")
    return tuple(tuple(tuple(float(x) for x in head) for head in layer) for layer in arr)


def save_qfilters(folder, filters, *, model: str, info: dict | None = None) -> Path:
    """Write filters [L, K, D] (with what made them) to the checkpoint folder's Q-filter file."""
    path = qfilter_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "model": model, "filters": np.asarray(filters, np.float64).tolist(),
            **(info or {})}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return path


def load_qfilters(path) -> dict[str, Any]:
    """The saved Q-filter file as a dict (format checked)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a vdjax Q-filter file (format {data.get('format')!r}, want "
                         f"{FORMAT!r})")
    return data


def bind_qfilters(params: Params, hyper, budget=None):
    """Resolve the `filters` keyword: None -> the model's saved filters (a clear error when it has none), a
    JSON path, or [L][K][D] numbers; checked against the model's shape."""
    hyper = dict(hyper)
    filters = hyper.get("filters")
    cfg = params.config
    if filters is None:
        if not has_qfilters(params.source):
            where = "its checkpoint folder" if params.source is None else f"{params.source}/{FOLDER}/"
            raise ValueError(f"policy 'qfilter': this model has no Q-filters in {where}; run `vdjax analyze "
                             "--model M --qfilters` first, or pass filters=[L][K][D]")
        filters = load_qfilters(qfilter_path(params.source))["filters"]
    elif isinstance(filters, (str, os.PathLike)):
        filters = load_qfilters(filters)["filters"]
    hyper["filters"] = check_filters(filters, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    return tuple(sorted(hyper.items()))

"""Save/load converted Params with orbax: arrays in `<path>/weights`, config in `<path>/model_config.json`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from vdjax.models.config import ModelConfig
from vdjax.models.params import Params

CONFIG_FILE = "model_config.json"
WEIGHTS_DIR = "weights"
FORMAT = 1


def _tuples(value: Any) -> Any:
    """JSON lists -> tuples (ModelConfig keeps tuples so it stays hashable)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def config_to_json(cfg: ModelConfig) -> str:
    """ModelConfig as a JSON document."""
    return json.dumps({"format": FORMAT, "config": dataclasses.asdict(cfg)}, indent=2)


def config_from_json(text: str) -> ModelConfig:
    """Inverse of config_to_json."""
    doc = json.loads(text)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{CONFIG_FILE} format={doc.get('format')!r}; this vdjax reads format {FORMAT}")
    return ModelConfig(**{k: _tuples(v) for k, v in doc["config"].items()})


def save_params(params: Params, path: str | Path) -> Path:
    """Write params to a new folder `path` (orbax arrays + config JSON); refuses an existing folder."""
    path = Path(path).absolute()
    if path.exists():
        raise ValueError(f"path={str(path)!r} already exists; choose a new folder")
    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text(config_to_json(params.config))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / WEIGHTS_DIR, params.weights)
    return path


def load_params(path: str | Path) -> Params:
    """Read params written by save_params (dtypes and shapes as saved)."""
    path = Path(path).absolute()
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_DIR).is_dir():
        raise ValueError(
            f"path={str(path)!r} is not a vdjax params checkpoint (no {CONFIG_FILE} / {WEIGHTS_DIR}/)"
        )
    cfg = config_from_json((path / CONFIG_FILE).read_text())
    with ocp.StandardCheckpointer() as checkpointer:
        meta = checkpointer.metadata(path / WEIGHTS_DIR)
        tree = getattr(meta, "item_metadata", meta)  # orbax >= 0.11 wraps the tree metadata
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
        weights = dict(checkpointer.restore(path / WEIGHTS_DIR, abstract))
    layers = weights.get("layers", ())
    if isinstance(layers, dict):  # a tuple may come back keyed by index
        layers = [layers[k] for k in sorted(layers, key=int)]
    weights["layers"] = tuple(dict(layer) for layer in layers)
    return Params(weights=weights, config=cfg)

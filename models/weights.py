"""What follows from the family declarations: a config's expected weights, HF key rows, abstract shapes,
random init and mesh split axes (the declarations themselves: `spec.py`, `families.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vdjax.models.families import FAMILIES
from vdjax.models.params import Params
from vdjax.models.spec import HEAD_AXES, SPLIT_AXES, Family, Layout, Weight, dims


def family_of(cfg) -> Family:
    """The Family of a config."""
    if cfg.family not in FAMILIES:
        raise ValueError(f"config family {cfg.family!r} has no spec; known: {sorted(FAMILIES)}")
    return FAMILIES[cfg.family]


def present(cfg, weight: Weight, layer: int | None) -> bool:
    """Whether `cfg` has `weight` (at `layer`): lm_head only with untied embeddings, then `weight.when`."""
    if weight.name == "lm_head" and cfg.tie_embeddings:
        return False
    return bool(weight.when(cfg, layer))


def expected(cfg) -> dict[tuple[str, int | None], tuple[int, ...]]:
    """{(weight name, layer or None): shape} of every array the config has."""
    out = {}
    for w in family_of(cfg).weights:
        for layer in (range(cfg.num_layers) if w.layer else [None]):
            if present(cfg, w, layer):
                out[w.name, layer] = w.shape(cfg)
    return out


def hf_key(weight: Weight, layout: Layout) -> str:
    """The HF key pattern of a weight in a layout (`{i}` = the layer)."""
    if weight.hf.startswith("^"):
        return layout.head + weight.hf[1:]
    return layout.prefix + ("layers.{i}." if weight.layer else "") + weight.hf


def hf_rows(cfg, layout: Layout) -> tuple[dict[str, Weight], tuple[str, ...]]:
    """(HF key pattern -> Weight of the family, key patterns skipped on purpose) in `layout`."""
    fam = family_of(cfg)
    rows = {hf_key(w, layout): w for w in fam.weights}
    skipped = tuple(layout.prefix + k for k in fam.ignored) + layout.ignored
    return rows, skipped


def abstract(cfg, dtype=np.float32) -> dict[str, Any]:
    """The weights pytree of `cfg` as `jax.ShapeDtypeStruct`s: {"embed": ..., "layers": ({...}, ...)}."""
    import jax

    tree: dict[str, Any] = {"layers": tuple({} for _ in range(cfg.num_layers))}
    for (name, layer), shape in expected(cfg).items():
        leaf = jax.ShapeDtypeStruct(shape, dtype)
        if layer is None:
            tree[name] = leaf
        else:
            tree["layers"][layer][name] = leaf
    return tree


def _draw(cfg, w: Weight, normal: Callable, scale: float):
    """One weight's random values (see `Weight.init`); `normal(shape)` gives N(0, 1) fp32 noise (NumPy on the
    host or jax on the device: the arithmetic is the same)."""
    shape = w.shape(cfg)
    if w.init in ("zeros", "ones"):
        return np.full(shape, 1.0 if w.init == "ones" else 0.0, np.float32)
    noise = normal(shape) * scale
    if w.init == "embed":
        return noise * 3
    if w.init in ("norm", "gain"):
        return (1.0 - (cfg.norm_offset if w.init == "norm" else 0.0)) + noise * 0.3
    return noise


_NORMAL = None


def _device_normal(key):
    """N(0, 1) noise drawn on the device by one jitted sampler (a program per distinct shape)."""
    import jax

    global _NORMAL
    if _NORMAL is None:
        _NORMAL = jax.jit(lambda k, s: jax.random.normal(k, s), static_argnums=1)
    return lambda shape: _NORMAL(key, shape)


def init_params(cfg, seed: int = 0, *, scale: float = 0.3, dtype=np.float32, on_device: bool = False,
                source: str | None = None):
    """Random Params of `cfg`: every declared weight, weight i drawn from `np.random.default_rng((seed, i))`
    (a weight's values do not depend on the others), cast to `dtype` and put on the default device.

    `on_device=True` draws on the device instead (jax.random from key(seed), fold_in(i)): for models too large
    to draw on the host quickly (benchmarks); other values than the host draw.
    """
    import jax
    import jax.numpy as jnp

    tree = abstract(cfg)
    fam = family_of(cfg)
    for i, (name, layer) in enumerate(expected(cfg)):
        if on_device:
            normal = _device_normal(jax.random.fold_in(jax.random.key(seed), i))
        else:
            rng = np.random.default_rng((seed, i))
            normal = lambda shape, rng=rng: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
        value = jnp.asarray(_draw(cfg, fam.weight(name), normal, np.float32(scale)), dtype)
        (tree if layer is None else tree["layers"][layer])[name] = value
    return Params(weights=tree, config=cfg, source=source)


def split_axis(cfg, name: str, model_size: int) -> int | None:
    """The axis of weight `name` that splits over a "model" mesh axis of `model_size`, or None (replicated).

    Head axes split when the KV heads divide by it (the query heads then follow), other splittable axes
    (mlp, experts, ...) when their own size divides.
    """
    w = family_of(cfg).weight(name)
    sizes = dims(cfg)
    for axis, d in enumerate(w.dims):
        if d in HEAD_AXES and sizes["kv_heads"] % model_size == 0:
            return axis
        if d in SPLIT_AXES and sizes[d] % model_size == 0:
            return axis
    return None

"""Multi-device inference: a ("data", "model") device mesh and how params, KV cache and batch split on it.

    mesh = vdjax.sharding.make_mesh(data=2, model=4)          # 8 devices
    params = vdjax.sharding.shard_params(params, mesh)        # once (else every call copies the weights)
    out = vdjax.generate(params, ids, policy="valuediff", budget=256, mesh=mesh)

- "data": the batch. Rows are independent (each evicts on its own), so the pipeline pads the batch with dummy
  rows to a multiple of the axis size and drops them from the outputs.
- "model": attention heads and the MLP width. Per-head projections (wq [H, Nq, D], wk/wv [H, K, D],
  wo [Nq, D, H], biases bq [Nq, D], bk/bv [K, D]) and the KV cache (k/v [B, K, N, D], pos/acc [B, K, N]) are
  split over heads; the MLP over F (w_gate/w_up [H, F], w_down [F, H]). Embeddings, LM head, every norm
  (q/k norms are per head_dim) and the output bias are replicated.
- A dimension that does not divide by its axis size is replicated instead of split: attention is split
  only when the KV heads K divide by the "model" size (the query heads, Nq = K·G, then follow), e.g.
  SmolLM2-135M (K = 3) keeps attention and cache replicated on a 2- or 4-way model axis; its MLP (F = 1536)
  still splits.

XLA (GSPMD) inserts the collectives; the math is the single-device math, up to the summation order of the
contractions split over "model" (wo over heads, w_down over F), whose partial sums are added across devices.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from vdjax.checks import check_int

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# layer weight name -> its head dimension (split when K divides by "model") / its F dimension (when F does)
_HEAD_DIM = {"wq": 1, "wk": 1, "wv": 1, "wo": 0, "bq": 0, "bk": 0, "bv": 0}
_MLP_DIM = {"w_gate": 1, "w_up": 1, "w_down": 0}


def make_mesh(data: int | None = None, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh of shape (data, model), axes ("data", "model"), over the first data·model devices.

    data=None takes every device left over by model; data·model must divide the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if n == 0:
        raise ValueError("devices must hold at least one device")
    model = check_int("model", model)
    if n % model:
        raise ValueError(f"model={model} does not divide the device count {n}")
    data = n // model if data is None else check_int("data", data, optional=True)
    if data * model > n or n % (data * model):
        raise ValueError(f"data={data} x model={model} = {data * model} devices does not divide the device "
                         f"count {n}")
    grid = np.asarray(devices[: data * model], dtype=object).reshape(int(data), int(model))
    return Mesh(grid, AXES)


def check_mesh(mesh: Any) -> Mesh:
    """The mesh itself if it is a jax Mesh whose axes are exactly "data" and "model", else a ValueError."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see vdjax.sharding.make_mesh), got "
                        f"{type(mesh).__name__}")
    if sorted(mesh.axis_names) != sorted(AXES):
        raise ValueError(f"mesh must have exactly the axes {AXES}, got {tuple(mesh.axis_names)}")
    return mesh


def _split(mesh: Mesh, axis: str, size: int) -> str | None:
    """`axis` when a dimension of `size` divides by that mesh axis (it can be split there), else None."""
    return axis if size % mesh.shape[axis] == 0 else None


def heads_split(config, mesh: Mesh) -> bool:
    """Whether attention (weights and cache) is split over "model": the KV heads divide by its size."""
    return _split(check_mesh(mesh), MODEL, config.num_kv_heads) is not None


def _weight_spec(name: str, shape: tuple[int, ...], config, mesh: Mesh) -> P:
    """PartitionSpec of one weight (by its name in a layer dict) on the mesh."""
    spec = [None] * len(shape)
    if name in _HEAD_DIM and heads_split(config, mesh):
        spec[_HEAD_DIM[name]] = MODEL
    elif name in _MLP_DIM:
        spec[_MLP_DIM[name]] = _split(mesh, MODEL, shape[_MLP_DIM[name]])
    while spec and spec[-1] is None:  # P() when replicated; P(None, "model") for P(None, "model", None)
        spec.pop()
    return P(*spec)


def param_shardings(params, mesh: Mesh):
    """A pytree like `params` (a Params) holding the NamedSharding of every weight (see the module docstring).

    Heads are split over "model" only when num_kv_heads divides by its size, else attention is replicated
    (e.g. SmolLM2-135M's 3 KV heads on 2 or 4 devices); likewise the MLP width F.
    """
    check_mesh(mesh)
    cfg = params.config

    def one(path, leaf):
        key = path[-1].key if hasattr(path[-1], "key") else None  # the name inside a layer dict
        return NamedSharding(mesh, _weight_spec(key, leaf.shape, cfg, mesh))

    return jax.tree_util.tree_map_with_path(one, params)


def shard_params(params, mesh: Mesh):
    """Params placed on the mesh by `param_shardings` (weights already placed so are returned as they are)."""
    shardings = param_shardings(params, mesh)
    leaves = jax.tree.leaves(params)
    if all(getattr(x, "sharding", None) == s for x, s in zip(leaves, jax.tree.leaves(shardings))):
        return params
    return jax.device_put(params, shardings)


def cache_sharding(cache, mesh: Mesh):
    """A pytree like `cache` (a KVCache) of NamedShardings: rows over "data", KV heads over "model".

    k/v [B, K, N, D] -> P("data", "model"), pos/acc [B, K, N] -> P("data", "model"); an axis whose size does
    not divide (B by "data", K by "model") is replicated. Works on arrays and on tracers inside jit.
    """
    check_mesh(mesh)

    def one(x):
        spec = [_split(mesh, DATA, x.shape[0]), _split(mesh, MODEL, x.shape[1])]
        while spec and spec[-1] is None:
            spec.pop()
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(one, cache)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """NamedSharding of per-row arrays [B, ...] (tokens, lengths): rows over "data", the rest replicated."""
    return NamedSharding(check_mesh(mesh), P(DATA))


def constrain_cache(cache, mesh: Mesh | None):
    """Inside jit: pin the cache to `cache_sharding` (a no-op without a mesh)."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_sharding(cache, mesh))

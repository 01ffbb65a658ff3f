"""Multi-device inference: a ("data", "model") device mesh and how params, KV cache and batch split on it.

    mesh = vdjax.engine.sharding.make_mesh(data=2, model=4)          # 8 devices
    params = vdjax.engine.sharding.shard_params(params, mesh)        # once (else every call copies the
    weights) out = vdjax.generate(params, ids, policy="valuediff", budget=256, mesh=mesh)

- "data": the batch. Rows are independent (each evicts on its own), so the pipeline pads the batch with dummy
  rows to a multiple of the axis size and drops them from the outputs.
- "model": attention heads and the MLP width. Which axis of a weight splits is derived from its declaration in
  the family spec (`models/families.py`, `weights.split_axis`): the head axis of wq/wk/wv/wo and the q/k/v
  biases, the F axis of the MLP; embeddings, LM head, every norm and the output bias have neither and are
  replicated. The KV cache (k/v [B, K, N, D], pos/acc [B, K, N]) splits over its KV heads.
- A dimension that does not divide by its axis size is replicated instead of split: attention is split
  only when the KV heads K divide by the "model" size (the query heads, Nq = K·G, then follow), e.g.
  SmolLM2-135M (K = 3) keeps attention and cache replicated on a 2- or 4-way model axis;
  its MLP (F = 1536) still splits.

XLA (GSPMD) inserts the collectives; the math is the single-device math, up to the summation order of the
contractions split over "model" (wo over heads, w_down over F), whose partial
sums are added across devices. """

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from vdjax.checks import check_int
from vdjax.models.weights import split_axis

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


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


def spans_processes(mesh: Mesh) -> bool:
    """Whether the mesh holds devices of other processes (`jax.distributed`): its arrays are then global."""
    return jax.process_count() > 1 and len({d.process_index for d in mesh.devices.flat}) > 1


def check_mesh(mesh: Any) -> Mesh:
    """The mesh itself if it is a jax Mesh whose axes are exactly "data" and "model", else a ValueError."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see vdjax.engine.sharding.make_mesh), got "
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
    """PartitionSpec of one weight (by its name in the family spec) on the mesh: the axis `weights.split_axis`
    names goes over "model", everything else is replicated."""
    axis = split_axis(config, name, mesh.shape[MODEL])
    return P() if axis is None else P(*([None] * axis + [MODEL]))


def param_shardings(params, mesh: Mesh):
    """A pytree like `params` (a Params) holding the NamedSharding of every weight (see the module docstring).

    Heads are split over "model" only when num_kv_heads divides by its size, else attention is replicated
    (e.g. SmolLM2-135M's 3 KV heads on 2 or 4 devices); likewise the MLP width F.
    """
    check_mesh(mesh)
    cfg = params.config

    def one(path, leaf):
        key = path[-1].key  # the weight's name (in the weights dict or a layer's dict)
        return NamedSharding(mesh, _weight_spec(key, leaf.shape, cfg, mesh))

    return jax.tree_util.tree_map_with_path(one, params)


def shard_params(params, mesh: Mesh):
    """Params placed on the mesh by `param_shardings` (weights already placed so are returned as they are)."""
    shardings = param_shardings(params, mesh)
    leaves = jax.tree.leaves(params)
    wanted = jax.tree.leaves(shardings)
    if all(getattr(x, "sharding", None) == s for x, s in zip(leaves, wanted, strict=True)):
        return params
    if spans_processes(mesh):  # every process holds the same weights: each fills its own devices' shards
        return jax.tree.map(global_array, params, shardings)
    return jax.device_put(params, shardings)


def cache_sharding(cache, mesh: Mesh, stacked: bool = False):
    """A pytree like `cache` (a KVCache) of NamedShardings: rows over "data", heads over "model".

    k/v [B, K, N, D] -> P("data", "model"), pos/acc [B, K, N] -> P("data", "model"); a Gated DeltaNet state's
    rec [B, Hv, dk, dv] -> P("data", "model") (value heads), conv [B, K-1, C] -> P("data"). An axis whose size
    does not divide (B by "data", heads by "model") is replicated. Works on arrays and on tracers inside jit.
    `stacked`: the layers' caches carry a leading (replicated) axis of layer
    groups (the pipeline's layer scan).
    """
    from vdjax.models.deltanet import LinearState

    check_mesh(mesh)

    lead = 1 if stacked else 0

    def one(x, heads: bool = True):
        heads = heads and x.ndim > lead + 1  # a per-row leaf (query statistics' count) has no head axis
        spec = [None] * lead + [_split(mesh, DATA, x.shape[lead]),
                                _split(mesh, MODEL, x.shape[lead + 1]) if heads else None]
        while spec and spec[-1] is None:
            spec.pop()
        return NamedSharding(mesh, P(*spec))

    def layer(c):
        if isinstance(c, LinearState):
            return LinearState(conv=one(c.conv, heads=False), rec=one(c.rec))
        return jax.tree.map(one, c)

    return type(cache)(tuple(layer(c) for c in cache.layers))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """NamedSharding of per-row arrays [B, ...] (tokens, lengths): rows over "data", the rest replicated."""
    return NamedSharding(check_mesh(mesh), P(DATA))


def constrain_cache(cache, mesh: Mesh | None, stacked: bool = False):
    """Inside jit: pin the cache to `cache_sharding` (a no-op without a mesh)."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_sharding(cache, mesh, stacked))


def global_array(a, sharding):
    """One global array of `sharding` from the same host value `a` in every process (each fills its own
    devices' shards); a PRNG key array goes as its key data and is wrapped again."""
    if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(a)
        data = global_array(np.asarray(jax.random.key_data(a)), _trailing(sharding, a.ndim))
        return jax.random.wrap_key_data(data, impl=impl)
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _trailing(sharding, ndim: int):
    """A key array's sharding for its key data (one more, replicated, trailing axis)."""
    return NamedSharding(sharding.mesh, P(*sharding.spec, *([None] * (ndim + 1 - len(sharding.spec)))))


def gather(x):
    """A global array (or key array) whole on this process, as a local device array; others as they are."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    from jax.experimental import multihost_utils

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(gather(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(multihost_utils.process_allgather(x, tiled=True)))

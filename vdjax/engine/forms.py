"""Layer forms: the per-layer weights and caches as the layer loop takes them, unrolled or stacked for the
layer scan (`loop_form`), the scan form of params made once per params object (`scan_form`), and its
inverse for caches (`unstack`)."""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vdjax.engine.cache import KVCache
from vdjax.engine.sharding import param_shardings, shard_params
from vdjax.models.params import Params


def layer_period(cfg) -> int:
    """The smallest p dividing L such that layers i and i + p share type, window and RoPE (1 for Llama,
    6 for Gemma3's 5 sliding : 1 global, 4 for Qwen3.5): the layer scan's step is p layers."""
    sig = [(cfg.layer_types[i], cfg.window(i), cfg.rope(i)[0], tuple(sorted(cfg.rope(i)[1].items())))
           for i in range(cfg.num_layers)]
    return next(p for p in range(1, cfg.num_layers + 1)
                if cfg.num_layers % p == 0 and all(sig[i] == sig[i % p] for i in range(cfg.num_layers)))


def loop_form(cfg, layers: tuple, scan: bool) -> tuple:
    """Per-layer pytrees (weight dicts, caches) as the layer loop takes them: unchanged when unrolled; with
    the layer scan, one tree per position j of the period, its leaves stacked over the groups [L / p, ...]."""
    if not scan:
        return tuple(layers)
    p = layer_period(cfg)
    return tuple(jax.tree.map(lambda *a: jnp.stack(a), *layers[j::p]) for j in range(p))


def layer_weights(params: Params, scan: bool) -> tuple:
    """Inside a program: the layers' weight dicts in `loop_form`. Params from `scan_form` already hold them so
    (weights["layer_groups"]: read in place); plain params are stacked here, one copy of the layer weights
    per call of a scanned program."""
    if in_scan_form(params, scan):
        return params.weights["layer_groups"]
    return loop_form(params.config, params.weights["layers"], scan)


def in_scan_form(params: Params, scan: bool) -> bool:
    """Whether params hold their layers in `scan_form`; a clear error where the program unrolls them."""
    if "layer_groups" not in params.weights:
        return False
    if not scan:
        raise ValueError("params in scan form (weights['layer_groups'], from engine.forms.scan_form) need "
                         "layer_scan=True; pass the params vdjax.load returned for unrolled layers")
    return True


class ScanForms:
    """The scan forms made so far, per live params object (by identity) and mesh: an entry goes when its
    params object is garbage-collected. `clear()` drops them all."""

    def __init__(self):
        self._forms: dict[int, dict] = {}

    def of(self, params: Params) -> dict:
        """The {mesh: scan-form params} made for this params object (empty at first)."""
        key = id(params)
        if key not in self._forms:
            self._forms[key] = {}
            weakref.finalize(params, self._forms.pop, key, None)
        return self._forms[key]

    def clear(self) -> None:
        """Forget every scan form (the params keep working; the next scanned call stacks again)."""
        self._forms.clear()


SCAN_FORMS = ScanForms()  # the one place scan forms are kept (see `scan_form`)


def scan_form(params: Params, mesh=None) -> Params:
    """`params` (sharded on `mesh` when given) with its layers stacked in `loop_form` under
    weights["layer_groups"] instead of weights["layers"]: what the scanned programs read.

    Made once per params object and mesh and remembered in `SCAN_FORMS`, so a scanned program does not stack
    the L layers' weights in every call. The stacked copy lives as long as `params` does: one more copy of the
    layer weights at rest, the same peak (the programs held that copy while they ran).
    """
    if in_scan_form(params, True):
        return params
    memo = SCAN_FORMS.of(params)
    if mesh in memo:
        return memo[mesh]
    base = params if mesh is None else shard_params(params, mesh)
    stack = functools.partial(loop_form, params.config, scan=True)
    if mesh is None:
        groups = jax.jit(stack)(base.weights["layers"])
    else:  # each stacked leaf: its layer's sharding behind a replicated leading axis of groups
        per_layer = param_shardings(base,
                                    mesh).weights["layers"]  # layers j, j + p, ... share their shardings
        shardings = tuple(jax.tree.map(lambda s: NamedSharding(mesh, P(None, *s.spec)), per_layer[j])
                          for j in range(layer_period(params.config)))
        groups = jax.jit(stack, out_shardings=shardings)(base.weights["layers"])
    weights = {k: v for k, v in base.weights.items() if k != "layers"} | {"layer_groups": groups}
    memo[mesh] = Params(weights, params.config, params.source)
    return memo[mesh]


@jax.jit
def _group(tree, g):
    """Group g [] of a loop-form pytree (leaves [L / p, ...]) -> its leaves [...]: one small program per tree
    shape, called once per group."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, g, keepdims=False), tree)


def unstack(cfg, cache: KVCache, scan: bool) -> KVCache:
    """Outside jit, the inverse of `loop_form`: a cache as the scanned programs pass it on -> one entry per
    layer.

    Inside a program the same split would be one slice kernel per layer and array, compiled into every
    program; here it runs `_group` with a traced index, compiled once.
    """
    if not scan:
        return cache
    p = len(cache.layers)
    groups = [[_group(cache.layers[j], jnp.int32(g)) for j in range(p)] for g in range(cfg.num_layers // p)]
    return KVCache(tuple(lc for group in groups for lc in group))

"""Placing one call's inputs: params sharded (and in scan form for the layer
scan), rows padded to the mesh."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from vdjax.engine.forms import _in_scan_form, scan_form
from vdjax.engine.sharding import batch_sharding, check_mesh, shard_params
from vdjax.models.params import Params


@dataclasses.dataclass
class Placed:
    """Inputs of one call placed on a mesh (params sharded, rows padded to a multiple of the "data" size),
    or as they are without one."""

    params: Params
    tokens: jax.Array  # [B_pad, T] on the batch sharding
    lengths: jax.Array  # [B_pad]
    host_lengths: np.ndarray  # [B_pad] the same, on the host
    rows: int  # B, the real rows (the first B of B_pad)
    live: jax.Array | None  # [B_pad] bool, False on padding rows; None when nothing was padded
    mesh: Any = None

    @property
    def jit_kw(self) -> dict:
        """The jitted steps' sharding keywords: none without a mesh (an explicit mesh=None would be another
        cache entry of the same program: bench.py warms `_prefill` without it)."""
        return {} if self.mesh is None else {"mesh": self.mesh}

    def pad_rows(self, a: np.ndarray) -> np.ndarray:
        """Per-row numpy data [B, ...] padded to [B_pad, ...] with copies of row 0."""
        extra = self.tokens.shape[0] - a.shape[0]
        return a if not extra else np.concatenate([a, np.repeat(a[:1], extra, axis=0)])

    def real(self, tree):
        """The real rows [B, ...] of every array of a per-row pytree (a cache, logits, tokens)."""
        if self.live is None:
            return tree
        return jax.tree.map(lambda x: x[: self.rows], tree)


def place(params: Params, tokens: np.ndarray, lengths: np.ndarray, mesh=None, scan: bool = False) -> Placed:
    """Shard params on `mesh`, pad the batch to a multiple of its "data" size and split tokens and lengths
    over "data". Dummy rows hold row 0's first token, length 1 (rows evict independently: they change
    nothing). Without a mesh: the inputs as device arrays, nothing padded. With
    `scan` the params in `scan_form`.
    """
    if scan:
        params = scan_form(params,
                           mesh)  # kept on params: stacked (and sharded) once, not in every program call
    else:
        _in_scan_form(params, False)  # unrolled programs refuse scan-form params before anything is sharded
    if mesh is None:
        # device_put, not jnp.asarray: the latter compiles a small staging program per new shape
        return Placed(params, jax.device_put(tokens), jax.device_put(lengths), lengths, tokens.shape[0], None)
    check_mesh(mesh)
    b = tokens.shape[0]
    extra = -b % mesh.shape["data"]
    if extra:
        tokens = np.concatenate([tokens, np.zeros((extra, tokens.shape[1]), tokens.dtype)])
        tokens[b:, 0] = tokens[0, 0]
        lengths = np.concatenate([lengths, np.ones(extra, lengths.dtype)])
    rows = batch_sharding(mesh)
    live = jax.device_put(np.arange(b + extra) < b, rows) if extra else None
    params = params if scan else shard_params(params, mesh)  # scan_form sharded them already
    return Placed(params, jax.device_put(tokens, rows), jax.device_put(lengths, rows), lengths, b, live, mesh)

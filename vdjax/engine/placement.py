"""Placing one call's inputs: params sharded (and in scan form for the layer
scan), rows padded to the mesh.

Several processes (`jax.distributed`, a mesh whose devices span them): every process passes the same
arguments; each host array becomes one global array (`jax.make_array_from_callback`: each process fills the
shards of its own devices from its copy) and outputs come back to every process whole (`Placed.real`:
`multihost_utils.process_allgather`), as local arrays, so nothing downstream changes."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vdjax.engine.forms import in_scan_form, scan_form
from vdjax.engine.sharding import (
    batch_sharding,
    check_mesh,
    gather,
    global_array,
    shard_params,
    spans_processes,
)
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

    @property
    def global_(self) -> bool:
        """Whether the mesh spans several processes (its arrays are global, not all addressable here)."""
        return self.mesh is not None and spans_processes(self.mesh)

    def put(self, a, rows: bool = False):
        """A host array (or a PRNG key) as the programs take it: on the device without a mesh or in one
        process; with a mesh over several processes a global array, split over "data" when `rows` (per-row
        data [B_pad, ...]), else replicated."""
        if not self.global_:
            return a if isinstance(a, jax.Array) else jax.device_put(a)
        spec = P("data") if rows else P()
        return global_array(a, NamedSharding(self.mesh, spec))

    def real(self, tree):
        """The real rows [B, ...] of every array of a per-row pytree (a cache, logits, tokens); over several
        processes gathered whole onto every process first (local arrays)."""
        if self.global_:
            tree = jax.tree.map(gather, tree)
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
        in_scan_form(params, False)  # unrolled programs refuse scan-form params before anything is sharded
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
    put = functools.partial(global_array, sharding=rows) if spans_processes(mesh) else functools.partial(
        jax.device_put, device=rows)
    live = put(np.arange(b + extra) < b) if extra else None
    params = params if scan else shard_params(params, mesh)  # scan_form sharded them already
    return Placed(params, put(tokens), put(lengths), lengths, b, live, mesh)

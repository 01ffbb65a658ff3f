"""Input checks and the static shapes of a call: ids, the question, length
buckets, the bound policy (`Plan`)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np

from vdjax.checks import check_int
from vdjax.engine import quant as kvq
from vdjax.engine.evict import cache_rule
from vdjax.engine.forms import layer_period
from vdjax.engine.policies import BoundPolicy, Policy, bind
from vdjax.models.params import Params


def default_layer_scan() -> bool:
    """Whether prefill/decode scan over layer groups by default: not on XLA:CPU, where each scan step copies
    its layer's weight slice before the products (faster compiles, slower programs: bench/README.md), yes on
    GPU/TPU (one compiled group instead of L unrolled layers; a slice there is a cheap device copy)."""
    return jax.default_backend() != "cpu"


def bucket(n: int) -> int:
    """Smallest value of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (at most 1.5x apart) that is >= n."""
    p = 1
    while True:
        if p >= n:
            return p
        if p >= 2 and p * 3 // 2 >= n:
            return p * 3 // 2
        p *= 2


def prepare_ids(params: Params, ids: Any, attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Validate ids ([T], [batch, T] with optional left-padding mask, or ragged lists) -> (rows, lengths).

    Returns rows as a list-free int32 array [batch, T_max] with each row's tokens
    first, and lengths [batch]. """
    vocab = params.config.vocab_size
    ragged = isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple, np.ndarray))
    if ragged and len({len(r) for r in ids}) > 1:
        if attention_mask is not None:
            raise ValueError("attention_mask needs ids of one length [batch, T]; ragged lists need no mask")
        rows = [np.asarray(r) for r in ids]
    else:
        arr = np.asarray(ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise ValueError(f"ids must be [T] or [batch, T], got shape {arr.shape}")
        if attention_mask is None:
            rows = list(arr)
        else:
            mask = np.asarray(attention_mask).astype(bool)
            if mask.shape != arr.shape:
                raise ValueError(f"attention_mask shape {mask.shape} must equal ids shape {arr.shape}")
            rows = []
            for r, (row, m) in enumerate(zip(arr, mask, strict=True)):
                idx = np.flatnonzero(m)
                if idx.size and idx[-1] - idx[0] + 1 != idx.size:
                    raise ValueError(f"attention_mask row {r} has holes; only left (or right) padding is "
                                     "allowed")
                rows.append(row[idx])
    lengths = np.array([len(r) for r in rows], np.int32)
    if len(rows) == 0 or lengths.min() == 0:
        raise ValueError(f"ids must hold at least one token per row, got lengths {lengths.tolist()}")
    out = np.zeros((len(rows), int(lengths.max())), np.int32)
    for r, row in enumerate(rows):
        if not np.issubdtype(row.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {row.dtype}")
        bad = row[(row < 0) | (row >= vocab)]
        if bad.size:
            raise ValueError(f"ids row {r} has out-of-vocabulary id(s) {bad[:5].tolist()}; allowed "
                             f"0..{vocab - 1}")
        out[r, : len(row)] = row
    return out, lengths


def prepare_question(params: Params, question: Any, batch: int) -> np.ndarray:
    """Validate question ids ([Q] for every row, or one list per row, all of one length) -> [batch, Q]."""
    rows = question if (isinstance(question, (list, tuple)) and question
                        and isinstance(question[0], (list, tuple, np.ndarray))) else [question] * batch
    if len(rows) != batch:
        raise ValueError(f"question has {len(rows)} rows, ids have {batch}; give one row per prompt or one "
                         "for all")
    if len({len(r) for r in rows}) != 1 or len(rows[0]) == 0:
        raise ValueError(f"question rows must be non-empty and of one length, got {[len(r) for r in rows]}")
    arr, _ = prepare_ids(params, [list(r) for r in rows])
    return arr


QUESTION_PAD = 32  # question-agnostic protocol: the cache grows by the question length rounded up to this


@dataclasses.dataclass
class Plan:
    """One call, checked and bound: padded tokens, lengths, block size S, cache slots N, the bound policy."""

    tokens: np.ndarray  # [B, nb * S] each row's tokens first, zeros after
    lengths: np.ndarray  # [B]
    block: int
    slots: int  # cache slots per head: the budget (the largest layer's); for dense the padded prompt plus the
    # tokens to come
    bound: BoundPolicy
    scan: bool  # scan over layer groups (`default_layer_scan`) instead of unrolling the layers


def kv_storage(cfg, kv_quant, kv_group) -> tuple[int, int, str, str] | None:
    """(bits, group, key layout, value layout) of a quantized cache (`quant.QuantTensor`: `kv_group` channels
    per scale, None = the head dim), None for kv_quant=None; a ValueError naming the argument otherwise."""
    bits = kvq.kv_quant_bits(kv_quant)
    if bits is None:
        if kv_group is not None:
            raise ValueError(f"kv_group={kv_group!r} needs kv_quant='int8', 'int4' or a -smooth(-rot) one")
        return None
    d = cfg.head_dim
    group = d if kv_group is None else kv_group
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1 or d % group:
        raise ValueError(f"kv_group must be a positive divisor of head_dim={d}; got {kv_group!r}")
    layout, v_layout = kvq.kv_quant_layout(kv_quant), kvq.kv_value_layout(kv_quant)
    if layout == "smooth" and d & (d - 1):
        what = "keys and values" if v_layout == "rotate" else "keys"
        raise ValueError(f"kv_quant={kv_quant!r} rotates {what} by a Hadamard matrix: it needs a "
                         f"power-of-two head_dim; this model's is {d} (use {kv_quant.split('-')[0]!r})")
    return bits, int(group), layout, v_layout


def plan(params, ids, policy: Policy | str, budget, block_size, extra_tokens=0, attention_mask=None,
         layer_scan=None, kv_quant=None, kv_group=None, **policy_kwargs) -> Plan:
    """Check the arguments, bind the policy (`policies.bind`: budget first, then its keywords) and fix the
    shapes (bucketed) of a prefill/generate call. A prompt longer than the model's max_position_embeddings
    runs, with a warning naming both lengths (as transformers warns). `kv_quant` ("int8", "int4") with
    `kv_group`: the cache's storage (`kv_storage`)."""
    if not isinstance(params, Params):
        raise TypeError(f"params must be vdjax Params (from vdjax.load), got {type(params).__name__}")
    storage = kv_storage(params.config, kv_quant, kv_group)
    bound = bind(policy, params, budget, **policy_kwargs)
    if storage is not None:
        bound = dataclasses.replace(bound, quant=storage)
    block_size = check_int("block_size", block_size)
    tokens, lengths = prepare_ids(params, ids, attention_mask)
    t = int(lengths.max())
    limit = params.config.max_position_embeddings
    if limit and t > limit:
        warnings.warn(f"the prompt has {t} tokens, more than the model's max_position_embeddings={limit}: "
                      "positions past it were never trained and the output may degrade", stacklevel=3)
    if bound.policy.replay and min(block_size, t) > dict(bound.hyper)["chunk_size"]:
        chunk = dict(bound.hyper)["chunk_size"]
        raise ValueError(f"policy {bound.name!r} replays each block as one chunk of at most "
                         f"chunk_size={chunk} tokens; block_size={block_size} makes blocks of "
                         f"{min(block_size, t)} tokens: use block_size <= {chunk}")
    if block_size >= t:
        block, nb = bucket(max(t, 16)), 1
    else:
        block, nb = block_size, bucket(-(-t // block_size))
    padded = np.zeros((tokens.shape[0], block * nb), np.int32)
    padded[:, :t] = tokens
    bound = bound.for_length(params.config, t)  # a layer rule's budgets (PyramidKV) for this prompt length
    rule = cache_rule(bound)
    slots = rule.slots(bound.budget, block * nb + extra_tokens)
    if layer_scan is not None and not isinstance(layer_scan, bool):
        raise TypeError(f"layer_scan must be True, False or None (the backend's default), got {layer_scan!r}")
    periodic = _periodic(params.config, rule.layer_slots(params.config, slots))
    if layer_scan is None:
        layer_scan = default_layer_scan() and periodic
    elif layer_scan and not periodic:
        raise ValueError("layer_scan=True needs the same cache size on layers i and i + p (the scan's step); "
                         f"these layer budgets differ by layer: {bound.layer_budgets}. Pass layer_scan=False")
    return Plan(padded, lengths, block, slots, bound, layer_scan)


def _periodic(cfg, per_layer: tuple[int, ...]) -> bool:
    """Whether layers i and i + p (the layer scan's step) have caches of one size."""
    p = layer_period(cfg)
    return all(per_layer[i] == per_layer[i % p] for i in range(cfg.num_layers))

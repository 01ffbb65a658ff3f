"""The engine's public calls: `prefill`, `compile_prefill`, `run` (tokens, timings, cache), `generate` and
`continuation_logprobs`. Each call binds the policy once (`inputs.plan`), places its inputs
(`placement.place`) and runs the jit programs (`programs`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vdjax.checks import check_int
from vdjax.engine.cache import KVCache, LayerCache
from vdjax.engine.compiler import BACKGROUND
from vdjax.engine.evict import cache_rule
from vdjax.engine.forms import unstack
from vdjax.engine.inputs import QUESTION_PAD, Plan, bucket, plan, prepare_ids, prepare_question
from vdjax.engine.placement import Placed, place
from vdjax.engine.policies import Policy
from vdjax.engine.programs import decode_program, extend_program, forced_program, grow, prefill_program
from vdjax.engine.sampling import check_sampling, is_row_keys
from vdjax.engine.sharding import gather
from vdjax.models.params import Params


def _prefill_args(p: Plan, x: Placed) -> tuple[tuple, dict]:
    """The prefill program's arguments and static keywords for a planned, placed call."""
    statics = dict(bound=p.bound, slots=p.slots, block=p.block, scan=p.scan, **x.jit_kw)
    return (x.params, x.tokens, x.lengths), statics


def prefill(
    params: Params,
    ids,
    policy: Policy | str = "valuediff",
    budget: int | None = None,
    block_size: int = 128,
    *,
    attention_mask=None,
    mesh=None,
    layer_scan: bool | None = None,
    **policy_kwargs,
) -> tuple[KVCache, jax.Array]:
    """Block-prefill a prompt under eviction; returns (cache, last-token logits [batch, V]).

    `mesh` (a jax Mesh with axes "data" and "model", see `vdjax.sharding`) splits the batch over "data" and
    attention heads / MLP width over "model"; the cache comes back sharded the same way.
    """
    p = plan(params, ids, policy, budget, block_size, 0, attention_mask, layer_scan, **policy_kwargs)
    x = place(params, p.tokens, p.lengths, mesh, p.scan)
    args, statics = _prefill_args(p, x)
    cache, logits = prefill_program(*args, **statics)
    return x.real((unstack(params.config, cache, p.scan), logits))


@dataclasses.dataclass
class PrefillProgram:
    """The compiled prefill of one call's (bucketed) shapes, with the call's placed inputs.

    `program()` runs it -> (cache, last logits) (rows of a mesh's padding included); `compiled` is the
    `jax.stages.Compiled` (`.cost_analysis()`, `.memory_analysis()`); `plan` holds the shapes.
    """

    compiled: Any
    inputs: tuple
    plan: Plan

    def __call__(self):
        cache, logits = self.compiled(*self.inputs)
        return unstack(self.inputs[0].config, cache, self.plan.scan), logits  # inputs[0]: the params


def compile_prefill(
    params: Params,
    ids,
    policy: Policy | str = "valuediff",
    budget: int | None = None,
    block_size: int = 128,
    *,
    attention_mask=None,
    mesh=None,
    layer_scan: bool | None = None,
    **policy_kwargs,
) -> PrefillProgram:
    """Compile the prefill program of this call without running it (arguments as `prefill`).

    Warms the jit cache: a later `prefill` / `generate` / `run` of the same length bucket compiles no prefill
    program (count with `vdjax.engine.timing.count_compiles`).
    """
    p = plan(params, ids, policy, budget, block_size, 0, attention_mask, layer_scan, **policy_kwargs)
    x = place(params, p.tokens, p.lengths, mesh, p.scan)
    args, statics = _prefill_args(p, x)
    return PrefillProgram(prefill_program.lower(*args, **statics).compile(), args, p)


@dataclasses.dataclass
class Generation:
    """Result of `run`: tokens [batch, new] and what it cost."""

    tokens: np.ndarray
    cache: KVCache
    prefill_s: float  # time to first token (prefill + first sample), compile included on first call
    decode_s: float
    steps: int  # decode steps run (new tokens - 1)
    policy: str
    hyper: tuple  # the bound keywords, model- and budget-dependent ones resolved
    budget: int | tuple[int, ...] | None  # slots per head asked for (per attention layer if a sequence;
    # None for dense)
    # cache slots of each layer: per head, or a head-adaptive pool's K * N (the question protocol's included;
    # 0: no KV cache)
    slots: tuple[int, ...]
    # per-head budget of each layer as evicted to (N, min(N, W - 1) on a sliding layer, PyramidKV's or the
    # sequence's N_l; 0: no KV cache); None for dense
    layer_budgets: tuple[int, ...] | None = None
    kv_quant: str | None = None  # the cache's storage: None (the compute dtype) or a `quant.KV_QUANT` name
    cache_bytes: int = 0  # keys and values as stored (a quantized cache's codes + scales + zeros)
    dense_cache_bytes: int = 0  # keys and values of every token seen, unquantized in the compute dtype


def layer_budgets(cfg, bound, slots: int) -> tuple[int, ...] | None:
    """The per-head budget each layer evicts to (0 on a layer without a KV cache); None for dense."""
    if bound.is_dense:
        return None
    per = cache_rule(bound).head_budgets(cfg, slots)
    return tuple(n if cfg.attends(i) else 0 for i, n in enumerate(per))


def layer_slot_counts(cache: KVCache) -> tuple[int, ...]:
    """Slots of each layer of a cache per row: per head, a pool's total (0 for a layer without a KV cache)."""
    return tuple(lc.pos.shape[-1] if isinstance(lc, LayerCache) else 0 for lc in cache.layers)


def _stop_tokens(cfg, eos_token_id) -> tuple[np.ndarray, np.int32]:
    """(EOS ids [E] int32: `eos_token_id`, else the model's; the pad id finished rows get)."""
    eos = cfg.eos_token_ids if eos_token_id is None else eos_token_id
    eos = np.atleast_1d(np.asarray(eos if eos is not None else [], np.int32)).reshape(-1)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (int(eos[0]) if eos.size else 0)
    return eos, np.int32(pad)


def _keys(key, x: Placed):
    """The sampling key(s): key(0) by default; one per row checked against the rows (and copied
    onto the mesh's padding rows)."""
    key = jax.random.key(0) if key is None else key
    if not is_row_keys(key):
        return key
    if key.shape[0] != x.rows:
        raise ValueError(f"key holds {key.shape[0]} row keys for {x.rows} rows; give one key, or one per row "
                         "(jax.random.split(key, rows))")
    extra = x.tokens.shape[0] - x.rows
    return key if not extra else jnp.concatenate([key, jnp.repeat(key[:1], extra, axis=0)])


def positions_bound(p: Plan, more: int) -> int:
    """The programs' static bound on positions (their RoPE tables, `programs.rope_tables`): the prompt's
    padded length plus `more`, bucketed so that nearby lengths share a program; 0 when the policy reads no
    table."""
    return bucket(p.tokens.shape[1] + more) if p.bound.policy.rope_table else 0


def _append_question(x: Placed, p: Plan, cache: KVCache, q_ids: np.ndarray, extra_q: int):
    """Question-agnostic protocol: append the question ids [B, Q] whole after the context was cut to budget
    (the cache grows by `extra_q` >= Q slots, nothing is evicted). Returns (cache, last logits)."""
    q_ids = x.pad_rows(q_ids)
    q_len = q_ids.shape[1]
    q_tokens = np.zeros((q_ids.shape[0], extra_q), np.int32)
    q_tokens[:, :q_len] = q_ids
    steps_q = np.arange(extra_q)[None]
    q_pos = np.where(steps_q < q_len, x.host_lengths[:, None] + steps_q, -1)
    if cache_rule(p.bound).grows_for_question:
        cache = grow(cache, extra_q, p.scan)
    cache, logits = extend_program(x.params, cache, x.put(q_tokens, rows=True),
                                   x.put(q_pos.astype(np.int32), rows=True), bound=p.bound, scan=p.scan,
                                   positions=positions_bound(p, extra_q), **x.jit_kw)
    return cache, logits


def run(
    params: Params,
    ids,
    policy: Policy | str = "valuediff",
    budget: int | None = None,
    block_size: int = 128,
    max_new_tokens: int = 64,
    *,
    attention_mask=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    key: jax.Array | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    min_new_tokens: int = 0,
    question=None,
    mesh=None,
    layer_scan: bool | None = None,
    **policy_kwargs,
) -> Generation:
    """`generate` plus timings and the final cache.

    `question` (ids, [Q] or one row per prompt, all of one length) selects the question-agnostic protocol:
    `ids` (the context) is block-prefilled and cut to `budget`, then the question is appended whole (the cache
    grows by Q rounded up to QUESTION_PAD slots, nothing evicted) and decoding
    evicts within that larger cache.

    `mesh` (a jax Mesh with axes "data" and "model", see `vdjax.sharding`): rows split over "data" (padded
    to a multiple of its size with dummy rows, dropped again), heads / MLP width over "model". `layer_scan`:
    scan over layer groups (fewer programs to compile) instead of unrolling the layers; None picks
    `default_layer_scan()` (off on XLA:CPU, where it is slower, on for GPU/TPU).

    `kv_quant="int8"` / `"int4"` (with `kv_group`, channels per scale; default the head dim): the cache
    stores keys and values as codes with per-token, per-group scales and zeros (`engine.quant`; int4 two
    codes a byte), quantized as each block's and each step's tokens are written and dequantized where
    attention and the scores read them; the prefill then runs in blocks for every policy (dense too), each
    attending to the cache as stored. `Generation.cache_bytes` counts what is stored. `"int8-smooth"` /
    `"int4-smooth"`: keys smoothed per channel and rotated (`engine.quant`'s smooth layout); `"-smooth-rot"`:
    values rotated too.
    """
    max_new = check_int("max_new_tokens", max_new_tokens)
    min_new = check_int("min_new_tokens", min_new_tokens, 0)
    if min_new > max_new:
        raise ValueError(f"min_new_tokens={min_new} must be <= max_new_tokens={max_new}")
    check_sampling(temperature, top_k, top_p, key)
    q_ids = None
    if question is not None:
        q_ids = prepare_question(params, question, prepare_ids(params, ids, attention_mask)[0].shape[0])
    extra_q = 0 if q_ids is None else -(-q_ids.shape[1] // QUESTION_PAD) * QUESTION_PAD
    max_out = bucket(max_new)  # nearby max_new_tokens share one decode program (and dense cache size)
    p = plan(params, ids, policy, budget, block_size, max_out + extra_q, attention_mask, layer_scan,
             **policy_kwargs)
    eos, pad = _stop_tokens(params.config, eos_token_id)
    x = place(params, p.tokens, p.lengths, mesh, p.scan)
    eos, pad = x.put(eos), x.put(pad)
    key = x.put(_keys(key, x), rows=is_row_keys(key) if key is not None else False)
    params, lengths = x.params, x.lengths
    t0 = time.perf_counter()
    args, statics = _prefill_args(p, x)
    cache, logits = prefill_program(*args, **statics)
    if q_ids is not None:
        cache, logits = _append_question(x, p, cache, q_ids, extra_q)
        lengths = lengths + q_ids.shape[1]
    padded = {} if x.live is None else {"live": x.live}
    args = (params, cache, logits, lengths, key, eos, pad, x.put(np.int32(max_new)))
    kw = dict(bound=p.bound, max_out=max_out, temperature=float(temperature), top_k=int(top_k),
              top_p=float(top_p), min_new=min_new, scan=p.scan,
              positions=positions_bound(p, max_out + extra_q),
              **x.jit_kw, **padded)
    behind = BACKGROUND.submit(decode_program, args, kw)  # compiles while the prefill runs
    logits.block_until_ready()
    t1 = time.perf_counter()
    behind.join()
    out, steps, cache = decode_program(*args, **kw)
    out = np.asarray(gather(out))
    t2 = time.perf_counter()
    steps = int(gather(steps))
    out, cache = x.real((out, unstack(params.config, cache, p.scan)))
    # tokens seen by the longest row (the last sampled one is never cached)
    seen = int(p.lengths.max()) + (0 if q_ids is None else q_ids.shape[1]) + steps - 1
    return Generation(out[:, :steps], cache, t1 - t0, t2 - t1, steps - 1, p.bound.name, p.bound.hyper,
                      p.bound.budget, layer_slot_counts(cache),
                      layer_budgets(params.config, p.bound, p.slots), policy_kwargs.get("kv_quant"),
                      cache.kv_nbytes(), cache.dense_nbytes(seen))


def generate(
    params: Params,
    ids,
    policy: Policy | str = "valuediff",
    budget: int | None = None,
    block_size: int = 128,
    max_new_tokens: int = 64,
    **kwargs,
) -> np.ndarray:
    """Generate up to `max_new_tokens` tokens [batch, new] with block prefill + per-step eviction to `budget`.

    Keywords: attention_mask (left padding), temperature/top_k/top_p with an explicit `key` (one key, or one
    per row: `jax.random.split(key, batch)`), eos_token_id,
    min_new_tokens (EOS masked before), question (question-agnostic protocol, see `run`), mesh (several
    devices, see `vdjax.sharding`), layer_scan (see `run`), kv_quant ("int8" / "int4": keys and values
    stored quantized, `kv_group` channels per scale, default the head dim; see `run`) and the policy's
    hyper-parameters (e.g. n_sink=4 for streaming).
    """
    return run(params, ids, policy, budget, block_size, max_new_tokens, **kwargs).tokens


def continuation_logprobs(
    params: Params,
    ids,
    continuation,
    policy: Policy | str = "valuediff",
    budget: int | None = None,
    block_size: int = 128,
    *,
    attention_mask=None,
    layer_scan: bool | None = None,
    **policy_kwargs,
) -> np.ndarray:
    """Log-probabilities [batch, C] of `continuation` (ids [C] for every row, or one row per prompt) after
    block-prefilling `ids` under eviction, teacher-forced with decode's semantics: the cache is cut to
    `budget` after each continuation token, so each row's argmax is what greedy
    `generate` would pick there."""
    tokens, _ = prepare_ids(params, ids, attention_mask)
    cont = prepare_question(params, continuation, tokens.shape[0])  # [B, C]
    p = plan(params, ids, policy, budget, block_size, cont.shape[1], attention_mask, layer_scan,
             **policy_kwargs)
    x = place(params, p.tokens, p.lengths, scan=p.scan)
    args, statics = _prefill_args(p, x)
    cache, logits = prefill_program(*args, **statics)
    return np.asarray(forced_program(x.params, cache, logits, x.lengths, jax.device_put(cont), bound=p.bound,
                                     scan=p.scan, positions=positions_bound(p, cont.shape[1])))

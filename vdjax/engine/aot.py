"""Ahead-of-time compilation for a TPU slice on any machine (MaxText's `train_compile.py` way): the real
prefill and decode programs of one call, compiled from a model config alone for the chips of
`jax.experimental.topologies`, with weights and inputs as abstract `ShapeDtypeStruct`s on a ("data",
"model") mesh of those chips. Nothing is loaded or run; XLA reports each program's per-chip memory
(`memory_analysis`), and `roofline` adds the analytic time a chip needs at best.

    report = vdjax.engine.aot(cfg, topology="v5e:2x2", mesh=(1, 4), length=131072, policy="valuediff",
                              budget=2048)

Needs libtpu (`pip install "jax[tpu]==<the installed jax>"`); the local backend stays what it was.
"""

from __future__ import annotations

import os
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vdjax.engine import quant, roofline
from vdjax.engine.api import positions_bound
from vdjax.engine.cache import LayerCache
from vdjax.engine.forms import layer_period
from vdjax.engine.inputs import bucket, kv_storage, plan
from vdjax.engine.programs import decode_program, prefill_program
from vdjax.engine.sharding import batch_sharding, heads_split, make_mesh, param_shardings
from vdjax.models.params import Params
from vdjax.models.transformer import CHUNK
from vdjax.models.weights import abstract

SLICE = re.compile(r"^(v4|v5e|v5p|v6e)(?::(\d+(?:x\d+)*)|-(\d+))$")
_SHAPES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


def topology(name: str) -> list:
    """The devices of a TPU slice: "v5e:2x2" (jax's names: `v5e:4x4` is 16 chips on 4 hosts, `v5p:2x2x1`), or
    the accelerator-type spelling of a chip count for v5e/v6e ("v5e-1", Colab's; "v6e-8")."""
    m = SLICE.match(str(name))
    if not m:
        raise ValueError(f"topology={name!r}: expected <chip>:<shape> (v5e:2x2, v6e:2x2, v5e:4x4, v5p:2x2x1, "
                         "v4:2x2x1) or <chip>-<chips> (v5e-1, v6e-8); chips: v4, v5e, v5p, v6e")
    chip, shape, count = m.groups()
    if count is not None:
        if chip not in ("v5e", "v6e") or int(count) not in _SHAPES:
            raise ValueError(f"topology={name!r}: <chip>-<chips> is for v5e/v6e with chips in "
                             f"{sorted(_SHAPES)}; give the shape instead (e.g. v5p:2x2x1)")
        shape = _SHAPES[int(count)]
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")  # quiets libtpu's start-up warnings
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU here: compiling processes may share it
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover - jax always ships it
        raise RuntimeError(f"this jax ({jax.__version__}) has no jax.experimental.topologies") from e
    dims = [int(x) for x in shape.split("x")]
    kw = {}
    if np.prod(dims) < 4:  # one host holds fewer chips than the default 2x2x1 bounds
        kw["chips_per_host_bounds"] = tuple(dims + [1] * (3 - len(dims)))
    try:
        return list(topologies.get_topology_desc(topology_name=f"{chip}:{shape}", platform="tpu",
                                                 **kw).devices)
    except Exception as e:  # libtpu missing, or a shape it refuses
        raise ValueError(f"topology={name!r} cannot be built: {str(e).splitlines()[0][:300]} (needs libtpu: "
                         f'pip install "jax[tpu]=={jax.__version__}")') from e


def _replicated(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def abstract_params(cfg, dtype, mesh, scan: bool) -> Params:
    """The params of `cfg` as ShapeDtypeStructs placed by `sharding.param_shardings` on `mesh`; with `scan` in
    `forms.scan_form` (each layer-group leaf [L / p, ...] behind a replicated leading axis)."""
    base = Params(abstract(cfg, dtype), cfg)
    shardings = param_shardings(base, mesh)
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), base, shardings)
    if not scan:
        return placed
    p = layer_period(cfg)
    layers = placed.weights["layers"]
    groups = tuple({name: jax.ShapeDtypeStruct((cfg.num_layers // p, *leaf.shape), leaf.dtype,
                                               sharding=NamedSharding(mesh, P(None, *leaf.sharding.spec)))
                    for name, leaf in layers[j].items()} for j in range(p))
    weights = {k: v for k, v in placed.weights.items() if k != "layers"} | {"layer_groups": groups}
    return Params(weights, cfg)


def _chip_bytes(tree) -> int:
    """Bytes one chip holds of a pytree of ShapeDtypeStructs with shardings (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        size = 8 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else jnp.dtype(x.dtype).itemsize
        total += int(np.prod(shape)) * size
    return total


def memory(compiled) -> dict:
    """XLA's per-chip bytes of a compiled program; peak = arguments + outputs - aliased (donated) +
    temporaries (MaxText's total)."""
    m = compiled.memory_analysis()
    out = {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
           "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes)}
    out["peak_bytes_per_chip"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                                  + out["temp_bytes"])
    return out


_OOM = re.compile(r"total memory required for HLO (\w+) \(([\d.]+)([KMGT])\) exceeds available HBM "
                  r"\(([\d.]+)([KMGT])\)")


def _compile(lowered, arguments) -> tuple:
    """(compiled, None), or (None, what XLA said) when XLA:TPU refuses a program too large for the chip's HBM:
    then `peak_bytes_per_chip` is the total XLA named ("memory required for HLO temporaries", the live buffers
    arguments included), `argument_bytes` the inputs' per-chip bytes counted from their shapes, output and
    temp bytes unknown (None)."""
    try:
        return lowered.compile(), None
    except Exception as e:
        text = str(e)
        m = _OOM.search(text)
        if "RESOURCE_EXHAUSTED" not in text or not m:
            raise
        scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        return None, {"argument_bytes": _chip_bytes(arguments), "output_bytes": None, "alias_bytes": None,
                      "temp_bytes": None, "peak_bytes_per_chip": int(float(m.group(2)) * scale[m.group(3)]),
                      "available_bytes": int(float(m.group(4)) * scale[m.group(5)]),
                      "error": m.group(0)}


def xla_cost(compiled) -> dict:
    """XLA's own cost analysis (every loop body counted once: a per-iteration figure, see `roofline`)."""
    c = compiled.cost_analysis()
    c = (c[0] if c else {}) if isinstance(c, (list, tuple)) else (c or {})
    return {"xla_flops_loop_bodies_once": float(c.get("flops", 0.0)),
            "xla_bytes_accessed_loop_bodies_once": float(c.get("bytes accessed", 0.0))}


def _layer_slots(cfg, cache, scan: bool) -> tuple[int, ...]:
    """Cache slots of each layer (0: no KV cache) from a (loop-form) cache of ShapeDtypeStructs."""
    entries = cache.layers
    per = [entries[i % len(entries)] if scan else entries[i] for i in range(cfg.num_layers)]
    return tuple(lc.pos.shape[-1] if isinstance(lc, LayerCache) else 0 for lc in per)


def _replay_defaults(cfg, policy, kw: dict) -> dict:
    """KVzip without a tokenizer: replay prompts of the lengths SmolLM2's tokenizer gives kvpress's prompts
    (only their lengths shape the programs)."""
    name = policy if isinstance(policy, str) else getattr(policy, "name", "")
    if "kvzip" not in str(name):
        return kw
    fill = {"repeat_ids": (0,) * 9, "continue_ids": (0,) * 7, "suffix_ids": (0,) * 5}
    return {**{k: v for k, v in fill.items() if kw.get(k) is None}, **kw}


def aot(cfg, *, topology_name: str = "v5e:2x2", mesh: tuple[int, int] | None = None, length: int = 8192,
        policy="valuediff", budget: int | None = 2048, batch: int = 1, block_size: int = 128,
        new_tokens: int = 256, dtype=jnp.bfloat16, layer_scan: bool = True, model: str = "",
        kv_quant: str | None = None, kv_group: int | None = None, **policy_kwargs) -> dict:
    """Compile the prefill and decode programs of one call (prompt `length`, `batch` rows, `new_tokens`
    to decode) for the TPU slice `topology_name` on a (data, model) `mesh` of its chips (None: all chips on
    "model"); returns the report (see the module docstring and `format_report`). `kv_quant` / `kv_group`:
    the cache's storage (`vdjax.run`): the carry, the memory and the bytes read per step are the packed
    cache's."""
    devices = topology(topology_name)
    chip_key = roofline.chip_of(devices[0].device_kind)
    chip = roofline.CHIPS[chip_key]
    chips_all = len(devices)
    data, width = (1, chips_all) if mesh is None else (int(mesh[0]), int(mesh[1]))
    if data < 1 or width < 1 or chips_all % (data * width):
        raise ValueError(f"mesh={data}x{width} does not divide the {chips_all} chips of {topology_name}")
    m = make_mesh(data, width, devices)
    used = list(m.devices.flat)
    params = abstract_params(cfg, dtype, m, layer_scan)
    max_out = bucket(new_tokens)
    ids = np.zeros((batch, length), np.int32)
    kw = _replay_defaults(cfg, policy, dict(policy_kwargs))
    storage = kv_storage(cfg, kv_quant, kv_group)
    if storage is not None:
        kw.update(kv_quant=kv_quant, kv_group=storage[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(params, ids, policy, budget, block_size, max_out, None, layer_scan, **kw)
    notes = [str(w.message) for w in caught]
    rows = -(-batch // data) * data
    rows_s = batch_sharding(m)
    tokens = jax.ShapeDtypeStruct((rows, p.tokens.shape[1]), jnp.int32, sharding=rows_s)
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=rows_s)
    statics = dict(bound=p.bound, slots=p.slots, block=p.block, scan=p.scan, mesh=m)
    t0 = time.perf_counter()
    lowered = prefill_program.lower(params, tokens, lengths, **statics)
    pre, pre_oom = _compile(lowered, (params, tokens, lengths))
    pre_s = time.perf_counter() - t0
    cache, logits = lowered.out_info
    if pre is not None:  # the cache as the prefill leaves it (rows x heads sharded), as a real run gets it
        cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache,
                             pre.output_shardings[0])
    key = jax.eval_shape(lambda: jax.random.key(0))
    live = {} if rows == batch else {"live": jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=rows_s)}
    eos = cfg.eos_token_ids or (0,)
    args = (params, cache, logits, lengths, _replicated(m, (), key.dtype),
            _replicated(m, (len(eos),), jnp.int32), _replicated(m, (), jnp.int32),
            _replicated(m, (), jnp.int32))
    dkw = dict(bound=p.bound, max_out=max_out, temperature=0.0, top_k=0, top_p=1.0, min_new=0, scan=p.scan,
               positions=positions_bound(p, max_out), mesh=m, **live)
    t0 = time.perf_counter()
    dec, dec_oom = _compile(decode_program.lower(*args, **dkw), args)
    dec_s = time.perf_counter() - t0

    split = roofline.Split(rows // data, width, heads_split(cfg, m))
    shards = param_shardings(Params(abstract(cfg, dtype), cfg), m)
    names = {}
    for lw, sw in zip(abstract(cfg, dtype)["layers"], shards.weights["layers"], strict=True):
        names.update({n: sw[n] for n in lw})
    names.update({n: s for n, s in shards.weights.items() if n != "layers"})

    def shard(name, shape):
        return names[name].shard_shape(shape)

    weights = abstract(cfg, dtype)
    layer_w = params.weights["layer_groups" if p.scan else "layers"]
    w_bytes, c_bytes = _chip_bytes(layer_w), _chip_bytes(cache)
    h_bytes = _chip_bytes(params.weights.get("lm_head", params.weights["embed"]))
    k_chip = cfg.num_kv_heads // (width if split.heads_split else 1)
    kv_token = 2.0 * k_chip * (cfg.head_dim * jnp.dtype(dtype).itemsize if storage is None else
                               quant.bytes_per_token(cfg.head_dim, *storage[:2]))
    slots = _layer_slots(cfg, cache, p.scan)
    pf, pb = roofline.prefill_work(cfg, weights, split, slots, tokens=length, padded=p.tokens.shape[1],
                                   block=p.block, dense=p.bound.is_dense, weight_bytes=w_bytes,
                                   head_bytes=h_bytes, cache_bytes=c_bytes, kv_token_bytes=kv_token,
                                   chunk=CHUNK, shard=shard)
    sf, sb = roofline.decode_work(cfg, weights, split, slots, weight_bytes=w_bytes, head_bytes=h_bytes,
                                  cache_bytes=c_bytes, shard=shard)
    programs = {
        "prefill": {**(pre_oom or memory(pre)), "flops": pf, "bytes_accessed": pb,
                    "compile_s": round(pre_s, 2),
                    "roofline_s": roofline.roofline_s(pf, pb, chip), **({} if pre_oom else xla_cost(pre))},
        "decode": {**(dec_oom or memory(dec)), "flops": sf * new_tokens, "bytes_accessed": sb * new_tokens,
                   "flops_per_step": sf, "bytes_per_step": sb, "compile_s": round(dec_s, 2),
                   "roofline_s": roofline.roofline_s(sf, sb, chip) * new_tokens,
                   "roofline_s_per_step": roofline.roofline_s(sf, sb, chip),
                   **({} if dec_oom else xla_cost(dec))},
    }
    peak = max(v["peak_bytes_per_chip"] for v in programs.values())
    fits = peak <= chip.hbm_bytes and not (pre_oom or dec_oom)
    verdict = (f"fits: {roofline.gib(peak)} GiB of {roofline.gib(chip.hbm_bytes)} GiB per chip" if fits else
               f"does not fit: {roofline.gib(peak)} GiB of {roofline.gib(chip.hbm_bytes)} GiB per chip")
    if pre_oom or dec_oom:
        said = "; ".join(o["error"] for o in (pre_oom, dec_oom) if o)
        verdict += f" (XLA:TPU refused to compile: {said})"
    return {
        "topology": topology_name, "chips": len(used), "processes": len({d.process_index for d in used}),
        "mesh": [data, width], "model": model or cfg.family, "dtype": jnp.dtype(dtype).name,
        "policy": p.bound.name, "budget": p.bound.budget, "length": length, "batch": batch,
        "block_size": p.block, "new_tokens": new_tokens, "layer_scan": p.scan, "kv_quant": kv_quant,
        "kv_group": None if storage is None else storage[1], "cache_slots": max(slots),
        "chip": {"name": chip.name, "bf16_flops": chip.flops, "hbm_bytes": chip.hbm_bytes,
                 "hbm_bandwidth": chip.hbm_bandwidth, "source": chip.source},
        "programs": programs, "peak_bytes_per_chip": peak, "fits": fits, "verdict": verdict,
        "notes": notes + ["flops, bytes_accessed and roofline_s are per chip and analytic "
                          "(vdjax.engine.roofline): an estimate of the best time, never a measurement"],
    }


def format_report(r: dict) -> str:
    """The report as a small table (one row per program) with its verdict."""
    head = (f"{r['model']} {r['dtype']} on {r['topology']} ({r['chips']} chips, {r['processes']} processes, "
            f"mesh {r['mesh'][0]}x{r['mesh'][1]}): {r['policy']} N={r['budget']}, {r['length']} tokens x "
            f"{r['batch']}, {r['new_tokens']} new"
            + ("" if not r.get("kv_quant") else f", cache {r['kv_quant']} g{r['kv_group']}"))
    lines = [head, "| program | peak GiB/chip | args | temp | out | GFLOP/chip | GB/chip | roofline s "
                   "| compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, v in r["programs"].items():
        lines.append(f"| {name} | {roofline.gib(v['peak_bytes_per_chip'])} | "
                     f"{roofline.gib(v['argument_bytes'])} "
                     f"| {roofline.gib(v['temp_bytes'])} | {roofline.gib(v['output_bytes'])} | "
                     f"{v['flops'] / 1e9:.1f} | {v['bytes_accessed'] / 1e9:.2f} | {v['roofline_s']:.3g} | "
                     f"{v['compile_s']} |")
    lines.append(f"{r['verdict']} ({r['chip']['name']}; roofline: an estimate from {r['chip']['source']})")
    return "\n".join(lines + r["notes"][:-1])

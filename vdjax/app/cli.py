"""The `vdjax` command line: generate under a KV budget, a needle-in-a-haystack demo of every policy, convert.

    vdjax generate --policy valuediff --budget 256 --prompt "What is the capital of France?"
    vdjax demo --length 2048
    vdjax convert smollm2-135m
    vdjax analyze --model gemma3-270m --fit

Timings: every policy compiles its own prefill and decode programs on first use. The CLI measures the time
JAX spends tracing and compiling (jax.monitoring) and reports it apart, so time to first token and
decode tok/s are warm figures.
"""

from __future__ import annotations

import argparse
import sys

from vdjax.app.args import (
    POSITIVE,
    Parser,
    UsageError,
    budget_list,
    float_in,
    int_at_least,
    length_arg,
    mesh_shape,
    name_list,
    policy_arg,
)
from vdjax.app.commands import cmd_analyze, cmd_convert, cmd_demo, cmd_eval, cmd_generate, cmd_rescore


def _add_model_args(p, default: str = "smollm2-135m") -> None:
    """--model, --revision, --dtype (shared by the subcommands that load a model)."""
    p.add_argument("--model", default=default,
                   help="registered name, HF checkpoint folder or Hub id (owner/name)")
    p.add_argument("--revision", help="Hub revision (branch, tag or commit) of a Hub id")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="weight dtype (default: float32 on CPU, the checkpoint's dtype on GPU/TPU)")


def _add_kv_args(p) -> None:
    """--kv-quant, --kv-group."""
    p.add_argument("--kv-quant", choices=("int8", "int4", "int8-smooth", "int4-smooth", "int8-smooth-rot",
                                          "int4-smooth-rot"),
                   help="store keys and values quantized (per-token groups, scales; int4 two per byte; "
                        "-smooth: keys centred, smoothed per channel and Hadamard-rotated first; -rot: "
                        "values Hadamard-rotated too)")
    p.add_argument("--kv-group", type=POSITIVE, help="channels per scale (default: the head dim)")


def _fraction_list(text: str) -> list[float]:
    """argparse type: comma list of fractions in (0, 1]."""
    try:
        out = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or not all(0 < f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"must be a comma list of fractions in (0, 1], got {text!r}")
    return out


def _add_layer_scan(p, auto: str) -> None:
    """--layer-scan auto|on|off; `auto` is documented per command."""
    p.add_argument("--layer-scan", choices=("auto", "on", "off"), default="auto",
                   help="scan over layers (on CPU: faster compiles, slower prefill and decode) or unroll "
                        f"them; auto: {auto}")


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


# ---- entry point -------------------------------------------------------------------------------------------
def _add_generate(sub) -> None:
    """The `vdjax generate` subcommand."""
    g = sub.add_parser("generate", help="answer one prompt under a KV budget and print cache stats")
    _add_model_args(g)
    g.add_argument("--policy", default="valuediff", help="registered policy, optionally +sinksN / +recentN")
    g.add_argument("--budget", type=POSITIVE, help="cache slots per KV head (not needed for dense)")
    g.add_argument("--block-size", type=POSITIVE, default=128)
    g.add_argument("--max-new-tokens", type=POSITIVE, default=64)
    g.add_argument("--temperature", type=float_in(0, float("inf")), default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int_at_least(0), default=0, help="0 = off")
    g.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--mesh", type=mesh_shape, metavar="DATAxMODEL",
                   help="run on a device mesh, e.g. 2x4: batch over 2, attention heads / MLP over 4 devices")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the whole input (one user turn)")
    src.add_argument("--prompt-file")
    src.add_argument("--context-file", help="a long context; the question comes from --question")
    g.add_argument("--question",
                   help="asked after --context-file's context (one user turn: context + question)")
    g.add_argument("--protocol", choices=("paper", "question_agnostic"), default="paper",
                   help="paper: context + question block-prefilled under eviction; question_agnostic: the "
                        "context cut to budget first, the question appended whole")
    g.add_argument(
        "--policy-arg",
        type=policy_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy hyper-parameter, e.g. n_sink=8 (repeatable)",
    )
    _add_kv_args(g)
    _add_layer_scan(g, "on (one prompt: compiling dominates)")
    g.set_defaults(func=cmd_generate)


def _add_demo(sub) -> None:
    """The `vdjax demo` subcommand."""
    d = sub.add_parser("demo", help="the thesis in a minute: needles on both real models, their geometry, a "
                                    "verdict")
    d.add_argument("--model", help="one model only (default: smollm2-135m and gemma3-270m)")
    d.add_argument("--length", type=POSITIVE, default=1024, help="prompt length in tokens")
    d.add_argument("--budget", type=POSITIVE, help="default: a quarter of the prompt, a multiple of 64")
    d.add_argument("--block-size", type=POSITIVE, default=128)
    d.add_argument("--policies", help="comma list (default: dense, streaming, keydiff, valuediff)")
    d.add_argument("--all", action="store_true", help="every registered policy")
    d.add_argument("--max-new-tokens", type=POSITIVE, default=12)
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
    e.add_argument("benchmark", choices=(*BENCHMARKS, "merge"),
                   help="a benchmark, or `merge RUN_FOLDER`: its --shard files into predictions.jsonl")
    e.add_argument("folder", nargs="?", metavar="RUN_FOLDER", help="with merge: the run folder of the shards")
    _add_model_args(e)
    e.add_argument("--policies", type=name_list,
                   help="comma list (default: dense and every registered policy the model is calibrated for)")
    e.add_argument("--budgets", type=budget_list,
                   help="comma list of cache budgets, e.g. 256,512, or of fractions of the average dense "
                        "generation length, e.g. 0.25,0.5 (dense runs first; MATH-500 protocol)")
    e.add_argument("--length", type=length_arg,
                   help="tokens: RULER's whole input (default 4096); LongBench's prompt after middle "
                        "truncation (no default: give it, or `model` = max_position_embeddings - 500, the "
                        "model2maxlen rule); MATH-500's dense max_new_tokens (default 16384)")
    e.add_argument("--samples", type=POSITIVE,
                   help="samples per task (default: the benchmark's own, MATH-500's first 100 problems; "
                        "else 20)")
    e.add_argument("--draws", type=POSITIVE, default=1,
                   help="generations per sample (MATH-500's k; needs sampling)")
    e.add_argument("--sampling", choices=("greedy", "model"), default="greedy",
                   help="greedy, or the checkpoint's generation_config.json sampling (temperature, top_p, "
                        "top_k)")
    e.add_argument("--temperature", type=float_in(0, float("inf")), help="overrides --sampling's")
    e.add_argument("--top-p", type=float_in(0, 1, lo_open=True), help="overrides --sampling's")
    e.add_argument("--top-k", type=int_at_least(0), help="overrides --sampling's")
    e.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="chat-template switch (Qwen3 / Qwen3.5; the paper runs Qwen3.5 with "
                        "--no-enable-thinking)")
    e.add_argument("--reasoning-effort", choices=("low", "medium", "high"),
                   help="GPT-OSS harmony chat template (the paper runs high)")
    e.add_argument("--template-arg", type=policy_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="any other chat-template keyword (repeatable)")
    e.add_argument("--out", default="results", help="results folder (a rerun resumes what is there)")
    e.add_argument("--tasks", type=name_list, help="comma list (default: every task of the benchmark)")
    e.add_argument("--protocol", choices=PROTOCOLS, default="paper")
    e.add_argument("--block-size", type=POSITIVE, default=128)
    e.add_argument("--batch-size", type=POSITIVE, default=1, help="samples per vdjax.run call")
    e.add_argument("--data-dir", help="benchmark data folder (LongBench, MATH-500)")
    e.add_argument("--seed", type=int_at_least(0), help="default: the benchmark's (RULER's 42), else 0")
    e.add_argument("--allow-mixed", action="store_true",
                   help="add to a results file made with another checkpoint / tokenizer / chat template")
    e.add_argument("--mesh", type=mesh_shape, metavar="DATAxMODEL",
                   help="device mesh, e.g. 4x1: each --batch-size batch split over 4 devices")
    _add_kv_args(e)
    e.add_argument("--budget-bytes", type=_fraction_list, metavar="F[,F...]",
                   help="budgets as fractions of a dense bf16 cache's bytes at --length: N per --kv-quant so "
                        "that rows of different precisions hold equal bytes (scales counted)")
    e.add_argument("--shard", metavar="I/N",
                   help="run only batches k with k %% N == I into predictions.shard-I-of-N.jsonl (default "
                        "under jax.distributed without a spanning mesh: this process's index / the process "
                        "count); `vdjax eval merge RUN_FOLDER` combines them")
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
    a.add_argument("--prompts",
                   help="own calibration prompts: .jsonl ({\"text\": ...} per line) or .txt ('---' "
                        "separated); default: the built-in narrative/qa/code/math/retrieval set")
    a.add_argument("--length", type=POSITIVE, default=2048,
                   help="tokens per prompt (capped at the model's limit)")
    a.add_argument("--per-category", type=POSITIVE, default=4, help="built-in prompts per category")
    a.add_argument("--tau", type=float_in(0, 1, lo_open=True), default=0.3, help="sink threshold")
    a.add_argument("--topk", type=int_at_least(0), default=256, help="Jaccard top-k (0 = skip Jaccard)")
    a.add_argument("--n-queries", type=int_at_least(2), default=128, help="Jaccard query positions")
    a.add_argument("--jaccard-prompts", type=int_at_least(0), default=8)
    a.add_argument("--fit", action="store_true", help="also fit the hybrid mix with optax")
    a.add_argument("--budget", type=POSITIVE, default=256,
                   help="cache budget N the fit and selection target; the mix is saved as N's (hybrid runs "
                        "at N use it) and as the default of budgets without one of their own")
    a.add_argument("--block-size", type=POSITIVE, default=128)
    a.add_argument("--fit-prompts", type=POSITIVE, default=4)
    a.add_argument("--fit-steps", type=POSITIVE, default=60)
    a.add_argument("--select-probes", type=int_at_least(0), default=8,
                   help="after the per-layer fit, keep whichever of {fitted, geometry, valuediff, keydiff, "
                        "even} gives the lowest answer NLL on this many retrieval probes under eviction at "
                        "--budget (0: keep the per-layer fit; see --select-on)")
    a.add_argument("--select-on", choices=("retrieval", "ruler"), default="retrieval",
                   help="the selection's objective: 'retrieval' answer NLL of --select-probes retrieval "
                        "probes; 'ruler' the mean score of --select-samples held-out RULER samples per task "
                        "(seed 1, qa left out; needs the eval extra; runs under "
                        "OUT/<model>/selection-N<budget>/)")
    a.add_argument("--select-samples", type=POSITIVE, default=2,
                   help="held-out RULER samples per task for --select-on ruler")
    a.add_argument("--select-prior", choices=("geometry", "fitted", "valuediff", "keydiff", "even", "none"),
                   default="geometry",
                   help="--select-on ruler: this candidate stays unless another beats it on the held-out "
                        "samples beyond their noise (paired bootstrap 95 %% interval above 0); 'none': the "
                        "highest mean wins")
    a.add_argument("--per-head", action="store_true", help="one weight per KV head instead of per layer")
    a.add_argument("--qfilters", action="store_true",
                   help="only fit the Q-filters (policy 'qfilter') on the calibration prompts and save them "
                        "beside the checkpoint (<folder>/vdjax-qfilters/qfilters.json)")
    a.set_defaults(func=cmd_analyze)


def _add_aot(sub) -> None:
    """The `vdjax aot` subcommand."""
    from vdjax.app.aot import cmd_aot

    a = sub.add_parser("aot", help="compile prefill + decode for a TPU slice here (config only, weights "
                                   "abstract): per-chip memory, fits or not, roofline time")
    a.add_argument("--model", default="smollm2-135m",
                   help="config.json folder, registered name or Hub id (only its config is read)")
    a.add_argument("--revision", help="Hub revision of a Hub id")
    a.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="weight dtype (default: the config's, else bfloat16)")
    a.add_argument("--topology", default="v5e:2x2",
                   help="TPU slice: v5e:2x2, v6e:2x2, v5e:4x4 (16 chips, 4 hosts), v5p:2x2x1, v4:2x2x1, or "
                        "v5e-1 / v6e-8 (chip count)")
    a.add_argument("--mesh", type=mesh_shape, metavar="DATAxMODEL",
                   help="mesh of the slice's chips (default: 1 x all chips)")
    a.add_argument("--length", type=POSITIVE, default=8192, help="prompt tokens per row")
    a.add_argument("--policy", default="valuediff")
    a.add_argument("--budget", type=POSITIVE, help="cache slots per KV head (not for dense)")
    a.add_argument("--batch", type=POSITIVE, default=1)
    a.add_argument("--block-size", type=POSITIVE, default=128)
    a.add_argument("--new", type=POSITIVE, default=256, help="tokens to decode")
    a.add_argument("--policy-arg", type=policy_arg, action="append", default=[], metavar="KEY=VALUE")
    a.add_argument("--layer-scan", choices=("on", "off"), default="on",
                   help="scan over layer groups (the TPU default) or unroll the layers")
    _add_kv_args(a)
    a.add_argument("--json", metavar="OUT", help="write the report as JSON")
    a.set_defaults(func=cmd_aot)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every subcommand."""
    parser = Parser(prog="vdjax", description="Bounded-memory LLM inference by KV-cache eviction.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (_add_generate, _add_demo, _add_convert, _add_eval, _add_rescore, _add_analyze, _add_aot):
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

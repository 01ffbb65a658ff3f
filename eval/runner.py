"""Run a benchmark under every (policy, budget) and append one scored JSON line per result, resumably.

    path = evaluate(params, tokenizer, "ruler", model_name="smollm2-135m", policies=["dense", "valuediff"],
                    budgets=[256, 512], length=4096, num_samples=20, out_dir="results")
    # results/ruler/smollm2-135m/paper/L4096/predictions.jsonl (+ run.json beside it)

Each line is one (sample, policy, budget, draw): written, flushed and fsynced as soon as it is scored, by the
file's only writer (`records.PredictionsFile` holds a lock), so a crash loses at most the result being
written. A rerun into the same folder drops a torn last line and skips every line it already holds; lines
made with another checkpoint, tokenizer or chat template (their `fingerprint`), seed, block size, sampling
or policy hyper-parameters are refused (`allow_mixed=True` accepts other fingerprints). Dense runs once
per sample with `budget` null.

The runner knows no benchmark by name. A benchmark module defines `TASKS` and
`build(task, tokenizer, *, length, num_samples, seed[, data_dir]) -> [Sample]`, optionally `SEED` (its
default seed), and, to accept budgets given as fractions, `budget_rule(fractions, dense_lengths) ->
{fraction: budget}`. Its samples carry their own stop rule: `Sample.stop` (strings whose token also ends the
generation, e.g. LongBench samsum's "\\n") and `Sample.min_new_tokens` (EOS and stops masked before).

Fractional budgets: every dense generation finishes first; the benchmark's `budget_rule` turns the fractions
and the recorded dense `new_tokens` into integer budgets, which are frozen in run.json the first time (a
resumed or extended run reuses them); each evicting line keeps `budget` and `budget_fraction`.

Sampling (`sampling={"temperature": ..., "top_p": ..., "top_k": ...}`, default greedy) with `draws=k` makes
k lines per (sample, config), `draw` 0..k-1, each from its own key (seed, sample id, draw): a row's draws do
not depend on what shares its batch, so a resumed run redraws exactly what was missing.

Protocols (see `vdjax.eval.sample`): `paper` block-prefills context + question; `question_agnostic`
block-prefills the context only and appends the question afterwards (`vdjax.run(..., question=...)`). """

from __future__ import annotations

import dataclasses
import datetime
import importlib
import inspect
import json
import os
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from vdjax.checks import check_int, check_name, unique_list
from vdjax.eval import shards
from vdjax.eval.provenance import fingerprint, git_commit, start_invocation, write_json
from vdjax.eval.records import METRIC_EXTRA, PredictionsFile, read_predictions, record_key
from vdjax.eval.sample import PROTOCOLS, Sample, render_ids

BENCHMARKS = ("ruler", "longbench", "math500")
# a resumed run must agree with the file on these (other fields may change between runs: tasks, budgets, ...)
RUN_FIELDS = ("benchmark", "model", "length", "seed", "protocol", "block_size", "sampling", "kv_quant",
              "kv_group")
# prefill_s / decode_s: the batch call's wall time less jit compilation (compile_s); prefill_s: to 1st token
RECORD_FIELDS = (
    "benchmark", "task", "sample_id", "draw", "model", "length", "seed", "protocol", "sampling", "policy",
    "budget", "budget_fraction", "block_size", "hyper", "prediction", "answers", "score", "metric",
    "input_tokens", "new_tokens", "truncated", "prefill_s", "decode_s", "compile_s", "batch", "vdjax_commit",
    "fingerprint", "layer_budgets", "kv_quant", "kv_group", "cache_bytes", "dense_cache_bytes")
SAMPLING_KEYS = ("temperature", "top_k", "top_p")


# ---- benchmarks and paths ---------------------------------------------------------------------------------
def load_benchmark(benchmark: str | ModuleType) -> tuple[str, ModuleType]:
    """(name, module) of a benchmark: one of BENCHMARKS, or a module with `TASKS`, `build` (name: `NAME`)."""
    if isinstance(benchmark, ModuleType):
        module = benchmark
        name = getattr(module, "NAME", module.__name__.rsplit(".", 1)[-1])
    elif isinstance(benchmark, str):
        if benchmark not in BENCHMARKS:
            raise ValueError(f"benchmark={benchmark!r} is unknown; allowed: {list(BENCHMARKS)} or a module")
        name, module = benchmark, importlib.import_module(f"vdjax.eval.{benchmark}")
    else:
        raise TypeError(f"benchmark must be a name {list(BENCHMARKS)} or a module, "
                        f"got {type(benchmark).__name__}")
    if not hasattr(module, "TASKS") or not callable(getattr(module, "build", None)):
        raise TypeError(f"benchmark module {module.__name__!r} must define TASKS and "
                        "build(task, tokenizer, ...)")
    return name, module


def run_dir(out_dir: str | os.PathLike, benchmark: str, model_name: str, protocol: str, length: int,
            kv_quant: str | None = None, kv_group: int | None = None) -> Path:
    """The folder of one run: out_dir/<benchmark>/<model_name>/<protocol>/L<length> (a quantized cache's:
    L<length>-<kv_quant>-g<group>)."""
    tail = "" if kv_quant is None else f"-{kv_quant}-g{kv_group}"
    return Path(out_dir) / benchmark / model_name / protocol / f"L{length}{tail}"


# ---- the run's settings -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    """One column of a run: a policy with its hyper-parameters at a budget (None for dense)."""

    policy: Any
    hyper: tuple
    budget: int | None = None
    fraction: float | None = None


@dataclasses.dataclass
class Spec:
    """The checked arguments of one `evaluate` call."""

    name: str
    module: ModuleType
    model_name: str
    length: int
    num_samples: int
    seed: int
    protocol: str
    block_size: int
    batch_size: int
    tasks: list[str]
    # (Policy, hyper) as asked; `hyper_at` binds them to the model and budget
    policies: list[tuple[Any, tuple]]
    budgets: list  # ints (cache slots) or fractions
    data_dir: Path | None
    metrics: Mapping[str, Callable]
    template_kwargs: dict
    sampling: dict | None  # None: greedy
    draws: int
    mesh: Any = None
    bind: Callable[[Any, tuple, int | None], tuple] = lambda pol, hyper, budget: hyper  # Policy.bind_hyper
    kv: tuple = (None, None)  # (kv_quant, group): the cache's storage

    def hyper_at(self, pol, hyper: tuple, budget: int | None) -> tuple:
        """A policy's hyper-parameters bound to the model at `budget` (e.g. hybrid's mix saved for it)."""
        return self.bind(pol, hyper, None if pol.is_dense else budget)

    @property
    def identity(self) -> dict:
        """What every line of the run's file shares (RUN_FIELDS)."""
        return {"benchmark": self.name, "model": self.model_name, "length": self.length, "seed": self.seed,
                "protocol": self.protocol, "block_size": self.block_size, "sampling": self.sampling,
                "kv_quant": self.kv[0], "kv_group": self.kv[1]}

    @property
    def fractional(self) -> bool:
        """Budgets given as fractions of the mean dense generation length."""
        return bool(self.budgets) and isinstance(self.budgets[0], float)

    def dense_configs(self) -> list[Config]:
        return [Config(p, self.hyper_at(p, h, None)) for p, h in self.policies if p.is_dense]

    def evicting_configs(self, budgets: Mapping[int, float | None]) -> list[Config]:
        """Every evicting policy at every {budget: fraction or None}."""
        return [Config(p, self.hyper_at(p, h, b), b, f) for p, h in self.policies if not p.is_dense
                for b, f in budgets.items()]


def _check_policies(policies: Any, budgets: Any, policy_kwargs: Mapping | None, module: ModuleType,
                    name: str):
    """[(Policy, hyper)] and the sorted budgets; ValueError/TypeError naming the bad argument."""
    from vdjax.engine.policies import get_policy

    policy_kwargs = dict(policy_kwargs or {})
    pols = []
    for p in unique_list("policies", policies):
        pol = get_policy(p)
        kwargs = policy_kwargs.get(pol.name, {})
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"policy_kwargs[{pol.name!r}] must be a dict of keywords, got {kwargs!r}")
        pols.append((pol, pol.hyper(**kwargs)))
    names = [pol.name for pol, _ in pols]
    if len(set(names)) != len(names):
        raise ValueError(f"policies name the same policy twice: {names}")
    extra = sorted(k for k in policy_kwargs if k not in names)
    if extra:
        raise ValueError(f"policy_kwargs names {extra}, which are not in policies {names}")
    evicting = [pol.name for pol, _ in pols if not pol.is_dense]
    if budgets is None or (isinstance(budgets, (list, tuple)) and not budgets):
        if evicting:
            raise ValueError(f"budgets must list one or more cache budgets for the evicting policies "
                             f"{evicting}, got {budgets!r}")
        return pols, []
    if isinstance(budgets, str):
        raise TypeError(f"budgets must be a list of integers or of fractions, got the string {budgets!r}")
    budgets = unique_list("budgets", budgets)
    for b in budgets:
        if isinstance(b, float):
            if not 0 < b < 1:
                raise ValueError(f"budgets entry {b!r} is not a fraction in (0, 1) (of the average dense "
                                 "generation length); integer budgets (cache slots) must be ints >= 1")
        else:
            check_int("budgets entry", b)
    fractions = [b for b in budgets if isinstance(b, float)]
    if fractions and len(fractions) != len(budgets):
        raise ValueError(f"budgets={budgets} mixes integers (cache slots) and fractions (of the average "
                         "dense generation length); give only one kind")
    if fractions and not any(pol.is_dense for pol, _ in pols):
        raise ValueError(f"budgets={budgets} are fractions of the average dense generation length, so "
                         f"policies must include 'dense'; got policies {names}")
    if fractions and not callable(getattr(module, "budget_rule", None)):
        raise ValueError(f"budgets={budgets} are fractions, but benchmark {name!r} defines no budget_rule "
                         "(fractions -> cache budgets); give integer budgets")
    return pols, sorted(budgets)


def _check_sampling(sampling: Mapping | None, draws: Any) -> tuple[dict | None, int]:
    """(sampling settings with every key, None for greedy; draws), checked."""
    from vdjax.engine.sampling import check_sampling

    draws = check_int("draws", draws)
    if sampling is not None:
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"sampling keys {unknown} unknown; allowed: {list(SAMPLING_KEYS)}")
        sampling = {"temperature": float(sampling.get("temperature") or 0.0),
                    "top_k": int(sampling.get("top_k") or 0), "top_p": float(sampling.get("top_p") or 1.0)}
        check_sampling(sampling["temperature"], sampling["top_k"], sampling["top_p"], key=True)
        if sampling["temperature"] == 0:  # greedy whatever top_k / top_p say
            sampling = None
    if sampling is None and draws > 1:
        raise ValueError(f"draws={draws} with greedy decoding repeats one generation; give sampling="
                         "{'temperature': t > 0, ...} or draws=1")
    return sampling, draws


def check_run(params, benchmark, *, model_name, policies, budgets, length, num_samples, tasks=None, seed=None,
              protocol="paper", block_size=128, batch_size=1, data_dir=None, policy_kwargs=None, metrics=None,
              template_kwargs=None, sampling=None, draws=1, mesh=None) -> Spec:
    """Validate each argument of `evaluate` (each error names the argument) and bind policies to the model."""
    name, module = load_benchmark(benchmark)
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is unknown; allowed: {list(PROTOCOLS)}")
    seed = getattr(module, "SEED", 0) if seed is None else check_int("seed", seed, minimum=0)
    allowed = list(module.TASKS)
    tasks = allowed if tasks is None else unique_list("tasks", tasks)
    unknown = [t for t in tasks if t not in allowed]
    if unknown:
        raise ValueError(f"tasks={unknown} not in benchmark {name!r}; allowed: {allowed}")
    pols, budgets = _check_policies(policies, budgets, policy_kwargs, module, name)
    memo: dict[tuple, tuple] = {}

    def bind(pol, hyper, budget):  # e.g. hybrid's saved weights for that budget; once per (policy, budget)
        key = (pol.name, repr(hyper), budget)  # hyper may hold lists (a mix)
        if key not in memo:
            memo[key] = pol.bind_hyper(params, hyper, budget)
        return memo[key]

    for pol, hyper in pols:  # bad keywords fail now, not after the dense runs
        for b in (None,) if pol.is_dense or not budgets or isinstance(budgets[0], float) else budgets:
            bind(pol, hyper, b)
    if data_dir is not None and not Path(data_dir).is_dir():
        raise ValueError(f"data_dir={str(data_dir)!r} is not a folder")
    if metrics is None:
        from vdjax.eval.metrics import METRICS as metrics
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise TypeError(f"template_kwargs must be a dict of chat-template switches, got {template_kwargs!r}")
    sampling, draws = _check_sampling(sampling, draws)
    if num_samples is None:  # the benchmark's own default (MATH-500: the paper's first 100 problems)
        num_samples = getattr(module, "DEFAULT_SAMPLES", None)
        if num_samples is None:
            raise ValueError(f"num_samples=None: benchmark {name!r} declares no DEFAULT_SAMPLES; "
                             "give a number")
    return Spec(name, module, check_name("model_name", model_name), check_int("length", length),
                check_int("num_samples", num_samples), seed, protocol, check_int("block_size", block_size),
                check_int("batch_size", batch_size), tasks, pols, budgets,
                None if data_dir is None else Path(data_dir), metrics, dict(template_kwargs or {}), sampling,
                draws, mesh, bind)


# ---- resuming ---------------------------------------------------------------------------------------------
def check_resume(spec: Spec, path: Path, records: list[dict], print_id: str, allow_mixed: bool) -> set:
    """The keys of the lines already done; ValueError when the file holds another run's lines."""
    identity = spec.identity
    for record in records:
        for field in RUN_FIELDS:
            if record.get(field) != identity[field]:
                raise ValueError(
                    f"{path} holds results with {field}={record.get(field)!r}; this run has "
                    f"{field}={identity[field]!r}: use another out_dir (or the same {field})")
        if record.get("fingerprint") != print_id and not allow_mixed:
            raise ValueError(
                f"{path} holds results of fingerprint {record.get('fingerprint')!r} (checkpoint, dtype, "
                f"tokenizer and chat template); this run's is {print_id!r}: use another out_dir, or "
                "allow_mixed=True (CLI --allow-mixed) to add to it anyway")
    writes = None if not spec.budgets or spec.fractional else set(spec.budgets)  # None: any budget
    for pol, hyper in spec.policies:
        for record in records:
            if record["policy"] != pol.name:
                continue
            if writes is not None and not pol.is_dense and record.get("budget") not in writes:
                continue  # a budget this run does not write may hold its own hyper-parameters
            want = json.loads(json.dumps(dict(spec.hyper_at(pol, hyper, record.get("budget")))))
            if record.get("hyper") != want:
                raise ValueError(
                    f"{path} holds {pol.name!r} results with hyper-parameters {record.get('hyper')} at "
                    f"budget {record.get('budget')}; this run asks for {want}: use another out_dir")
    return {record_key(r) for r in records}


# ---- samples ----------------------------------------------------------------------------------------------
def build_samples(spec: Spec, tokenizer) -> dict[str, list[Sample]]:
    """{task: samples} from the benchmark's build; sample ids unique per task, metrics known."""
    params = inspect.signature(spec.module.build).parameters
    takes_data_dir = "data_dir" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if spec.data_dir is not None and not takes_data_dir:
        raise ValueError(f"data_dir={str(spec.data_dir)!r} given, but benchmark {spec.name!r} reads no data "
                         "folder")
    if (spec.data_dir is None and "data_dir" in params
            and params["data_dir"].default is inspect.Parameter.empty):
        raise ValueError(f"data_dir=None, but benchmark {spec.name!r} needs its data folder (data_dir=...)")
    extra = {"data_dir": spec.data_dir} if spec.data_dir is not None else {}
    if "template_kwargs" in params:
        extra["template_kwargs"] = spec.template_kwargs
    out = {}
    for task in spec.tasks:
        samples = list(spec.module.build(task, tokenizer, length=spec.length, num_samples=spec.num_samples,
                                         seed=spec.seed, **extra))
        ids = [s.id for s in samples]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"benchmark {spec.name!r} task {task!r} built duplicate sample ids {dup[:5]}")
        for s in samples:
            if not isinstance(s, Sample):
                raise TypeError(f"benchmark {spec.name!r} build must return Samples, got {type(s).__name__}")
            if s.metric not in spec.metrics:
                raise ValueError(f"sample {s.id!r} of task {task!r} has metric={s.metric!r}; "
                                 f"known: {sorted(spec.metrics)}")
        out[task] = samples
    return out


def stop_ids(tokenizer, text: str) -> tuple[int, ...]:
    """The ids that stop at `text`: those of `tokenizer(text)` that decode alone to exactly `text`.

    LongBench's pred.py stops samsum at `tokenizer.encode("\\n", add_special_tokens=False)[-1]`; keeping only
    the ids that decode to "\\n" gives that same id while dropping a SentencePiece word-start piece ("▁")
    that some tokenizers put before it. Tokens that merely contain it
    ("\\n\\n", ".\\n") do not stop. """
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    found = tuple(dict.fromkeys(i for i in ids if tokenizer.decode([i]) == text))
    if not found:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} encodes the stop string {text!r} as {ids}, "
                         "none of which decodes to it alone: it cannot stop generation")
    return found


@dataclasses.dataclass
class Rendered:
    """A sample's token ids under the protocol, and the ids that end its generation."""

    context: list[int]
    question: list[int]
    eos: tuple[int, ...]  # the model's EOS first (vdjax.run pads finished rows with the first), then stops


def render_samples(spec: Spec, tokenizer, built: dict[str, list[Sample]], model_eos) -> dict[tuple, Rendered]:
    """{(task, sample id): Rendered}; the question-agnostic protocol refuses samples without a question."""
    eos = tuple(int(e) for e in model_eos or ())
    stops: dict[str, tuple[int, ...]] = {}
    out = {}
    for task, samples in built.items():
        for s in samples:
            ctx, q = render_ids(tokenizer, s, spec.template_kwargs)
            if spec.protocol == "question_agnostic" and not q:
                raise ValueError(f"sample {s.id!r} of task {task!r} has no question tokens; the "
                                 "question_agnostic protocol needs a question after the context")
            extra = [i for text in s.stop for i in stops.setdefault(text, stop_ids(tokenizer, text))]
            out[task, s.id] = Rendered(ctx, q, eos + tuple(i for i in dict.fromkeys(extra) if i not in eos))
    return out


def batches(spec: Spec, samples: list[Sample],
            rendered: dict[tuple, Rendered]) -> list[list[tuple[Sample, int]]]:
    """(sample, draw) rows in calls of at most batch_size that stop alike and, under question_agnostic, have
    one question length; order kept within each kind."""
    kinds: dict[tuple, list[tuple[Sample, int]]] = {}
    for s in samples:
        r = rendered[s.task, s.id]
        q_len = 0 if spec.protocol == "paper" else len(r.question)
        for d in range(spec.draws):
            kinds.setdefault((r.eos, s.min_new_tokens, q_len), []).append((s, d))
    n = spec.batch_size
    return [rows[i:i + n] for rows in kinds.values() for i in range(0, len(rows), n)]


# ---- one call ---------------------------------------------------------------------------------------------
def _truncate_new(tokens, limit: int, eos: set[int]) -> tuple[list[int], bool]:
    """(a row's new tokens, at most `limit`, ending at and with the first EOS; whether it hit `limit`)."""
    row = [int(t) for t in tokens[:limit]]
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1], False
    return row, len(row) >= limit


def row_keys(seed: int, rows: list[tuple[Sample, int]]):
    """One PRNG key per (sample, draw): folded from the seed, the sample id and the draw index."""
    import jax
    import jax.numpy as jnp

    base = jax.random.key(seed)
    return jnp.stack([jax.random.fold_in(jax.random.fold_in(base, zlib.crc32(s.id.encode()) & 0x7FFFFFFF), d)
                      for s, d in rows])


def run_call(params, spec: Spec, cfg: Config, rows: list[tuple[Sample, int]], rendered, tokenizer,
             stamp: dict) -> Iterator[dict]:
    """Generate `rows` under one config in one `vdjax.run` call; yield each row's record as it is scored."""
    from vdjax.engine.timing import timed_run

    rs = [rendered[s.task, s.id] for s, _ in rows]
    max_new = max(s.max_new_tokens for s, _ in rows)
    if spec.protocol == "paper":
        ids, question = [r.context + r.question for r in rs], None
    else:
        ids, question = [r.context for r in rs], [r.question for r in rs]
    kw: dict[str, Any] = {"eos_token_id": list(rs[0].eos)} if rs[0].eos != stamp["model_eos"] else {}
    if rows[0][0].min_new_tokens:
        kw["min_new_tokens"] = rows[0][0].min_new_tokens
    if spec.sampling is not None:
        kw.update(spec.sampling, key=row_keys(spec.seed, rows))
    kw.update({} if spec.kv[0] is None else dict(kv_quant=spec.kv[0], kv_group=spec.kv[1]))
    gen, prefill_s, decode_s, compile_s = timed_run(params, ids, cfg.policy, cfg.budget,
                                                    block_size=spec.block_size, max_new_tokens=max_new,
                                                    question=question, mesh=spec.mesh, **kw,
                                                    **dict(cfg.hyper))
    per_row = gen.cache.dense_nbytes(1) // len(rows)  # one token's keys and values, unquantized
    for i, ((s, draw), r) in enumerate(zip(rows, rs, strict=False)):
        new, truncated = _truncate_new(gen.tokens[i], s.max_new_tokens, set(r.eos))
        prediction = tokenizer.decode(new, skip_special_tokens=True)
        score = float(spec.metrics[s.metric](prediction, s.answers, s))
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"metric {s.metric!r} gave score {score} for sample {s.id!r}; scores must lie "
                             "in [0, 1]")
        yield {
            **spec.identity, "task": s.task, "sample_id": s.id, "draw": draw, "policy": cfg.policy.name,
            "budget": cfg.budget, "budget_fraction": cfg.fraction, "hyper": dict(gen.hyper),
            "prediction": prediction, "answers": list(s.answers), "score": score, "metric": s.metric,
            "metric_extra": {k: s.extra[k] for k in METRIC_EXTRA if s.extra.get(k) is not None},
            "input_tokens": len(r.context) + len(r.question), "new_tokens": len(new), "truncated": truncated,
            "prefill_s": prefill_s, "decode_s": decode_s, "compile_s": compile_s, "batch": len(rows),
            "vdjax_commit": stamp["commit"], "fingerprint": stamp["fingerprint"],
            "layer_budgets": None if gen.layer_budgets is None else list(gen.layer_budgets),
            "cache_bytes": gen.cache_bytes // len(rows),
            "dense_cache_bytes": per_row * (len(r.context) + len(r.question) + len(new) - 1),
        }


# ---- fractional budgets -----------------------------------------------------------------------------------
def frozen_budgets(spec: Spec, meta: dict, dense_lengths: Sequence[int]) -> dict[int, float]:
    """{integer budget: fraction} for the run's fractions: those frozen in run.json first, the others from the
    benchmark's `budget_rule` over the dense generation lengths (then frozen too). Fractions that give one
    budget run it once, recorded under the smallest of them (with a warning)."""
    frozen = {float(f): int(b) for f, b in (meta.get("fraction_budgets") or {}).items()}
    new = [f for f in spec.budgets if f not in frozen]
    if new:
        frozen.update({float(f): int(b) for f, b in spec.module.budget_rule(new, dense_lengths).items()})
        meta["fraction_budgets"] = {str(f): b for f, b in sorted(frozen.items())}
        meta["dense_mean_new_tokens"] = sum(dense_lengths) / len(dense_lengths)
    out: dict[int, float] = {}
    for f in spec.budgets:
        b = frozen[f]
        if b in out:
            warnings.warn(f"budgets {out[b]} and {f} both give budget {b} (mean dense generation length "
                          f"{meta['dense_mean_new_tokens']:.1f} tokens); it runs once, recorded as {out[b]}",
                          stacklevel=3)
            continue
        out[b] = f
    return out


# ---- the run ----------------------------------------------------------------------------------------------
def evaluate(params, tokenizer, benchmark: str | ModuleType, *, model_name: str, policies: Sequence[str],
             budgets: Sequence[int] | Sequence[float] | None, length: int, num_samples: int,
             out_dir: str | os.PathLike, tasks: Sequence[str] | None = None, seed: int | None = None,
             protocol: str = "paper", block_size: int = 128, batch_size: int = 1,
             data_dir: str | os.PathLike | None = None,
             policy_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
             metrics: Mapping[str, Callable] | None = None, template_kwargs: Mapping[str, Any] | None = None,
             sampling: Mapping[str, float] | None = None, draws: int = 1, allow_mixed: bool = False,
             progress: bool = True, mesh=None, shard=None, kv_quant: str | None = None,
             kv_group: int | None = None) -> Path:
    """Run every (sample, policy, budget, draw) not yet in the run's predictions.jsonl; return its path.

    `benchmark`: a name of BENCHMARKS or a module (see the module docstring). `policies`: names (dense runs
    once per sample, budget null); `budgets`: cache slots per KV head for the evicting ones (ints >= 1), or
    fractions in (0, 1) of the average dense generation length (dense must be among `policies`; the
    benchmark's budget_rule applies). `seed`: None takes the benchmark's `SEED` (RULER 42), else 0.
    `policy_kwargs`: {policy name: {keyword: value}}. `batch_size` > 1 runs up to that many rows of one task
    in one ragged `vdjax.run` call. `metrics` overrides `vdjax.eval.metrics.METRICS`. `template_kwargs` reach
    the chat template (`enable_thinking`, `reasoning_effort`). `sampling` / `draws`: see the module docstring.
    `allow_mixed` resumes onto lines of another fingerprint. `mesh` (a jax Mesh,
    `vdjax.engine.sharding.make_mesh`): params are sharded on it once and each
    call's rows are split over "data"; a mesh spanning `jax.distributed` processes runs every call on all of
    them and process 0 writes the files. `shard` ("I/N", see `vdjax.eval.shards`): only the batches k with
    k % N == I, into the shard's own files (`shards.merge` combines them). `kv_quant` / `kv_group`: the
    cache's storage (`vdjax.run`), a folder of its own; lines hold cache_bytes, dense_cache_bytes per row."""
    from vdjax.engine.inputs import kv_storage

    storage = kv_storage(params.config, kv_quant, kv_group)
    spec = check_run(params, benchmark, model_name=model_name, policies=policies, budgets=budgets,
                     length=length, num_samples=num_samples, tasks=tasks, seed=seed, protocol=protocol,
                     block_size=block_size, batch_size=batch_size, data_dir=data_dir,
                     policy_kwargs=policy_kwargs, metrics=metrics, template_kwargs=template_kwargs,
                     sampling=sampling, draws=draws, mesh=mesh)
    spec.kv = (kv_quant, None if storage is None else storage[1])
    if mesh is not None:
        from vdjax.engine.sharding import shard_params

        params = shard_params(params, mesh)  # once: every call then finds its weights in place
    shard = shards.resolve(shard, mesh)
    if shard is not None and spec.fractional:
        raise ValueError(f"shard={shard[0]}/{shard[1]}: fractional budgets need every sample's dense length; "
                         "give slot budgets, or run without shards")
    if not shards.writes(mesh):
        out_dir = tempfile.mkdtemp(prefix="vdjax-eval-")  # the same lines as process 0's: only its land
    folder = run_dir(out_dir, spec.name, spec.model_name, spec.protocol, spec.length, *spec.kv)
    pred_name, meta_name = shards.names(shard)
    prints = fingerprint(params, tokenizer, spec.template_kwargs)
    stamp = {"commit": git_commit(), "fingerprint": prints["id"],
             "model_eos": tuple(int(e) for e in params.config.eos_token_ids or ())}
    with PredictionsFile(folder / pred_name) as out:
        existing = read_predictions(out.path, repair=True)
        done = check_resume(spec, out.path, existing, prints["id"], allow_mixed)
        built = build_samples(spec, tokenizer)
        rendered = render_samples(spec, tokenizer, built, stamp["model_eos"])
        meta_path = folder / meta_name
        meta = start_invocation(spec, meta_path, built, params, prints)
        loop = _Loop(spec, params, tokenizer, built, rendered, stamp, out, done, progress, shard)
        if shard is not None:  # every batch's rows, in the run's order: what `shards.merge` orders lines by
            meta |= {"shard": list(shard), "batches": loop.batch_keys()}
            write_json(meta_path, meta)
        try:
            loop.run(spec.dense_configs() if spec.fractional else
                     spec.dense_configs() + spec.evicting_configs({b: None for b in spec.budgets}))
            if spec.fractional:  # every dense run is done: budgets from the dense generation lengths
                dense = {(r["task"], r["sample_id"], r.get("draw", 0)): r["new_tokens"]
                         for r in existing + loop.written
                         if r["policy"] == spec.dense_configs()[0].policy.name}
                by_budget = frozen_budgets(spec, meta, [dense[s.task, s.id, d] for ss in built.values()
                                                        for s in ss for d in range(spec.draws)])
                meta["invocations"][-1]["fraction_budgets"] = {str(f): b for b, f in by_budget.items()}
                write_json(meta_path, meta)
                loop.run(spec.evicting_configs(by_budget))
        finally:
            loop.close()
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    if loop.written:  # a resume with nothing left to run leaves no record (a crash keeps its "started")
        meta["invocations"][-1]["finished"] = now
    else:
        meta["invocations"].pop()
    write_json(meta_path, meta)
    return out.path


class _Loop:
    """The generation loop of `evaluate`: calls grouped by task and batch, lines written as they come."""

    def __init__(self, spec, params, tokenizer, built, rendered, stamp, out, done, progress, shard=None):
        from tqdm.auto import tqdm

        (self.spec, self.params, self.tokenizer, self.built,
         self.rendered) = spec, params, tokenizer, built, rendered
        self.stamp, self.out, self.done, self.written, self.shard = stamp, out, done, [], shard
        self.rows = [(s, d) for ss in built.values() for s in ss for d in range(spec.draws)]
        self.bar = tqdm(total=0, desc=f"{spec.name} {spec.model_name} L{spec.length}", unit="gen",
                        disable=not progress, dynamic_ncols=True, mininterval=5)

    def _key(self, s: Sample, draw: int, cfg: Config) -> tuple:
        return s.task, s.id, cfg.policy.name, cfg.budget, self.spec.protocol, draw

    def batches(self) -> list[tuple[str, list]]:
        """Every (task, rows) batch of the run, in order (a shard's included or not)."""
        return [(task, rows) for task, samples in self.built.items()
                for rows in batches(self.spec, samples, self.rendered)]

    def batch_keys(self) -> list[list]:
        """Each batch's rows as [task, sample id, draw]."""
        return [[[s.task, s.id, d] for s, d in rows] for _, rows in self.batches()]

    def run(self, cfgs: list[Config]) -> None:
        """Generate and write every (row, config) of `cfgs` not yet done (of this shard's batches), task by
        task, batch by batch."""
        todo_batches = [(t, rows) for k, (t, rows) in enumerate(self.batches()) if shards.mine(self.shard, k)]
        rows_all = [r for _, rows in todo_batches for r in rows]
        self.bar.total += len(rows_all) * len(cfgs)
        self.bar.update(sum(self._key(s, d, c) in self.done for s, d in rows_all for c in cfgs))
        for task, rows in todo_batches:
            for cfg in cfgs:
                todo = [(s, d) for s, d in rows if self._key(s, d, cfg) not in self.done]
                if not todo:
                    continue
                self.bar.set_postfix_str(f"{task} {cfg.policy.name} {cfg.budget or ''}".rstrip(),
                                         refresh=False)
                for record in run_call(self.params, self.spec, cfg, todo, self.rendered, self.tokenizer,
                                       self.stamp):
                    self.out.append(record)
                    self.written.append(record)
                    self.done.add(record_key(record))
                    self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

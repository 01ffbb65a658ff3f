"""Run a benchmark under every (policy, budget) and append one scored JSON line per result, resumably.

    path = evaluate(params, tokenizer, "ruler", model_name="smollm2-135m", policies=["dense", "valuediff"],
                    budgets=[256, 512], length=4096, num_samples=20, out_dir="results")
    # results/ruler/smollm2-135m/paper/L4096/predictions.jsonl (+ run.json beside it)

Each line is one (sample, policy, budget): written, flushed and fsynced as soon as it is scored, so a crash
loses at most the result being written. A rerun into the same folder reads the file, drops a torn last line
and skips every (task, sample_id, policy, budget, protocol) it already holds. Dense runs once per sample with
`budget` null. Decoding is greedy and stops at the model's EOS, and for a sample with
`extra["stop_at_newline"]` (LongBench samsum) also at the newline token (`newline_ids`), and, as pred.py's
`min_length = prompt + 1`, the first new token can be neither EOS nor the newline (`min_new_tokens=1`).

Budgets are either all integers >= 1 (cache slots per KV head) or all fractions in (0, 1) of the average dense
generation length (MATH-500, Appendix F): then every dense run finishes first, the integer budgets follow from
the recorded dense `new_tokens` with `vdjax.eval.math500.fraction_budgets` (mean over every sample of the run,
rounded to the nearest power of two), and each evicting record keeps `budget` (that integer) and
`budget_fraction`.

Protocols (see `vdjax.eval.sample`): `paper` block-prefills context + question; `question_agnostic`
block-prefills the context only and appends the question afterwards (`vdjax.run(..., question=...)`).
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import json
import os
import platform
import subprocess
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, Sequence

from vdjax.eval.sample import PROTOCOLS, Sample, render_ids

BENCHMARKS = ("ruler", "longbench", "math500")
KEY_FIELDS = ("task", "sample_id", "policy", "budget", "protocol")
# a resumed run must agree with the file on these (other fields may change between runs: tasks, budgets, ...)
RUN_FIELDS = ("benchmark", "model", "length", "seed", "protocol", "block_size")
# prefill_s / decode_s: wall time of the whole batch's call (`batch` rows), jit compilation taken out
# (compile_s); prefill_s is the time to the first token.
RECORD_FIELDS = (
    "benchmark", "task", "sample_id", "model", "length", "seed", "protocol", "policy", "budget",
    "budget_fraction", "block_size", "hyper", "prediction", "answers", "score", "input_tokens", "new_tokens",
    "prefill_s", "decode_s", "compile_s", "batch",
)


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


def _check_name(argument: str, value: Any) -> str:
    """A non-empty string usable as one folder name, or a ValueError naming the argument."""
    if not isinstance(value, str) or not value or value in (".", "..") or "/" in value or os.sep in value:
        raise ValueError(f"{argument} must be a non-empty name without path separators, got {value!r}")
    return value


def run_dir(out_dir: str | os.PathLike, benchmark: str, model_name: str, protocol: str, length: int) -> Path:
    """The folder of one run: out_dir/<benchmark>/<model_name>/<protocol>/L<length>."""
    return Path(out_dir) / benchmark / model_name / protocol / f"L{length}"


def record_key(record: Mapping[str, Any]) -> tuple:
    """The resume key of a prediction line: (task, sample_id, policy, budget, protocol)."""
    return tuple(record[f] for f in KEY_FIELDS)


# ---- the predictions file ---------------------------------------------------------------------------------
def _parse_line(raw: bytes) -> dict | None:
    """The JSON object of one line holding every key field, or None."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or any(f not in record for f in KEY_FIELDS):
        return None
    return record


def read_predictions(path: str | os.PathLike, *, repair: bool = False) -> list[dict]:
    """Every record of a predictions.jsonl (a torn last line, from a crash mid-write, is skipped).

    With `repair=True` the file itself is fixed: a torn last line is cut off, a complete last line missing
    its newline gets one. A bad line anywhere else is corruption: ValueError naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        record = _parse_line(raw)
        if record is None:
            if number == len(lines) and not tail:  # last line, newline written but content cut: torn
                if repair:
                    _truncate(path, len(data) - len(raw) - 1)
                continue
            raise ValueError(f"{path}: line {number} is not a prediction record: {raw[:80]!r}")
        records.append(record)
    if tail.strip():
        record = _parse_line(tail)
        if record is not None:
            records.append(record)
            if repair:
                with open(path, "ab") as f:
                    f.write(b"\n")
                    f.flush()
                    os.fsync(f.fileno())
        elif repair:
            _truncate(path, len(data) - len(tail))
    return records


def _truncate(path: Path, size: int) -> None:
    """Cut the file to `size` bytes, durably."""
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


class _Appender:
    """Appends JSON lines, each flushed and fsynced before the call returns."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


# ---- run metadata -----------------------------------------------------------------------------------------
def git_commit() -> str | None:
    """The vdjax source tree's git commit (suffixed `-dirty` with uncommitted changes), or None."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def _environment() -> dict:
    """jax version, backend and devices, vdjax commit, host."""
    import jax

    return {
        "vdjax_commit": git_commit(),
        "jax_version": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "host": platform.node(),
    }


def _write_json(path: Path, obj: dict) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# ---- argument checking ------------------------------------------------------------------------------------
def _check_int(argument: str, value: Any, minimum: int = 1) -> int:
    """value as an int >= minimum, or a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{argument} must be an integer >= {minimum}, got {value!r}")
    return value


def _names(argument: str, values: Any) -> list:
    """A non-empty list from a comma-separated string or a sequence, duplicates dropped (order kept)."""
    if isinstance(values, str):
        values = [v.strip() for v in values.split(",") if v.strip()]
    if not isinstance(values, Iterable):
        raise TypeError(f"{argument} must be a list, got {type(values).__name__}: {values!r}")
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError(f"{argument} must name at least one entry, got {values!r}")
    return out


def _check_tasks(module: ModuleType, name: str, tasks: Any) -> list[str]:
    """The requested tasks (all of the benchmark's when None), each one of module.TASKS."""
    allowed = list(module.TASKS)
    if tasks is None:
        return allowed
    tasks = _names("tasks", tasks)
    unknown = [t for t in tasks if t not in allowed]
    if unknown:
        raise ValueError(f"tasks={unknown} not in benchmark {name!r}; allowed: {allowed}")
    return tasks


def _check_policies(policies: Any, budgets: Any, policy_kwargs: Mapping | None):
    """[(Policy, hyper)] and the budgets; ValueError/TypeError naming the bad argument."""
    from vdjax.policies import get_policy

    policy_kwargs = dict(policy_kwargs or {})
    pols = []
    for p in _names("policies", policies):
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
    evicting = [pol for pol, _ in pols if not pol.is_dense]
    if budgets is None or (isinstance(budgets, (list, tuple)) and not budgets):
        if evicting:
            raise ValueError(f"budgets must list one or more cache budgets for the evicting policies "
                             f"{[p.name for p in evicting]}, got {budgets!r}")
        return pols, []
    if isinstance(budgets, str):
        raise TypeError(f"budgets must be a list of integers or of fractions, got the string {budgets!r}")
    budgets = _names("budgets", budgets)
    for b in budgets:
        if isinstance(b, float):
            if not 0 < b < 1:
                raise ValueError(f"budgets entry {b!r} is not a fraction in (0, 1) (of the average dense "
                                 "generation length); integer budgets (cache slots) must be ints >= 1")
        else:
            _check_int("budgets entry", b)
    fractions = [b for b in budgets if isinstance(b, float)]
    if fractions and len(fractions) != len(budgets):
        raise ValueError(f"budgets={budgets} mixes integers (cache slots) and fractions (of the average "
                         "dense generation length); give only one kind")
    if fractions and not any(pol.is_dense for pol, _ in pols):
        raise ValueError(f"budgets={budgets} are fractions of the average dense generation length, so "
                         f"policies must include 'dense'; got policies {names}")
    return pols, sorted(budgets)


def _build_samples(module: ModuleType, name: str, tokenizer, tasks: Sequence[str], *, length: int,
                   num_samples: int, seed: int, data_dir) -> dict[str, list[Sample]]:
    """{task: samples} from the benchmark's build, sample ids checked unique per task."""
    params = inspect.signature(module.build).parameters
    takes_data_dir = "data_dir" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if data_dir is not None and not takes_data_dir:
        raise ValueError(f"data_dir={str(data_dir)!r} given, but benchmark {name!r} reads no data folder")
    if data_dir is None and "data_dir" in params and params["data_dir"].default is inspect.Parameter.empty:
        raise ValueError(f"data_dir=None, but benchmark {name!r} needs its data folder (data_dir=...)")
    extra = {"data_dir": data_dir} if data_dir is not None else {}
    out = {}
    for task in tasks:
        samples = list(module.build(task, tokenizer, length=length, num_samples=num_samples, seed=seed,
                                    **extra))
        ids = [s.id for s in samples]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"benchmark {name!r} task {task!r} built duplicate sample ids {dup[:5]}")
        for s in samples:
            if not isinstance(s, Sample):
                raise TypeError(f"benchmark {name!r} build must return Samples, got {type(s).__name__}")
        out[task] = samples
    return out


def _stops_at_newline(sample: Sample) -> bool:
    """True when the sample's generation also stops at a newline (`extra["stop_at_newline"]`)."""
    return bool(sample.extra.get("stop_at_newline"))


def _groups(samples: list[Sample], rendered: dict, protocol: str, batch_size: int) -> list[list[Sample]]:
    """Batches of at most batch_size samples that stop alike (newline or not) and, under question_agnostic,
    have one question length; order kept within each kind."""
    buckets: dict[tuple, list[Sample]] = {}
    for s in samples:
        q_len = 0 if protocol == "paper" else len(rendered[s.id][1])
        buckets.setdefault((_stops_at_newline(s), q_len), []).append(s)
    return [group[i:i + batch_size] for group in buckets.values() for i in range(0, len(group), batch_size)]


# ---- the run ----------------------------------------------------------------------------------------------
def newline_ids(tokenizer) -> tuple[int, ...]:
    """The newline stop id(s): the ids of `tokenizer("\\n")` that decode alone to exactly "\\n".

    LongBench's pred.py stops samsum at `tokenizer.encode("\\n", add_special_tokens=False)[-1]`; keeping only
    the ids that decode to "\\n" gives that same id while dropping a SentencePiece word-start piece ("▁")
    that some tokenizers put before it. Tokens that merely contain a newline ("\\n\\n", ".\\n") do not
    stop, as in pred.py (the scorer's first-line cut handles them).
    """
    ids = [int(i) for i in tokenizer("\n", add_special_tokens=False)["input_ids"]]
    found = tuple(dict.fromkeys(i for i in ids if tokenizer.decode([i]) == "\n"))
    if not found:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} encodes '\\n' as {ids}, none of which "
                         "decodes to '\\n': samples with extra['stop_at_newline'] cannot stop at a newline")
    return found


def _truncate_new(tokens, limit: int, eos: set[int]) -> list[int]:
    """A row's new tokens, at most `limit`, ending at (and including) the first EOS."""
    row = [int(t) for t in tokens[:limit]]
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


def _fraction_budgets(fractions: Sequence[float], dense_lengths: Sequence[int]) -> dict[int, float]:
    """{integer budget: fraction} from the dense generation lengths (`math500.fraction_budgets`, pow2).

    Fractions that round to one budget run it once, recorded under the smallest of them (with a warning).
    """
    from vdjax.eval.math500 import fraction_budgets

    out: dict[int, float] = {}
    for f, b in sorted(fraction_budgets(dense_lengths, fractions).items()):
        if b in out:
            warnings.warn(f"budgets {out[b]} and {f} both give budget {b} (mean dense generation length "
                          f"{sum(dense_lengths) / len(dense_lengths):.1f} tokens); it runs once, recorded "
                          f"as {out[b]}", stacklevel=3)
            continue
        out[b] = f
    return out


def evaluate(
    params,
    tokenizer,
    benchmark: str | ModuleType,
    *,
    model_name: str,
    policies: Sequence[str],
    budgets: Sequence[int] | Sequence[float] | None,
    length: int,
    num_samples: int,
    out_dir: str | os.PathLike,
    tasks: Sequence[str] | None = None,
    seed: int = 0,
    protocol: str = "paper",
    block_size: int = 128,
    batch_size: int = 1,
    data_dir: str | os.PathLike | None = None,
    policy_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    metrics: Mapping[str, Callable] | None = None,
    progress: bool = True,
    mesh=None,
) -> Path:
    """Run every (sample, policy, budget) not yet in the run's predictions.jsonl; return that file's path.

    `benchmark`: a name of BENCHMARKS or a module with TASKS and build(task, tokenizer, *, length,
    num_samples, seed[, data_dir]). `policies`: names (dense runs once per sample, budget null); `budgets`:
    cache slots per KV head for the evicting ones (ints >= 1), or fractions in (0, 1) of the average dense
    generation length (dense must be among `policies`; it all runs first, see the module docstring).
    `policy_kwargs`: {policy name: {keyword: value}}. `batch_size` > 1 runs up to that many samples of one
    task in one ragged `vdjax.run` call (only samples that stop alike at newlines, and under
    question_agnostic of equal question length, share a call). `metrics` overrides
    `vdjax.eval.metrics.METRICS` ({name: fn(prediction, answers, sample) -> [0, 1]}). `mesh` (a jax Mesh with
    axes "data" and "model", `vdjax.sharding.make_mesh`): params are sharded on it once and each call's
    `batch_size` samples are split over "data" (best a multiple of its size; heads / MLP width over "model").
    """
    from vdjax.cli import timed_run

    name, module = load_benchmark(benchmark)
    model_name = _check_name("model_name", model_name)
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is unknown; allowed: {list(PROTOCOLS)}")
    length = _check_int("length", length)
    num_samples = _check_int("num_samples", num_samples)
    block_size = _check_int("block_size", block_size)
    batch_size = _check_int("batch_size", batch_size)
    seed = _check_int("seed", seed, minimum=0)
    tasks = _check_tasks(module, name, tasks)
    pols, budgets = _check_policies(policies, budgets, policy_kwargs)
    pols = [(pol, pol.bind_hyper(params, hyper)) for pol, hyper in pols]  # e.g. hybrid's saved weights
    if data_dir is not None and not Path(data_dir).is_dir():
        raise ValueError(f"data_dir={str(data_dir)!r} is not a folder")
    if metrics is None:
        from vdjax.eval.metrics import METRICS as metrics
    if mesh is not None:
        from vdjax.sharding import shard_params

        params = shard_params(params, mesh)  # once: every call then finds its weights in place

    folder = run_dir(out_dir, name, model_name, protocol, length)
    folder.mkdir(parents=True, exist_ok=True)
    pred_path, meta_path = folder / "predictions.jsonl", folder / "run.json"
    identity = {"benchmark": name, "model": model_name, "length": length, "seed": seed, "protocol": protocol,
                "block_size": block_size}
    existing = read_predictions(pred_path, repair=True)
    done = set()
    for record in existing:
        for field in RUN_FIELDS:
            if record.get(field) != identity[field]:
                raise ValueError(
                    f"{pred_path} holds results with {field}={record.get(field)!r}; this run has "
                    f"{field}={identity[field]!r}: use another out_dir (or the same {field})"
                )
        done.add(record_key(record))
    for pol, hyper in pols:
        want = json.loads(json.dumps(dict(hyper)))
        for record in existing:
            if record["policy"] == pol.name and record.get("hyper") != want:
                raise ValueError(
                    f"{pred_path} holds {pol.name!r} results with hyper-parameters {record.get('hyper')}; "
                    f"this run asks for {want}: use another out_dir"
                )

    built = _build_samples(module, name, tokenizer, tasks, length=length, num_samples=num_samples, seed=seed,
                           data_dir=data_dir)
    for task, samples in built.items():
        for s in samples:
            if s.metric not in metrics:
                raise ValueError(f"sample {s.id!r} of task {task!r} has metric={s.metric!r}; "
                                 f"known: {sorted(metrics)}")
    fractional = bool(budgets) and isinstance(budgets[0], float)
    dense_cfgs = [(pol, hyper, None, None) for pol, hyper in pols if pol.is_dense]
    evicting = [(pol, hyper) for pol, hyper in pols if not pol.is_dense]

    def evicting_cfgs(by_budget: Mapping[int, float | None]) -> list[tuple]:
        """(policy, hyper, budget, budget_fraction) of every evicting policy at every budget."""
        return [(pol, hyper, b, f) for pol, hyper in evicting for b, f in by_budget.items()]

    if fractional:  # phase 1: dense only; the evicting configs follow once every dense length is known
        configs = dense_cfgs
    else:
        configs = [(pol, hyper, b, None) for pol, hyper in pols
                   for b in ([None] if pol.is_dense else budgets)]

    all_samples = [s for ss in built.values() for s in ss]
    stop_ids = newline_ids(tokenizer) if any(_stops_at_newline(s) for s in all_samples) else ()

    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta.update(identity)
    invocation = {
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "tasks": tasks, "num_samples": num_samples, "samples": {t: len(s) for t, s in built.items()},
        "policies": [pol.name for pol, _ in pols], "budgets": budgets,
        "hyper": {pol.name: dict(hyper) for pol, hyper in pols}, "batch_size": batch_size,
        "data_dir": None if data_dir is None else str(data_dir), "model_config": _model_summary(params),
        "mesh": None if mesh is None else dict(mesh.shape),
        **_environment(),
    }
    meta["invocations"] = meta.get("invocations", []) + [invocation]
    _write_json(meta_path, meta)

    eos = set(int(e) for e in (params.config.eos_token_ids or ()))
    # the run's EOS plus the newline, the model's EOS first (vdjax.run pads finished rows with the first one)
    newline_eos = sorted(eos) + [i for i in stop_ids if i not in eos]
    dense_new: dict[tuple[str, str], int] = {
        (r["task"], r["sample_id"]): int(r["new_tokens"]) for r in existing
        if dense_cfgs and r["policy"] == dense_cfgs[0][0].name}

    def count_done(cfgs) -> int:
        """How many (sample, config) of `cfgs` the file already holds."""
        return sum((s.task, s.id, pol.name, b, protocol) in done
                   for s in all_samples for pol, _, b, _ in cfgs)

    rendered, groups = {}, {}
    for task, samples in built.items():
        rendered[task] = {s.id: render_ids(tokenizer, s) for s in samples}
        if protocol == "question_agnostic":
            empty = [s.id for s in samples if not rendered[task][s.id][1]]
            if empty:
                raise ValueError(f"samples {empty[:5]} of task {task!r} have no question tokens; the "
                                 "question_agnostic protocol needs a question after the context")
        groups[task] = _groups(samples, rendered[task], protocol, batch_size)

    from tqdm.auto import tqdm

    planned = len(configs) + (len(evicting) * len(budgets) if fractional else 0)
    bar = tqdm(total=len(all_samples) * planned, initial=count_done(configs),
               desc=f"{name} {model_name} L{length}", unit="gen", disable=not progress, dynamic_ncols=True)
    writer = _Appender(pred_path)

    def generate(cfgs) -> None:
        """Run and write every (sample, config) of `cfgs` not yet done, group by group."""
        for task in built:
            for group in groups[task]:
                for pol, hyper, budget, fraction in cfgs:
                    todo = [s for s in group if (s.task, s.id, pol.name, budget, protocol) not in done]
                    if not todo:
                        continue
                    bar.set_postfix_str(f"{task} {pol.name} {budget or ''}".rstrip(), refresh=False)
                    ctx = [rendered[task][s.id][0] for s in todo]
                    qs = [rendered[task][s.id][1] for s in todo]
                    max_new = max(s.max_new_tokens for s in todo)
                    if protocol == "paper":
                        ids, question = [c + q for c, q in zip(ctx, qs)], None
                    else:
                        ids, question = ctx, qs
                    stop = _stops_at_newline(todo[0])  # a group never mixes the two (_groups)
                    # pred.py: min_length = prompt + 1 keeps EOS and the newline off the first token
                    stop_kw = {"eos_token_id": newline_eos, "min_new_tokens": 1} if stop else {}
                    row_eos = set(newline_eos) if stop else eos
                    gen, prefill_s, decode_s, compile_s = timed_run(
                        params, ids, pol, budget, block_size=block_size, max_new_tokens=max_new,
                        question=question, mesh=mesh, **stop_kw, **dict(hyper))
                    for r, s in enumerate(todo):
                        new = _truncate_new(gen.tokens[r], s.max_new_tokens, row_eos)
                        prediction = tokenizer.decode(new, skip_special_tokens=True)
                        score = float(metrics[s.metric](prediction, s.answers, s))
                        if not 0.0 <= score <= 1.0:
                            raise ValueError(f"metric {s.metric!r} gave score {score} for sample {s.id!r}; "
                                             "scores must lie in [0, 1]")
                        writer.write({
                            **identity, "task": s.task, "sample_id": s.id, "policy": pol.name,
                            "budget": budget, "budget_fraction": fraction,
                            "hyper": dict(gen.hyper), "prediction": prediction, "answers": list(s.answers),
                            "score": score, "input_tokens": len(ctx[r]) + len(qs[r]), "new_tokens": len(new),
                            "prefill_s": prefill_s, "decode_s": decode_s, "compile_s": compile_s,
                            "batch": len(todo),
                        })
                        done.add((s.task, s.id, pol.name, budget, protocol))
                        if pol.is_dense:
                            dense_new[s.task, s.id] = len(new)
                        bar.update(1)

    try:
        generate(configs)
        if fractional:  # every dense run is done: budgets from the mean dense generation length
            lengths = [dense_new[s.task, s.id] for s in all_samples]
            by_budget = _fraction_budgets(budgets, lengths)
            invocation["dense_mean_new_tokens"] = sum(lengths) / len(lengths)
            invocation["fraction_budgets"] = {str(f): b for b, f in by_budget.items()}  # those that run
            _write_json(meta_path, meta)
            cfgs = evicting_cfgs(by_budget)
            bar.total = len(all_samples) * (len(configs) + len(cfgs))
            bar.update(count_done(cfgs))
            generate(cfgs)
    finally:
        writer.close()
        bar.close()
    meta["invocations"][-1]["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    _write_json(meta_path, meta)
    return pred_path


def _model_summary(params) -> dict:
    """The model's family and sizes (from its config), for run.json."""
    cfg = params.config
    return {k: getattr(cfg, k) for k in ("family", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                         "hidden_size", "vocab_size") if hasattr(cfg, k)}

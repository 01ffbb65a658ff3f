"""Rows of the summary tables: per-policy scores and retention of dense, and MATH-500's Table 10 rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

ALL_TASKS = "all"  # the `task` of a row averaging over tasks


@dataclasses.dataclass
class Cell:
    """One policy at one budget: mean score (0-100), retention (% of dense), result and paired counts.

    `paired` counts the samples dense has too; retention is None when there are none,
    or when dense scores 0 on them.
    """

    score: float | None
    retention: float | None
    n: int
    paired: int = 0


@dataclasses.dataclass
class Row:
    """One row of a table: a model at a budget (None = dense only), over all tasks or one task."""

    benchmark: str
    protocol: str
    length: int
    model: str
    task: str
    budget: int | None
    dense: Cell
    cells: dict[str, Cell]
    best: list[str]
    fraction: float | None = None  # the budget as a fraction of the mean dense generation length, if run so


def retention(score: float | None, dense: float | None) -> float | None:
    """score / dense in percent (`metrics.retention`); None when either is missing or dense is 0."""
    from vdjax.eval import metrics

    return None if score is None or dense is None else metrics.retention(score, dense)


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def task_mean(scores: dict[str, dict[str, float]], keep=None) -> float | None:
    """Mean over tasks of each task's mean score (x100); `keep(task, sample_id)` filters the samples."""
    means = []
    for task, by_id in scores.items():
        vals = [v for sid, v in by_id.items() if keep is None or keep(task, sid)]
        if vals:
            means.append(100.0 * sum(vals) / len(vals))
    return _mean(means)


def paired_difference(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]], *, level: float = 0.95,
                      resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float] | None:
    """Score difference a - b (x100, the task-mean of each task's mean paired difference, as the table cells
    average) on the samples both have, with a `level` percentile bootstrap interval: samples resampled with
    replacement within each task -> (difference, low, high); None when no sample is shared.
    a, b: {task: {sample id: score}}."""
    import numpy as np

    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    diffs = [np.array([a[t][i] - b[t][i] for i in sorted(a[t].keys() & b[t].keys())], np.float64)
             for t in sorted(a.keys() & b.keys())]
    diffs = [d for d in diffs if d.size]
    if not diffs:
        return None
    rng = np.random.default_rng(seed)
    boot = np.mean([d[rng.integers(0, d.size, (resamples, d.size))].mean(axis=1) for d in diffs], axis=0)
    low, high = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return 100 * float(np.mean([d.mean() for d in diffs])), 100 * float(low), 100 * float(high)


def _policy_order(names: Iterable[str]) -> list[str]:
    """Evicting policies in registry order, then any others alphabetically (dense excluded)."""
    try:
        from vdjax.engine.policies import POLICIES

        registered = [p for p in POLICIES if p != "dense"]
    except ImportError:  # pragma: no cover - vdjax is always importable next to this module
        registered = []
    names = set(names) - {"dense"}
    return [p for p in registered if p in names] + sorted(names - set(registered))


def table_rows(records: list[dict]) -> tuple[list[Row], list[Row], list[str]]:
    """Overall rows and per-task rows of every (benchmark, protocol, length, model)."""
    # scores[(group, model)][(policy, budget)][task][sample_id] = score
    scores: dict[tuple, dict[tuple, dict[str, dict[str, float]]]] = {}
    fractions: dict[tuple, set] = {}  # (group, model, budget) -> budget_fraction values of its records
    for r in records:
        gm = (r["benchmark"], r["protocol"], r["length"], r["model"])
        cfg = ("dense", None) if r["policy"] == "dense" else (r["policy"], r["budget"])
        if r["policy"] != "dense" and r.get("budget_fraction") is not None:
            fractions.setdefault(gm + (r["budget"],), set()).add(r["budget_fraction"])
        by_task = scores.setdefault(gm, {}).setdefault(cfg, {}).setdefault(r["task"], {})
        by_task.setdefault(r["sample_id"], []).append(float(r["score"]))
    for by_cfg in scores.values():  # a sample's score: the mean over its draws (flex@k; one draw when greedy)
        for by_task in by_cfg.values():
            for by_id in by_task.values():
                for sid, draws in by_id.items():
                    by_id[sid] = sum(draws) / len(draws)
    policies = _policy_order(p for by_cfg in scores.values() for p, _ in by_cfg)
    rows, task_rows = [], []
    for gm in sorted(scores, key=lambda k: (k[0], k[1], k[2], k[3])):
        by_cfg = scores[gm]
        dense = by_cfg.get(("dense", None), {})
        budgets = sorted({b for p, b in by_cfg if p != "dense"}) or [None]
        tasks = sorted({t for by_task in by_cfg.values() for t in by_task})
        for task in [ALL_TASKS] + tasks:
            for budget in budgets:
                row = _row(gm, task, budget, dense, by_cfg, policies)
                fr = fractions.get(gm + (budget,), set())
                row.fraction = next(iter(fr)) if len(fr) == 1 else None
                (rows if task == ALL_TASKS else task_rows).append(row)
    task_rows.sort(key=lambda r: (r.benchmark, r.protocol, r.length, r.model, r.task, r.budget or 0))
    return rows, task_rows, policies


def _select(by_task: dict[str, dict[str, float]], task: str) -> dict[str, dict[str, float]]:
    """All tasks, or one."""
    return by_task if task == ALL_TASKS else ({task: by_task[task]} if task in by_task else {})


def _row(gm: tuple, task: str, budget, dense_all: dict, by_cfg: dict, policies: list[str]) -> Row:
    """One row: dense and every policy at `budget`, over all tasks or one."""
    dense = _select(dense_all, task)
    n_dense = sum(len(v) for v in dense.values())
    dense_cell = Cell(task_mean(dense), None, n_dense, n_dense)
    cells = {}
    for p in policies:
        mine = _select(by_cfg.get((p, budget), {}), task)
        if not mine:
            continue

        def paired(t, sid, mine=mine):  # samples this policy and dense both have
            return sid in dense.get(t, {}) and sid in mine.get(t, {})

        n_paired = sum(1 for t, by_id in mine.items() for sid in by_id if paired(t, sid))
        ret = retention(task_mean(mine, paired), task_mean(dense, paired)) if n_paired else None
        cells[p] = Cell(task_mean(mine), ret, sum(len(v) for v in mine.values()), n_paired)
    ranked = [p for p, c in cells.items() if c.retention is not None]
    key = (lambda p: cells[p].retention) if ranked else (lambda p: cells[p].score)
    ranked = ranked or list(cells)
    top = max((key(p) for p in ranked), default=None)
    best = [p for p in ranked if top is not None and abs(key(p) - top) <= 1e-9]
    return Row(*gm, task, budget, dense_cell, cells, best)


# ---- MATH-500: the paper's Table 10 columns -------------------------------------------------------------
MATH_METRICS = ("grade_answer", "math_equiv")  # lines scored on their last \boxed{} answer


@dataclasses.dataclass
class MathRow:
    """MATH-500 under one policy at one budget (None = dense): Table 10's columns, over `problems` problems.

    flex / exact / pass_ / math_equiv are means over problems of flex@k, exact@k, pass@k, math_equiv@k (0-1);
    tokens, empty_pct and trunc_pct are per generation (None when no line records them); retention is flex@k
    in % of dense on the `paired` problems both have (None when there are
    none or dense scores 0 there). """

    benchmark: str
    protocol: str
    length: int
    model: str
    policy: str
    budget: int | None
    fraction: float | None
    problems: int
    k: tuple[int, int]  # fewest and most draws of a problem
    flex: float
    exact: float
    pass_: float
    math_equiv: float
    tokens: float | None
    empty_pct: float
    trunc_pct: float | None
    retention: float | None = None
    paired: int = 0
    flex_by_problem: dict = dataclasses.field(default_factory=dict, repr=False)  # (task, sample_id) -> flex@k


def is_math(record: dict) -> bool:
    """A line scored on its boxed answer (MATH-500)."""
    return record.get("metric") in MATH_METRICS or record.get("benchmark") == "math500"


def _math_scores(record: dict) -> dict[str, float]:
    """One line's flex / exact / math_equiv / empty; the stored score stands in for its own metric."""
    from vdjax.eval.metrics import math_draw

    out = math_draw(record["prediction"], record["answers"])
    if record.get("metric") == "grade_answer":
        out["flex"] = float(record["score"])
    elif record.get("metric") == "math_equiv":
        out["math_equiv"] = float(record["score"])
    return out


def _percent(flags: list) -> float | None:
    """100 x the share of true flags; None for no flags."""
    return 100.0 * sum(map(bool, flags)) / len(flags) if flags else None


def _math_row(key: tuple, lines: list[dict], fraction: float | None) -> MathRow:
    """The MathRow of one (benchmark, protocol, length, model, policy, budget) from its lines."""
    from vdjax.eval.metrics import math_at_k

    draws: dict[tuple, list[dict]] = {}  # (task, sample_id) -> that problem's draws' scores
    for r in lines:
        draws.setdefault((r["task"], r["sample_id"]), []).append(_math_scores(r))
    at_k = {p: math_at_k(d) for p, d in draws.items()}

    def mean_of(metric: str) -> float:
        return sum(v[metric] for v in at_k.values()) / len(at_k)

    counts = [len(d) for d in draws.values()]
    return MathRow(*key, fraction=fraction, problems=len(draws), k=(min(counts), max(counts)),
                   flex=mean_of("flex"), exact=mean_of("exact"), pass_=mean_of("pass"),
                   math_equiv=mean_of("math_equiv"),
                   tokens=_mean(r["new_tokens"] for r in lines if r.get("new_tokens") is not None),
                   empty_pct=_percent([s["empty"] for d in draws.values() for s in d]),
                   trunc_pct=_percent([r["truncated"] for r in lines if r.get("truncated") is not None]),
                   flex_by_problem={p: v["flex"] for p, v in at_k.items()})


def _math_retention(row: MathRow, dense: MathRow | None) -> None:
    """Set row.retention: flex@k in % of dense flex@k on the problems both have."""
    if dense is None or row is dense:
        return
    both = [p for p in row.flex_by_problem if p in dense.flex_by_problem]
    row.paired = len(both)
    if both:
        row.retention = retention(_mean(row.flex_by_problem[p] for p in both),
                                  _mean(dense.flex_by_problem[p] for p in both))


def math_rows(records: list[dict]) -> list[MathRow]:
    """One MathRow per (benchmark, protocol, length, model, policy, budget) of MATH-500 lines; dense first."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if is_math(r):
            budget = None if r["policy"] == "dense" else r["budget"]
            groups.setdefault((r["benchmark"], r["protocol"], r["length"], r["model"], r["policy"], budget),
                              []).append(r)
    order = {p: i for i, p in enumerate(["dense"] + _policy_order(k[4] for k in groups))}
    rows = []
    for key in sorted(groups, key=lambda k: (k[:4], k[5] is not None, k[5] or 0, order[k[4]])):
        fr = {r.get("budget_fraction") for r in groups[key]} - {None}
        rows.append(_math_row(key, groups[key], next(iter(fr)) if len(fr) == 1 else None))
    dense = {_model_of(r): r for r in rows if r.policy == "dense"}
    for r in rows:
        _math_retention(r, dense.get(_model_of(r)))
    return rows


def _model_of(row: MathRow) -> tuple:
    """(benchmark, protocol, length, model) of a row: the rows that share a dense reference."""
    return row.benchmark, row.protocol, row.length, row.model

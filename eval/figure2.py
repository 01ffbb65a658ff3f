"""The paper's Figure 2 for our models: the ValueDiff − KeyDiff retention gap against the KV geometry.

    paths = figure2("results/thesis", "results/geometry", "results/thesis/figure2")
    python -m vdjax.eval.figure2 --results results/thesis --geometry results/geometry \\
        --out results/thesis/figure2

Joins `vdjax analyze` geometry (GEOMETRY/<model>/geometry.json: σV/σK, BOS key cosine, sink rate) with the
eval predictions under RESULTS
(<benchmark>/<model>/<protocol>/L<length>/predictions.jsonl) and writes, into OUT:

- figure2.md: a table (model, source, σV/σK, BOS key cos, sink rate, budget, ValueDiff and KeyDiff retention,
  gap in points, tasks/samples used), our models first, then the paper's; then, where a model mixes attention
  kinds (Gemma3: sliding-window and global layers), σV/σK, BOS key cos and sink rate per layer group;
- figure2.csv (the main table) and figure2_groups.csv (the layer groups);
- figure2.png: gap vs σV/σK (left) and gap vs BOS key cosine (right); our models filled, the paper's hollow
  grey squares, each labelled. A marker is the mean gap over the budgets (the paper's Figure 2 colours by it:
  Gemma2-9B's "+0.6 pt", §4.4, is the mean of its Table 1 gaps +0.4 and +0.7), its bar the per-budget range.
  Layer-group points (small triangles) share their model's gap: the gap is only measured per model.

Gap = retention(valuediff) − retention(keydiff) in percentage points, retention = policy score / dense score
(mean over tasks of per-task means, `report`'s definition), per budget, over only the samples that dense,
valuediff and keydiff all have at that budget (a run in progress has finished different samples per policy).

The paper's points: σV/σK and sink rate from its Table 4, BOS key cosine from its Table 5 (both
`vdjax.analysis.geometry.PAPER`), the KeyDiff/ValueDiff retentions from its Table 1 (RULER), 2 (LongBench)
or 3 (MATH-500): PAPER_RETENTION below.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import warnings as _warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vdjax.analysis import geometry as G
from vdjax.eval import report
from vdjax.eval.summary_rows import retention, task_mean

VALUE, KEY = "valuediff", "keydiff"

# The paper's KeyDiff and ValueDiff retention (% of dense) per model: ((budget, KeyDiff, ValueDiff), ...).
# Model names as in vdjax.analysis.geometry.PAPER (Tables 4/5).
# Line numbers: /work/shared/paper/valuediff.txt.
PAPER_RETENTION: dict[str, dict[str, tuple[tuple[str, float, float], ...]]] = {
    # Table 1 (RULER, ctx 8192, budgets 2048 / 4096), lines 158-183
    "ruler": {
        "Llama 3.1-8B": (("2k", 89.6, 88.1), ("4k", 95.2, 95.0)),
        "Llama 3.2-3B": (("2k", 92.9, 88.8), ("4k", 97.4, 94.7)),
        "Qwen2.5-3B": (("2k", 39.8, 41.1), ("4k", 63.6, 65.4)),
        "Qwen2.5-7B": (("2k", 31.9, 21.8), ("4k", 56.2, 46.7)),
        "Gemma2-2B": (("2k", 96.4, 89.6), ("4k", 98.7, 95.7)),
        "Gemma2-9B": (("2k", 99.0, 99.4), ("4k", 99.3, 100.0)),
        "Qwen3-4B": (("2k", 89.6, 95.2), ("4k", 95.1, 98.0)),
        "Gemma3-4B": (("2k", 81.7, 87.6), ("4k", 91.9, 96.1)),
        "Qwen3.5-4B": (("2k", 93.3, 97.6), ("4k", 96.6, 99.7)),
        "Qwen3.5-9B": (("2k", 91.9, 95.6), ("4k", 96.2, 98.2)),
        "GPT-OSS-20B": (("2k", 88.9, 91.3), ("4k", 93.1, 97.8)),
    },
    # Table 2 (LongBench, budgets 4k / 8k; no Gemma2, no Qwen2.5), lines 230-239
    "longbench": {
        "Llama 3.1-8B": (("4k", 82.6, 73.1), ("8k", 93.6, 88.0)),
        "Llama 3.2-3B": (("4k", 85.4, 75.9), ("8k", 89.2, 85.1)),
        "Qwen3-4B": (("4k", 85.0, 95.3), ("8k", 94.6, 98.7)),
        "Gemma3-4B": (("4k", 76.7, 88.1), ("8k", 90.9, 94.5)),
        "Qwen3.5-4B": (("4k", 78.6, 92.2), ("8k", 90.7, 95.5)),
        "Qwen3.5-9B": (("4k", 81.3, 92.1), ("8k", 92.9, 97.2)),
        "GPT-OSS-20B": (("4k", 83.4, 91.0), ("8k", 94.5, 96.6)),
    },
    # Table 3 (MATH-500, budgets 25 % / 50 % of the mean dense length), lines 260-270; the DS-R1 distills
    # have no geometry in Tables 4/5 (table rows only, no plotted point)
    "math500": {
        "DS-R1-Qwen-1.5B": (("25%", 89.2, 89.0), ("50%", 99.0, 97.6)),
        "DS-R1-Llama-8B": (("25%", 79.4, 77.9), ("50%", 84.9, 85.1)),
        "Gemma3-4B": (("25%", 87.1, 96.8), ("50%", 97.8, 102.2)),
        "Qwen3-4B": (("25%", 79.5, 90.5), ("50%", 90.9, 96.3)),
        "Qwen3.5-4B": (("25%", 65.2, 84.3), ("50%", 86.5, 100.0)),
        "Qwen3.5-9B": (("25%", 68.5, 92.1), ("50%", 89.9, 100.0)),
        "GPT-OSS-20B": (("25%", 89.1, 93.1), ("50%", 96.1, 96.6)),
    },
}
PAPER_SETTING = {"ruler": "Table 1, ctx 8192", "longbench": "Table 2", "math500": "Table 3"}
PAPER_BUDGET_TEXT = {"2k": "2k (25% of 8k)", "4k": "4k (50% of 8k)"}  # RULER's; others as printed

COLUMNS = ("model", "source", "setting", "ratio", "bos_cos", "sink_rate", "budget", "valuediff", "keydiff",
           "gap", "tasks", "samples")
HEADERS = ("model", "source", "setting", "σV/σK", "BOS key cos", "sink rate", "budget",
           "ValueDiff retention (%)", "KeyDiff retention (%)", "gap (pp)", "tasks / samples used")
GROUP_COLUMNS = ("model", "group", "layers", "sigma_k", "sigma_v", "ratio", "bos_cos", "sink_rate")
MEAN = "mean"


@dataclasses.dataclass
class Point:
    """One table row: a model at one budget (or the mean over its budgets, budget None / text "mean ...")."""

    model: str
    source: str  # "ours" or "paper"
    setting: str  # "ruler paper L2048" / "Table 1, ctx 8192"
    ratio: float | None
    bos_cos: float | None
    sink_rate: float | None
    budget: int | str | None  # ours: cache slots; paper: its label ("2k"); None on a mean row
    budget_text: str
    valuediff: float | None  # retention, % of dense
    keydiff: float | None
    gap: float | None  # valuediff - keydiff, percentage points
    tasks: int | None = None  # ours: tasks / samples the gap used (paper: None, its protocol's)
    samples: int | None = None
    task_names: tuple[str, ...] = ()
    used: str = ""  # the "tasks / samples used" cell

    @property
    def is_mean(self) -> bool:
        return self.budget_text.startswith(MEAN)


@dataclasses.dataclass
class Gap:
    """The gap at one budget over the samples dense, valuediff and keydiff all have."""

    valuediff: float | None
    keydiff: float | None
    gap: float | None
    tasks: tuple[str, ...]
    samples: int
    dense: float | None = None  # the dense score (0-100) on those samples


# ---- the gap from predictions -----------------------------------------------------------------------------
def _slug(model: str) -> str:
    """A model's folder name (as `vdjax.app.analyze.slug`: a registered name, or the last part of a path)."""
    return Path(str(model).rstrip("/")).name or "model"


def sample_scores(records: Iterable[dict],
                  benchmark: str) -> dict[tuple, dict[tuple, dict[str, dict[str, float]]]]:
    """(model, protocol, length) -> (policy, budget) -> task -> sample_id -> score (mean over draws), for the
    records of `benchmark`; dense's budget is None."""
    draws: dict[tuple, dict[tuple, dict[str, dict[str, list[float]]]]] = {}
    for r in records:
        if r.get("benchmark") != benchmark:
            continue
        cfg = ("dense", None) if r["policy"] == "dense" else (r["policy"], r["budget"])
        by_task = draws.setdefault((_slug(r["model"]), r["protocol"], r["length"]), {}).setdefault(cfg, {})
        by_task.setdefault(r["task"], {}).setdefault(r["sample_id"], []).append(float(r["score"]))
    return {gm: {cfg: {t: {s: sum(v) / len(v) for s, v in by_id.items()} for t, by_id in by_task.items()}
                 for cfg, by_task in by_cfg.items()} for gm, by_cfg in draws.items()}


def paired_gap(by_cfg: dict[tuple, dict[str, dict[str, float]]], budget: int) -> Gap:
    """retention(valuediff) − retention(keydiff) at `budget` over the samples all three of dense, valuediff
    and keydiff have (`report`'s retention: the mean over tasks of per-task means, in % of dense's)."""
    dense, vd, kd = (by_cfg.get(("dense", None), {}), by_cfg.get((VALUE, budget), {}),
                     by_cfg.get((KEY, budget), {}))
    keep = {(t, s) for t, by_id in dense.items() for s in by_id if s in vd.get(t, {}) and s in kd.get(t, {})}
    if not keep:
        return Gap(None, None, None, (), 0)

    def kept(t, s):
        return (t, s) in keep

    d = task_mean(dense, kept)
    rv, rk = retention(task_mean(vd, kept), d), retention(task_mean(kd, kept), d)
    gap = None if rv is None or rk is None else rv - rk
    return Gap(rv, rk, gap, tuple(sorted({t for t, _ in keep})), len(keep), d)


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


# ---- geometry ---------------------------------------------------------------------------------------------
def load_geometry(geometry_dir: str | Path, model: str) -> G.Geometry:
    """GEOMETRY/<model>/geometry.json (format vdjax-geometry/1), or a clear error naming the path."""
    path = Path(geometry_dir) / model / "geometry.json"
    if not path.is_file():
        raise FileNotFoundError(f"no geometry for {model!r}: {path} does not exist (write it with "
                                f"`vdjax analyze --model {model} --out {geometry_dir}`)")
    try:
        data = json.loads(path.read_text())
        if data.get("format") != "vdjax-geometry/1":
            raise ValueError(f"format {data.get('format')!r}, expected 'vdjax-geometry/1'")
        return G.Geometry.from_json(data)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a vdjax geometry file: {e}") from None


def layer_groups(geo: G.Geometry) -> list[dict[str, Any]]:
    """σK, σV, σV/σK (ratio of means), BOS key cos and sink rate per attention kind: "sliding W=<w>" per
    window size and "global"; [] when every attention layer is of one kind (nothing to split). Layers without
    attention (Gated DeltaNet) are left out."""
    groups: dict[str, list[int]] = {}
    for i, w in enumerate(geo.windows):
        if geo.measured(i):
            groups.setdefault("global" if w is None else f"sliding W={w}", []).append(i)
    if len(groups) < 2:
        return []
    out = []
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN statistic (e.g. no Jaccard) is fine
        for name, layers in sorted(groups.items(), key=lambda kv: kv[1][0]):
            def m(field, layers=layers):
                a = geo.heads[field][layers]
                return float(np.nanmean(a)) if np.isfinite(a).any() else None

            sk, sv = m("sigma_k"), m("sigma_v")
            out.append({"model": geo.model, "group": name, "layers": layers, "sigma_k": sk, "sigma_v": sv,
                        "ratio": None if sk is None or sv is None or sk == 0 else sv / sk,
                        "bos_cos": m("bos_cos"), "sink_rate": m("sink")})
    return out


def _finite(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


# ---- the points -------------------------------------------------------------------------------------------
def our_points(records: list[dict], geometry_dir: str | Path, *, benchmark: str = "ruler",
               budgets: Sequence[int] | None = None) -> tuple[list[Point], dict[str, G.Geometry]]:
    """Per (model, protocol, length) of `benchmark`: rows per budget and a mean row; each model's geometry."""
    scores = sample_scores(records, benchmark)
    fractions: dict[tuple, set] = {}
    for r in records:
        if r.get("benchmark") == benchmark and r.get("budget_fraction") is not None:
            fractions.setdefault((_slug(r["model"]), r["budget"]), set()).add(r["budget_fraction"])
    points, geos = [], {}
    for (model, protocol, length) in sorted(scores, key=lambda k: (k[0], str(k[1]), k[2])):
        by_cfg = scores[(model, protocol, length)]
        if model not in geos:
            geos[model] = load_geometry(geometry_dir, model)
        agg = geos[model].aggregate()
        geo = {"ratio": _finite(agg["ratio"]), "bos_cos": _finite(agg["bos_cos"]),
               "sink_rate": _finite(agg["sink_rate"])}
        setting = f"{benchmark} {protocol} L{length}"
        have = sorted({b for p, b in by_cfg if p in (VALUE, KEY) and b is not None})
        chosen = sorted(set(budgets)) if budgets else have
        rows = []
        for b in chosen:
            g = paired_gap(by_cfg, b)
            fr = fractions.get((model, b), set())
            text = (f"{100 * next(iter(fr)):g}% (N={b})" if len(fr) == 1 else
                    f"{b} ({100 * b / length:g}% of {length})" if length else str(b))
            rows.append(Point(model, "ours", setting, **geo, budget=b, budget_text=text,
                              valuediff=g.valuediff, keydiff=g.keydiff, gap=g.gap, tasks=len(g.tasks),
                              samples=g.samples, task_names=g.tasks,
                              used=f"{len(g.tasks)} / {g.samples}" if g.samples else ""))
        done = [p for p in rows if p.gap is not None]
        points += rows
        points.append(Point(
            model, "ours", setting, **geo, budget=None,
            budget_text=f"{MEAN} ({', '.join(str(p.budget) for p in done) or 'no budget yet'})",
            valuediff=_mean([p.valuediff for p in done]), keydiff=_mean([p.keydiff for p in done]),
            gap=_mean([p.gap for p in done]), tasks=max((p.tasks for p in done), default=0),
            samples=sum(p.samples for p in done),
            task_names=tuple(sorted({t for p in done for t in p.task_names})),
            used=" + ".join(p.used for p in done)))
    return points, geos


def paper_points(benchmark: str = "ruler") -> list[Point]:
    """The paper's rows for `benchmark` (per budget, then the mean), geometry from its Tables 4 and 5."""
    points = []
    for model, cells in PAPER_RETENTION.get(benchmark, {}).items():
        ref = dict(zip(G.PAPER_COLUMNS, G.PAPER[model], strict=False)) if model in G.PAPER else {}
        geo = {"ratio": ref.get("ratio"), "bos_cos": ref.get("bos_cos"), "sink_rate": ref.get("sink_rate")}
        setting = PAPER_SETTING[benchmark]
        rows = [Point(model, "paper", setting, **geo, budget=b, budget_text=PAPER_BUDGET_TEXT.get(b, b)
                      if benchmark == "ruler" else b, valuediff=vd, keydiff=kd, gap=round(vd - kd, 6))
                for b, kd, vd in cells]
        points += rows
        points.append(Point(model, "paper", setting, **geo, budget=None,
                            budget_text=f"{MEAN} ({', '.join(str(p.budget) for p in rows)})",
                            valuediff=_mean([p.valuediff for p in rows]),
                            keydiff=_mean([p.keydiff for p in rows]), gap=_mean([p.gap for p in rows])))
    return points


# ---- writers ----------------------------------------------------------------------------------------------
def _f(x, digits: int = 3) -> str:
    return report.MISSING if x is None else f"{x:.{digits}f}"


def _used(p: Point) -> str:
    if p.source == "paper":
        return "paper's protocol"
    return p.used or "none yet (no sample has dense, valuediff and keydiff)"


def _cells(p: Point) -> list[str]:
    return [p.model, p.source, p.setting, _f(p.ratio, 2 if p.source == "paper" else 3), _f(p.bos_cos),
            _f(p.sink_rate), p.budget_text, _f(p.valuediff, 1), _f(p.keydiff, 1),
            report.MISSING if p.gap is None else f"{p.gap:+.1f}", _used(p)]


def _markdown(points: list[Point], groups: list[dict], benchmark: str, notes: list[str], results_dir: Path,
              geometry_dir: Path) -> str:
    out = [f"# Figure 2 ({benchmark}): ValueDiff − KeyDiff retention gap vs KV geometry", ""]
    out += [f"> note: {n}" for n in notes]
    if notes:
        out.append("")
    source = PAPER_SETTING.get(benchmark, "tables (none for this benchmark)")
    intro = (f"Ours: predictions under `{results_dir}`, geometry from `{geometry_dir}/<model>/geometry.json` "
             "(`vdjax analyze`). Paper: σV/σK and sink rate from its Table 4, BOS key cosine from its "
             f"Table 5, retention from its {source}.")
    method = ("Gap = ValueDiff retention − KeyDiff retention (percentage points); retention = score / dense "
              "score (mean over tasks of per-task means). Each budget row of ours uses only the samples "
              "dense, valuediff and keydiff all have at that budget (`tasks / samples used`). A `mean` row "
              "averages the budget rows (the paper's Figure 2 colours by this mean: Gemma2-9B's +0.6 pt in "
              "§4.4 is the mean of its Table 1 gaps +0.4 and +0.7); figure2.png plots the mean rows. Our "
              "budgets are given as a fraction of our context length"
              + ("; the paper's RULER budgets are 25 % and 50 % of 8192." if benchmark == "ruler" else "."))
    out += [intro, "", method, "", "| " + " | ".join(HEADERS) + " |", "|---|---|---|" + "---:|" * 7 + "---|"]
    out += ["| " + " | ".join(_cells(p)) + " |" for p in points]
    if groups:
        text = ("σV/σK (ratio of the group's mean σV and σK over its layers and heads), BOS key cos and sink "
                "rate per attention kind, for models that mix kinds. The retention gap is only measured per "
                "model (eviction runs in every layer at once); the figure draws each group at its model's "
                "mean gap.")
        out += ["", "## Per layer group", "", text, "",
                "| model | group | layers | σK | σV | σV/σK | BOS key cos | sink rate |",
                "|---|---|---|---:|---:|---:|---:|---:|"]
        out += [f"| {g['model']} | {g['group']} | {_layers_text(g['layers'])} | {_f(g['sigma_k'])} | "
                f"{_f(g['sigma_v'])} | {_f(g['ratio'])} | {_f(g['bos_cos'])} | {_f(g['sink_rate'])} |"
                for g in groups]
    return "\n".join(out) + "\n"


def _layers_text(layers: list[int]) -> str:
    return f"{len(layers)}: " + ",".join(map(str, layers))


def _num(x) -> str:
    return "" if x is None else f"{x:.6g}" if isinstance(x, float) else str(x)


def _write_csv(path: Path, points: list[Point]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS + ("budget_text", "task_names"))
        for p in points:
            w.writerow([_num(getattr(p, c)) for c in COLUMNS] + [p.budget_text, ";".join(p.task_names)])


def _write_groups_csv(path: Path, groups: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(GROUP_COLUMNS)
        for g in groups:
            w.writerow([";".join(map(str, g[c])) if c == "layers" else _num(g[c]) for c in GROUP_COLUMNS])


def _plot(path: Path, points: list[Point], groups: list[dict], benchmark: str) -> None:
    """Two panels: mean gap vs σV/σK and vs BOS key cosine; bars span the per-budget gaps."""
    from matplotlib.figure import Figure  # no pyplot: a library call never switches the user's backend

    fig = Figure(figsize=(12, 4.8))
    axes = fig.subplots(1, 2)
    means = [p for p in points if p.is_mean and p.gap is not None]
    per_budget: dict[tuple, list[float]] = {}
    for p in points:
        if not p.is_mean and p.gap is not None:
            per_budget.setdefault((p.model, p.source, p.setting), []).append(p.gap)
    panels = ((axes[0], "ratio", "σV / σK", 1.0), (axes[1], "bos_cos", "BOS key cosine", 0.0))
    for ax, field, label, boundary in panels:
        ax.axhline(0.0, color="k", lw=0.8)
        ax.axvline(boundary, color="k", ls="--", lw=0.8)
        for p in means:
            x = getattr(p, field)
            if x is None:
                continue
            ours = p.source == "ours"
            span = per_budget.get((p.model, p.source, p.setting), [])
            if len(span) > 1:
                ax.vlines(x, min(span), max(span), color="C3" if ours else "grey", lw=1, alpha=0.6, zorder=2)
            ax.scatter([x], [p.gap], s=60 if ours else 34, marker="o" if ours else "s",
                       facecolors="C3" if ours else "none", edgecolors="C3" if ours else "grey", zorder=4,
                       label=None)
            ax.annotate(p.model, (x, p.gap), fontsize=7, xytext=(4, 3), textcoords="offset points",
                        color="k" if ours else "dimgrey")
            for g in (g for g in groups if g["model"] == p.model and ours and g[field] is not None):
                ax.plot([x, g[field]], [p.gap, p.gap], ls=":", lw=0.8, color="C0", zorder=3)
                ax.scatter([g[field]], [p.gap], s=28, marker="^" if g["group"].startswith("sliding") else "v",
                           color="C0", zorder=4)
                ax.annotate(g["group"], (g[field], p.gap), fontsize=6, textcoords="offset points", color="C0",
                            xytext=(3, -9) if g["group"].startswith("sliding") else (-3, 5),
                            ha="left" if g["group"].startswith("sliding") else "right")
        ax.set_xlabel(label)
        ax.set_ylabel("ValueDiff − KeyDiff retention (pp)")
        ax.grid(alpha=0.3)
    # legend: proxies (one entry per kind)
    ax = axes[0]
    ax.scatter([], [], s=60, marker="o", color="C3", label="ours (vdjax; mean over budgets)")
    ax.scatter([], [], s=34, marker="s", facecolors="none", edgecolors="grey",
               label=f"paper ({PAPER_SETTING.get(benchmark, '—')}; Tables 4/5)")
    if groups:
        ax.scatter([], [], s=28, marker="^", color="C0",
                   label="our layer group: ▲ sliding, ▼ global (at its model's gap)")
    ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"Figure 2 ({benchmark}): ValueDiff − KeyDiff gap vs σV/σK and BOS key cosine "
                 "(bars: range over budgets)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# ---- the report -------------------------------------------------------------------------------------------
def figure2(results_dir: str | Path, geometry_dir: str | Path, out_dir: str | Path, *,
            benchmark: str = "ruler", budgets: Sequence[int] | None = None, layer_groups_table: bool = True,
            paper: bool = True) -> dict[str, Path]:
    """Write OUT/figure2.md, figure2.csv, figure2.png (and figure2_groups.csv with layer groups); return the
    paths {"md", "csv", "png"[, "groups_csv"]}. `budgets`: only these of ours (default: every budget run)."""
    results_dir, geometry_dir, out_dir = Path(results_dir), Path(geometry_dir), Path(out_dir)
    if not results_dir.is_dir():
        raise FileNotFoundError(f"results folder {results_dir} does not exist")
    if not geometry_dir.is_dir():
        raise FileNotFoundError(f"geometry folder {geometry_dir} does not exist (write it with "
                                f"`vdjax analyze --model <model> --out {geometry_dir}`)")
    if not any(results_dir.rglob("predictions.jsonl")):
        raise FileNotFoundError(f"{results_dir} holds no predictions.jsonl (expected "
                                f"{results_dir}/<benchmark>/<model>/<protocol>/L<length>/predictions.jsonl)")
    notes: list[str] = []
    records, _ = report.load_records(results_dir, notes)
    mine = [r for r in records if r.get("benchmark") == benchmark]
    if not mine:
        found = sorted({str(r.get("benchmark")) for r in records})
        raise ValueError(f"{results_dir} holds no {benchmark} predictions "
                         f"(benchmarks there: {', '.join(found)})")
    points, geos = our_points(mine, geometry_dir, benchmark=benchmark, budgets=budgets)
    for p in points:
        if p.is_mean and p.gap is None:
            notes.append(f"{p.model} ({p.setting}): no sample has dense, valuediff and keydiff results yet")
    analysed = sorted(d.name for d in geometry_dir.iterdir() if (d / "geometry.json").is_file())
    for m in analysed:
        if m not in geos:
            notes.append(f"{m}: geometry only (no {benchmark} results under {results_dir} yet)")
    if paper:
        points += paper_points(benchmark)
        if benchmark not in PAPER_RETENTION:
            notes.append(f"the paper reports no {benchmark} retention: no paper points")
    groups = [g for m in sorted(geos) for g in layer_groups(geos[m])] if layer_groups_table else []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / "figure2.md", "csv": out_dir / "figure2.csv", "png": out_dir / "figure2.png"}
    paths["md"].write_text(_markdown(points, groups, benchmark, notes, results_dir, geometry_dir))
    _write_csv(paths["csv"], points)
    if groups:
        paths["groups_csv"] = out_dir / "figure2_groups.csv"
        _write_groups_csv(paths["groups_csv"], groups)
    _plot(paths["png"], points, groups, benchmark)
    return paths


def _budgets(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets must be comma-separated integers, got {text!r}") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"budgets must be positive integers, got {text!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vdjax.eval.figure2 --results R --geometry G --out O [--benchmark B] [--budgets N,...]`."""
    ap = argparse.ArgumentParser(prog="python -m vdjax.eval.figure2", description=__doc__.split("\n")[0])
    ap.add_argument("--results", required=True, help="folder of predictions (e.g. results/thesis)")
    ap.add_argument("--geometry", default="results/geometry", help="`vdjax analyze` output folder")
    ap.add_argument("--out", required=True, help="output folder for figure2.md/.csv/.png")
    ap.add_argument("--benchmark", default="ruler",
                    help="ruler (paper Table 1), longbench (2) or math500 (3)")
    ap.add_argument("--budgets", type=_budgets,
                    help="comma-separated budgets of ours (default: every budget run)")
    ap.add_argument("--no-layer-groups", action="store_true", help="leave out the per-layer-group table")
    ap.add_argument("--no-paper", action="store_true", help="leave out the paper's points")
    args = ap.parse_args(argv)
    try:
        paths = figure2(args.results, args.geometry, args.out, benchmark=args.benchmark, budgets=args.budgets,
                        layer_groups_table=not args.no_layer_groups, paper=not args.no_paper)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

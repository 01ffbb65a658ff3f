"""The leaderboard's tables and retention figure (issue 38): the paper's policies (results/thesis and the
hybrid) against the new ones (results/leaderboard) on the same RULER samples.

    python experiments/leaderboard_table.py [--models smollm2-135m,gemma3-270m] [--budgets 512,1024]
        [--out results/leaderboard/TABLES.md] [--figure results/leaderboard/retention.png] [--root results]

Per model and budget, one table of every row: the paper's policies (`results/thesis`'s evicting policies and
the hybrid "hybrid (RULER-selected at N)": `results/thesis-hybrid-budget` at N or, where that folder has no
line at N = 512, `results/thesis-hybrid-ruler`, whose mix was selected at N = 512, as results/thesis/README.md
says) and the new ones (`results/leaderboard`, still being filled; its dense lines are copies of the thesis's)
and the moonshot's designs given a full run (`results/leaderboard/moonshot/full/N<budget>`, rows "<design>
(moonshot)", see experiments/moonshot.py). A row that has no line yet for one of dense's tasks is unfinished:
it is left out and listed with its line count. Of the rest, a task counts only where every row has all of
dense's samples of it (as experiments/thesis_table.py does), so every column averages the same samples. Score
= mean over those samples (0-100); % of dense = score / dense's score; the paired difference is from the best
paper policy at that model and budget, in score points with a bootstrap 95 % interval, samples resampled
within each task (`vdjax.eval.report.paired_difference`); prefill and decode are each line's `prefill_s` /
`decode_s` (per batch) divided by its `batch`, averaged over the samples. Then the per-task scores of dense
and the five best evicting rows, and (--figure) retention per policy coloured by the signal it reads
(`SIGNALS`), one panel per model and budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from vdjax.eval.report import paired_difference

# The signal each policy reads, in the figure's order. A policy matches a name exactly, else the longest name
# it starts with ("adakv:valuediff" -> adaptive, "hybrid (RULER-selected at N)" -> value geometry); no match
# -> "other", with a warning.
SIGNALS: dict[str, tuple[str, ...]] = {
    "position": ("streaming", "random"),
    "attention": ("tova", "snapkv", "h2o", "fastcaote", "pyramidkv:snapkv", "chunkkv:snapkv"),
    "key geometry": ("keynorm", "keydiff", "manifoldkv", "leverage", "qfilter", "lagkv", "cur", "compactor"),
    "value geometry": ("valuediff", "valuediff_dir", "valuediff_norm", "hybrid", "chunkkv:hybrid",
                       "chunkkv:valuediff"),
    "expected attention": ("expected_attention",),
    "reconstruction": ("kvzip",),
    "adaptive": ("adakv:", "criticaladakv:", "criticalkv:", "pyramidkv:valuediff"),
}
OTHER = "other"

ROOT = Path(__file__).resolve().parent.parent / "results"
RUN = Path("ruler/{model}/paper/L2048/predictions.jsonl")
PAPER = "thesis"
LEADERBOARD = "leaderboard"
MOONSHOT = "leaderboard/moonshot/full"  # designs of ours on the leaderboard's samples, N<budget>/ a budget
HYBRID = "hybrid (RULER-selected at N)"
HYBRID_FOLDERS = ("thesis-hybrid-budget", "thesis-hybrid-ruler")  # the second only at N = 512 (its mix's N)
TOP = 5  # rows of the per-task table besides dense

_warned: set[str] = set()


def signal_of(policy: str) -> str:
    """The SIGNALS group of `policy` (exact name, else longest prefix); "other", with a warning, if none."""
    exact = [g for g, names in SIGNALS.items() if policy in names]
    if exact:
        return exact[0]
    prefixes = [(len(n), g) for g, names in SIGNALS.items() for n in names if policy.startswith(n)]
    if prefixes:
        return max(prefixes)[1]
    if policy not in _warned:
        _warned.add(policy)
        warnings.warn(f"policy {policy!r} is in no SIGNALS group: drawn as {OTHER!r}", stacklevel=2)
    return OTHER


def read_lines(path: Path) -> Iterator[dict]:
    """The records of a predictions.jsonl (none if it is absent), skipping with a warning a line that does not
    parse (the last line of a file still being written)."""
    if not path.is_file():
        return
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            warnings.warn(f"{path}:{n}: not a JSON line, skipped", stacklevel=2)


@dataclasses.dataclass
class Source:
    """One row's lines at one budget: {(task, sample id): record}, and whether it is a paper policy."""

    paper: bool
    records: dict[tuple[str, str], dict] = dataclasses.field(default_factory=dict)


def collect(root: Path, model: str, budget: int) -> dict[str, Source]:
    """Every row of `model` at `budget` (dense has no budget): row label -> its lines."""
    rows: dict[str, Source] = {"dense": Source(paper=False)}

    def add(label: str, paper: bool, r: dict) -> None:
        """File one record under `label`, warning when a dense copy disagrees with the line already there."""
        src = rows.setdefault(label, Source(paper=paper))
        key = (r["task"], r["sample_id"])
        old = src.records.get(key)
        if old is not None and label == "dense" and old["score"] != r["score"]:
            warnings.warn(f"{model}: dense {key} scores {old['score']} and {r['score']}; keeping the first",
                          stacklevel=2)
        src.records.setdefault(key, r)

    path = RUN.as_posix().format(model=model)
    for r in read_lines(root / PAPER / path):
        if r["policy"] == "dense":
            add("dense", False, r)
        elif r["budget"] == budget:
            add(r["policy"], True, r)
    for folder in HYBRID_FOLDERS:
        if folder != HYBRID_FOLDERS[0] and budget != 512:
            continue
        found = [r for r in read_lines(root / folder / path)
                 if r["policy"] == "hybrid" and r["budget"] == budget]
        for r in found:
            add(HYBRID, True, r)
        if found:
            break
    new = [(root / LEADERBOARD / path, "")]  # (predictions file, row-label suffix)
    new += [(folder / path, " (moonshot)") for folder in sorted((root / MOONSHOT).glob("N*"))]
    for file, suffix in new:
        for r in read_lines(file):
            if r["policy"] == "dense":
                add("dense", False, r)
            elif r["budget"] == budget:
                label = r["policy"] + suffix
                if label in rows and rows[label].paper:  # a paper policy rerun: its own row
                    label = f"{label} (leaderboard)"
                add(label, False, r)
    return rows


@dataclasses.dataclass
class Row:
    """One row of a table: its score, retention, difference from the best paper policy, times and lines."""

    label: str
    paper: bool
    score: float
    retention: float | None
    per_task: dict[str, float]
    prefill: float | None
    decode: float | None
    lines: int
    difference: tuple[float, float, float] | None = None


@dataclasses.dataclass
class Table:
    """The rows of one model at one budget over the tasks every row completes, and what was left out."""

    model: str
    budget: int
    rows: list[Row]
    tasks: list[str]
    samples: int  # samples a row, over `tasks`
    dropped_tasks: list[str]
    left_out: list[tuple[str, int]]
    best: str | None
    seeds: list
    block_sizes: list
    commits: list[str]
    note: str = ""


def _per_sample(records: list[dict], field: str) -> float | None:
    """Mean of `field` / `batch` over the records that have both (seconds per sample)."""
    vals = [r[field] / r["batch"] for r in records if r.get(field) is not None and r.get("batch")]
    return sum(vals) / len(vals) if vals else None


def _short(commit) -> str:
    """A commit shortened to 7 hex digits, keeping a suffix such as -dirty."""
    if not commit:
        return "?"
    head, _, tail = str(commit).partition("-")
    return head[:7] + (f"-{tail}" if tail else "")


def build(root: Path, model: str, budget: int, samples: int | None = None) -> Table:
    """The table of `model` at `budget`: unfinished rows left out, then the tasks every remaining row has all
    `samples` of dense's samples of (default: dense's most samples in a task)."""
    src = collect(root, model, budget)
    dense_ids: dict[str, set[str]] = {}
    for task, sid in src["dense"].records:
        dense_ids.setdefault(task, set()).add(sid)
    empty = Table(model, budget, [], [], 0, [], [], None, [], [], [])
    if not dense_ids:
        empty.note = f"no dense line for {model}"
        return empty
    if not any(s.records for label, s in src.items() if label != "dense"):
        empty.note = f"no evicting line of {model} at N = {budget}"
        return empty
    need = samples or max(len(ids) for ids in dense_ids.values())
    kept, left_out = ["dense"], []
    for label, s in src.items():
        if label == "dense" or not s.records:
            continue
        if set(dense_ids) <= {t for t, _ in s.records}:
            kept.append(label)
        else:
            left_out.append((label, len(s.records)))
    tasks, dropped = [], []
    for task in sorted(dense_ids):
        ids = dense_ids[task]
        if len(ids) >= need and all((task, i) in src[c].records for c in kept for i in ids):
            tasks.append(task)
        else:
            dropped.append(task)
    left_out.sort(key=lambda x: (-x[1], x[0]))
    if not tasks:
        empty.dropped_tasks, empty.left_out = dropped, left_out
        empty.note = f"no task is complete for every row of {model} at N = {budget}"
        return empty
    done = {c: {t: {i: float(src[c].records[(t, i)]["score"]) for i in dense_ids[t]} for t in tasks}
            for c in kept}
    rows = []
    for c in kept:
        counted = [src[c].records[(t, i)] for t in tasks for i in dense_ids[t]]
        score = 100 * sum(sum(v.values()) for v in done[c].values()) / len(counted)
        per_task = {t: 100 * sum(v.values()) / len(v) for t, v in done[c].items()}
        rows.append(Row(c, src[c].paper, score, None, per_task, _per_sample(counted, "prefill_s"),
                        _per_sample(counted, "decode_s"), len(src[c].records)))
    dense_score = rows[0].score
    for r in rows:
        r.retention = 100 * r.score / dense_score if dense_score else None
    paper = [r for r in rows if r.paper]
    best = max(paper, key=lambda r: (r.score, r.label)).label if paper else None
    for r in rows:
        if best is not None and r.label != best:
            r.difference = paired_difference(done[r.label], done[best])
    rows.sort(key=lambda r: (-r.score, r.label))
    everything = [rec for c in kept for rec in src[c].records.values()]
    return Table(model, budget, rows, tasks, sum(len(dense_ids[t]) for t in tasks), dropped,
                 left_out, best, sorted({r.get("seed") for r in everything}, key=str),
                 sorted({r.get("block_size") for r in everything}, key=str),
                 sorted({_short(r.get("vdjax_commit")) for r in everything}))


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    """`x` formatted, or "-" when missing."""
    return "-" if x is None else fmt.format(x)


def markdown(t: Table) -> str:
    """The main table of `t`, its caption and what it left out, as markdown."""
    head = f"### {t.model}, N = {t.budget}"
    out = [head, ""]
    if t.note:
        out.append(t.note + ".")
    else:
        best = f"best paper ({t.best})" if t.best else "best paper policy (none here)"
        out += [f"| policy | score | % of dense | − {best}, points [95 % CI] "
                "| prefill s/sample | decode s/sample | lines |", "|---|---|---|---|---|---|---|"]
        for r in t.rows:
            d = r.difference
            diff = "" if d is None else f"{d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]"
            ret = _num(r.retention, "{:.1f} %")
            out.append(f"| {r.label} | {r.score:.1f} | {ret} | {diff} | {_num(r.prefill, '{:.2f}')} "
                       f"| {_num(r.decode, '{:.2f}')} | {r.lines} |")
        new = [r.label for r in t.rows if not r.paper and r.label != "dense"]
        out += ["", f"{t.samples} samples a row, {len(t.tasks)} tasks ({', '.join(t.tasks)}); "
                f"seed {', '.join(map(str, t.seeds))}; N = {t.budget}; "
                f"block size {', '.join(map(str, t.block_sizes))}; commits {', '.join(t.commits)}. "
                f"New rows (results/leaderboard): {', '.join(new) or 'none'}."]
    if t.dropped_tasks:
        out.append(f"Tasks left out (a row lacks samples): {', '.join(t.dropped_tasks)}.")
    unfinished = ", ".join(f"{p} ({n} lines)" for p, n in t.left_out)
    out.append(f"Left out, unfinished: {unfinished or 'none'}.")
    return "\n".join(out)


def per_task_markdown(t: Table) -> str:
    """Score per task of dense and the TOP best evicting rows of `t`, as markdown ("" without rows)."""
    if not t.rows:
        return ""
    cols = [r for r in t.rows if r.label == "dense"] + [r for r in t.rows if r.label != "dense"][:TOP]
    out = [f"#### {t.model}, N = {t.budget}: per task (dense and the {TOP} best rows)", "",
           "| task | " + " | ".join(r.label for r in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    out += [f"| {task} | " + " | ".join(f"{r.per_task[task]:.1f}" for r in cols) + " |" for task in t.tasks]
    out.append("| mean | " + " | ".join(f"{r.score:.1f}" for r in cols) + " |")
    return "\n".join(out)


def report(tables: list[Table]) -> str:
    """The whole markdown: every main table, then every per-task table."""
    parts = ["# Leaderboard (issue 38): RULER 2048 tokens, paper protocol", ""]
    for t in tables:
        parts += [markdown(t), ""]
    parts += ["## Per task", ""]
    for t in tables:
        if t.rows:
            parts += [per_task_markdown(t), ""]
    return "\n".join(parts).rstrip() + "\n"


def figure(tables: list[Table], path: Path) -> None:
    """Retention (% of dense) per policy, one panel per model (columns) and budget (rows, those with an
    evicting row), bars coloured by SIGNALS group and ordered by group, then by best retention."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [t for t in tables if len(t.rows) > 1] or tables[:1]  # a panel with no bar at worst
    models = list(dict.fromkeys(t.model for t in tables))
    budgets = list(dict.fromkeys(t.budget for t in tables))
    groups = list(SIGNALS) + [OTHER]
    colours = {g: plt.get_cmap("tab10")(i) for i, g in enumerate(groups)}
    best: dict[str, float] = {}
    for t in tables:
        for r in t.rows:
            if r.label != "dense" and r.retention is not None:
                best[r.label] = max(best.get(r.label, -1.0), r.retention)
    group = {p: signal_of(p) for p in best}
    order = sorted(best, key=lambda p: (groups.index(group[p]), -best[p], p))
    fig, axes = plt.subplots(len(budgets), len(models), squeeze=False, sharey=True,
                             figsize=(4.5 * len(models), 1.2 + 0.28 * max(len(order), 4) * len(budgets)))
    for t in tables:
        ax = axes[budgets.index(t.budget)][models.index(t.model)]
        ret = {r.label: r.retention for r in t.rows if r.label != "dense" and r.retention is not None}
        ys = range(len(order))
        ax.barh(list(ys), [ret.get(p, 0.0) for p in order], color=[colours[group[p]] for p in order])
        for y, p in zip(ys, order, strict=True):
            label = f"{ret[p]:.0f}" if p in ret else "not in this table"
            ax.text(ret.get(p, 0.0) + 1, y, label, va="center", fontsize=7,
                    color="black" if p in ret else "grey")
        ax.set_yticks(list(ys), order, fontsize=8)
        ax.set_xlim(0, max([105.0, *(v + 10 for v in ret.values())]))
        ax.set_xlabel("% of dense")
        ax.set_title(f"{t.model}, N = {t.budget} ({len(t.tasks)} tasks)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    drawn = {(t.budget, t.model) for t in tables}
    for i, budget in enumerate(budgets):
        for j, model in enumerate(models):
            if (budget, model) not in drawn:
                axes[i][j].set_title(f"{model}, N = {budget}: no evicting row", fontsize=9)
                axes[i][j].set_xticks([])
    axes[0][0].invert_yaxis()  # the y axis is shared: the first group on top
    if order:
        from matplotlib.patches import Patch

        used = [g for g in groups if g in group.values()]
        fig.legend(handles=[Patch(color=colours[g], label=g) for g in used], loc="lower center",
                   ncol=min(len(used), 4), fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, (0.3 + 0.2 * (len(used) > 4)) / fig.get_figheight(), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Print (or write, --out) the tables and draw the figure (--figure)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--budgets", default="512,1024")
    ap.add_argument("--samples", type=int, default=None,
                    help="samples a task must have (default: dense's most in a task)")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown here instead of stdout")
    ap.add_argument("--figure", type=Path, default=None, help="draw the retention figure (PNG) here")
    ap.add_argument("--root", type=Path, default=ROOT, help="the results folder")
    a = ap.parse_args(argv)
    tables = [build(a.root, m, int(b), a.samples) for m in a.models.split(",") for b in a.budgets.split(",")]
    text = report(tables)
    if a.out is None:
        sys.stdout.write(text)
    else:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
        print(f"wrote {a.out}")
    if a.figure is not None:
        figure(tables, a.figure)
        print(f"wrote {a.figure}")


if __name__ == "__main__":
    main()

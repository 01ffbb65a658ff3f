"""Summaries of predictions.jsonl files in the paper's layout: retention = score with eviction / dense score.

    s = summarize("results/ruler/smollm2-135m/paper/L4096")     # a predictions.jsonl, or a folder of them
    s.md_path, s.csv_path, s.png_path                           # summary.md, summary.csv, retention.png

One table per (benchmark, protocol, length): rows = model x budget, columns = policies with dense as the
reference column. A cell is the mean score (0-100) over tasks of each task's mean over its samples (as
RULER/LongBench report) and the retention in % of dense. Retention compares a policy with dense on the samples
both have (on complete results: the ratio of the two cells), "n/a" when dense scores 0. The best evicting
policy of a row (highest retention; highest score where no retention exists) is bold in Markdown and named in
the CSV's `best` column. A per-task table follows. Missing results show as "—" (empty in the CSV). A budget
run as a fraction of the mean dense generation length (MATH-500) shows as "25% (N=256)".

MATH-500 lines (benchmark math500, or metric grade_answer / math_equiv) get one more table in the paper's
Table 10 / Table 3 columns, per (model, policy, budget): flex@k, exact@k, pass@k and math_equiv@k (each a mean
over problems of `metrics.math_at_k` over the problem's draws), average generated tokens, Empty% (no boxed
answer) and Trunc% (stopped by max_new_tokens, the line's `truncated`) per generation, and the retention of
flex@k in % of dense on the problems both have. It is also written to summary_math500.csv.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from pathlib import Path

from vdjax.eval.records import read_predictions, record_key

# The `X as X` names moved to summary_rows; they are re-exported for the callers of vdjax.eval.report.
from vdjax.eval.summary_rows import ALL_TASKS as ALL_TASKS
from vdjax.eval.summary_rows import MATH_METRICS as MATH_METRICS
from vdjax.eval.summary_rows import Cell, MathRow, Row, math_rows, table_rows
from vdjax.eval.summary_rows import is_math as is_math
from vdjax.eval.summary_rows import paired_difference as paired_difference
from vdjax.eval.summary_rows import retention as retention

MISSING = "—"


@dataclasses.dataclass
class Summary:
    """What `summarize` wrote: the rows (overall, then per task), the policy columns, the settings each table
    ran with, warnings about lines left out or mixed, and the output files."""

    rows: list[Row]
    task_rows: list[Row]
    policies: list[str]
    markdown: str
    md_path: Path
    csv_path: Path
    png_path: Path
    settings: dict[tuple, dict] = dataclasses.field(default_factory=dict)  # (benchmark, protocol, length) ->
    warnings: list[str] = dataclasses.field(default_factory=list)
    math_rows: list[MathRow] = dataclasses.field(default_factory=list)
    math_csv_path: Path | None = None  # summary_math500.csv, when there are MATH-500 lines


# settings a table's lines must share; they are named in its caption and differences are warned about
SETTINGS = ("seed", "block_size", "sampling", "fingerprint")


def load_records(source: str | os.PathLike, warnings: list[str] | None = None) -> tuple[list[dict], Path]:
    """(records, output folder) of a predictions.jsonl or of every predictions.jsonl under a folder.

    Duplicate keys (benchmark, model, length, task, sample_id, policy, budget, protocol, draw) keep the first;
    a duplicate that differs from it in seed, block size, sampling, fingerprint or hyper-parameters is
    reported in `warnings` (a list to append to), not dropped silently.
    """
    source = Path(source)
    if source.is_file():
        files, folder = [source], source.parent
    elif source.is_dir():
        files, folder = sorted(source.rglob("predictions.jsonl")), source
    else:
        raise ValueError(f"pred_file_or_dir={str(source)!r} is neither a predictions file nor a folder")
    if not files:
        raise ValueError(f"pred_file_or_dir={str(source)!r} holds no predictions.jsonl")
    seen: dict[tuple, dict] = {}
    records, dropped = [], {}
    for f in files:
        for r in read_predictions(f):
            key = (r.get("benchmark"), r.get("model"), r.get("length")) + record_key(r)
            first = seen.get(key)
            if first is None:
                seen[key] = r
                records.append(r)
                continue
            differ = tuple(k for k in SETTINGS + ("hyper",) if r.get(k) != first.get(k))
            if differ:
                dropped[f, differ] = dropped.get((f, differ), 0) + 1
    if warnings is not None:
        for (f, differ), n in sorted(dropped.items(), key=lambda x: str(x)):
            warnings.append(f"{n} line(s) of {f} left out: their key is already taken by a line that differs "
                            f"in {', '.join(differ)}")
    return records, folder


def _settings(records: list[dict], warnings: list[str]) -> dict[tuple, dict]:
    """(benchmark, protocol, length) -> the settings its lines ran with (SETTINGS and each policy's
    hyper-parameters per budget: hybrid's mix may be one selected at each); a table mixing several values of
    one (at one budget) gets a warning."""
    out: dict[tuple, dict] = {}
    for r in records:
        group = out.setdefault((r["benchmark"], r["protocol"], r["length"]), {"hyper": {}})
        for k in SETTINGS:
            group.setdefault(k, set()).add(json.dumps(r.get(k), sort_keys=True))
        by_budget = group["hyper"].setdefault(r["policy"], {})
        by_budget.setdefault(r.get("budget"), set()).add(json.dumps(r.get("hyper") or {}, sort_keys=True))
    for g, group in out.items():
        mixed = [k for k in SETTINGS if len(group[k]) > 1]
        mixed += [f"{p} hyper-parameters" + ("" if b is None else f" at budget {b}")
                  for p, by_budget in group["hyper"].items() for b, h in by_budget.items() if len(h) > 1]
        if mixed:
            warnings.append(f"table {g[0]} / {g[1]} / L{g[2]} mixes lines of several {', '.join(mixed)}")
    return out


def caption(settings: dict) -> str:
    """A line naming what a table ran with: seed, block size, decoding and every policy's hyper-parameters."""
    def one(values):
        return " | ".join(sorted(values))

    parts = [f"seed {one(settings['seed'])}", f"block {one(settings['block_size'])}",
             "decoding " + ("greedy" if settings["sampling"] == {"null"} else one(settings["sampling"]))]
    for p, by_budget in sorted(settings["hyper"].items()):
        texts = {b: one(h) for b, h in by_budget.items()}
        if len(set(texts.values())) == 1:  # the same at every budget: named once
            texts = {None: next(iter(texts.values()))}
        for b, text in sorted(texts.items(), key=lambda x: (x[0] is not None, x[0] or 0)):
            if text != "{}":
                parts.append(f"{p}{'' if b is None else f' at N={b}'} {text}")
    return "; ".join(parts)


MATH_HEADER = ("model", "policy", "budget", "problems", "k", "flex@k", "exact@k", "pass@k", "math_equiv@k",
               "avg tokens", "Empty %", "Trunc %", "retention (flex@k)")


def math_cells(row: MathRow) -> list[str]:
    """A MathRow as the texts of MATH_HEADER's columns."""
    k = str(row.k[0]) if row.k[0] == row.k[1] else f"{row.k[0]}–{row.k[1]}"
    budget = MISSING if row.budget is None else _budget_text(row)
    ret = MISSING if row.policy == "dense" or not row.paired else (
        "n/a" if row.retention is None else f"{row.retention:.1f}%")
    return [row.model, row.policy, budget, str(row.problems), k, f"{row.flex:.3f}", f"{row.exact:.3f}",
            f"{row.pass_:.3f}", f"{row.math_equiv:.3f}",
            MISSING if row.tokens is None else f"{row.tokens:.0f}", f"{row.empty_pct:.1f}",
            _fmt(row.trunc_pct), ret]


def _math_markdown(rows: list[MathRow]) -> list[str]:
    """The MATH-500 table of one (benchmark, protocol, length), as Markdown lines."""
    note = ("MATH-500 in the paper's Table 10 / Table 3 columns: flex@k = mean grade_answer (prm800k) "
            "accuracy over a problem's k draws, exact@k = mean exact match of the normalised answer "
            "(undefined in the paper; here Hendrycks/prm800k normalisation, string equality), pass@k = 1 if "
            "any draw is correct, math_equiv@k = mean math_verify equivalence; tokens, Empty % (no \\boxed{} "
            "answer) and Trunc % (hit max_new_tokens) per generation; retention = flex@k in % of dense.\n")
    out = [note, "| " + " | ".join(MATH_HEADER) + " |", "|---|---|" + "---:|" * (len(MATH_HEADER) - 2)]
    out += ["| " + " | ".join(math_cells(r)) + " |" for r in rows]
    return out + [""]


def _write_math_csv(path: Path, rows: list[MathRow]) -> None:
    """summary_math500.csv: one line per MathRow, numbers unrounded."""
    header = ["benchmark", "protocol", "length", "model", "policy", "budget", "budget_fraction", "problems",
              "k_min", "k_max", "flex_at_k", "exact_at_k", "pass_at_k", "math_equiv_at_k", "avg_tokens",
              "empty_pct", "trunc_pct", "retention_flex", "paired"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in rows:
            w.writerow([r.benchmark, r.protocol, r.length, r.model, r.policy,
                        "" if r.budget is None else r.budget, "" if r.fraction is None else r.fraction,
                        r.problems, *r.k, _num(r.flex), _num(r.exact), _num(r.pass_), _num(r.math_equiv),
                        _num(r.tokens), _num(r.empty_pct), _num(r.trunc_pct), _num(r.retention), r.paired])


# ---- writers ----------------------------------------------------------------------------------------------
def _fmt(x: float | None) -> str:
    return MISSING if x is None else f"{x:.1f}"


def cell_text(row: Row, policy: str, mark: tuple[str, str] = ("**", "**")) -> str:
    """A cell as text: "score (retention%)", the row's best wrapped in `mark`.

    "n/a" retention when dense scores 0; "—" for no results (in the parentheses: no dense
    results for the same samples).
    """
    if policy == "dense":
        return _fmt(row.dense.score)
    cell = row.cells.get(policy)
    if cell is None:
        return MISSING
    score = _fmt(cell.score)
    if policy in row.best:
        score = f"{mark[0]}{score}{mark[1]}"
    return f"{score} ({_retention_text(cell)})"


def _retention_text(cell: Cell) -> str:
    """x.y%, n/a (dense scores 0) or — (no paired dense results)."""
    if not cell.paired:
        return MISSING
    return "n/a" if cell.retention is None else f"{cell.retention:.1f}%"


def _budget_text(row: Row) -> str:
    """The budget column: "N", "25% (N=256)" for a budget run as a fraction of dense, "—" for none."""
    if row.budget is None:
        return MISSING
    return str(row.budget) if row.fraction is None else f"{100 * row.fraction:g}% (N={row.budget})"


def _markdown(rows: list[Row], task_rows: list[Row], policies: list[str], settings: dict[tuple, dict],
              warnings: list[str], maths: list[MathRow] = ()) -> str:
    """summary.md: per (benchmark, protocol, length) the overall table, the per-task one, the MATH-500 one."""
    cols = ["dense"] + policies
    out = [f"> warning: {w}\n" for w in warnings]
    groups = sorted({(r.benchmark, r.protocol, r.length) for r in rows})
    for g in groups:
        out.append(f"## {g[0]} — protocol {g[1]}, length {g[2]}\n")
        out.append(f"Settings: {caption(settings[g])}.\n")
        out.append("Mean score (0–100; mean over tasks of per-task means; a sample's score is the mean over "
                   "its draws) and retention (% of dense). **Bold**: best evicting policy of the row.\n")
        out.append("| model | budget | " + " | ".join(cols) + " |")
        out.append("|---|---:|" + "---:|" * len(cols))
        for r in (r for r in rows if (r.benchmark, r.protocol, r.length) == g):
            out.append(f"| {r.model} | {_budget_text(r)} | "
                       + " | ".join(cell_text(r, c) for c in cols) + " |")
        out.append("")
        out.append("Per task:\n")
        out.append("| model | task | budget | " + " | ".join(cols) + " |")
        out.append("|---|---|---:|" + "---:|" * len(cols))
        for r in (r for r in task_rows if (r.benchmark, r.protocol, r.length) == g):
            out.append(f"| {r.model} | {r.task} | {_budget_text(r)} | "
                       + " | ".join(cell_text(r, c) for c in cols) + " |")
        out.append("")
        mine = [m for m in maths if (m.benchmark, m.protocol, m.length) == g]
        if mine:
            out += _math_markdown(mine)
    out.append("Retention compares each policy with dense on the samples both have; n/a: dense scores 0 "
               f"there; {MISSING}: no results yet.")
    return "\n".join(out) + "\n"


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"


def _write_csv(path: Path, rows: list[Row], policies: list[str]) -> None:
    """summary.csv: overall rows (task "all") then per-task rows; score, retention and count per policy."""
    header = ["benchmark", "protocol", "length", "model", "task", "budget", "budget_fraction", "dense",
              "dense_n"]
    for p in policies:
        header += [p, f"{p}_retention", f"{p}_n"]
    header.append("best")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in rows:
            line = [r.benchmark, r.protocol, r.length, r.model, r.task, "" if r.budget is None else r.budget,
                    "" if r.fraction is None else r.fraction, _num(r.dense.score), r.dense.n]
            for p in policies:
                c = r.cells.get(p)
                if c is None:
                    line += ["", "", 0]
                else:
                    ret = "n/a" if c.retention is None and c.paired else _num(c.retention)
                    line += [_num(c.score), ret, c.n]
            line.append(";".join(r.best))
            w.writerow(line)


def _plot(path: Path, rows: list[Row], policies: list[str]) -> None:
    """retention.png: retention (% of dense) vs budget, a line per policy, a panel per model and setting."""
    from matplotlib.figure import Figure  # no pyplot: a library call never switches the user's backend

    panels = sorted({(r.benchmark, r.protocol, r.length, r.model) for r in rows})
    fig = Figure(figsize=(5.5 * max(len(panels), 1), 4))
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=False):
        mine = [r for r in rows
                if (r.benchmark, r.protocol, r.length, r.model) == panel and r.budget is not None]
        drawn = False
        for p in policies:
            pts = [(r.budget, r.cells[p].retention) for r in mine
                   if p in r.cells and r.cells[p].retention is not None]
            if pts:
                xs, ys = zip(*pts, strict=False)
                ax.plot(xs, ys, marker="o", label=p)
                drawn = True
        ax.axhline(100.0, color="gray", linestyle="--", linewidth=1, label="dense")
        budgets = sorted({r.budget for r in mine})
        if len(budgets) > 1:
            ax.set_xscale("log", base=2)
        if budgets:
            ax.set_xticks(budgets, [str(b) for b in budgets])
        if not drawn:
            ax.text(0.5, 0.5, "no retention yet\n(needs dense and a non-zero dense score)",
                    ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{panel[3]} — {panel[0]} {panel[1]} L{panel[2]}", fontsize=9)
        ax.set_xlabel("budget (cache slots per KV head)")
        ax.set_ylabel("retention (% of dense)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(pred_file_or_dir: str | os.PathLike) -> Summary:
    """Write summary.md, summary.csv and retention.png beside the predictions (file) or in the folder."""
    warnings: list[str] = []
    records, folder = load_records(pred_file_or_dir, warnings)
    settings = _settings(records, warnings)
    rows, task_rows, policies = table_rows(records)
    maths = math_rows(records)
    markdown = _markdown(rows, task_rows, policies, settings, warnings, maths)
    md_path, csv_path, png_path = folder / "summary.md", folder / "summary.csv", folder / "retention.png"
    md_path.write_text(markdown)
    _write_csv(csv_path, rows + task_rows, policies)
    _plot(png_path, rows, policies)
    math_csv = folder / "summary_math500.csv" if maths else None
    if math_csv is not None:
        _write_math_csv(math_csv, maths)
    return Summary(rows, task_rows, policies, markdown, md_path, csv_path, png_path, settings, warnings,
                   maths, math_csv)


def rich_tables(summary: Summary) -> list:
    """The overall tables as rich Tables (one per benchmark, protocol and length), for printing."""
    from rich.table import Table

    cols = ["dense"] + summary.policies
    tables = []
    for g in sorted({(r.benchmark, r.protocol, r.length) for r in summary.rows}):
        t = Table(title=f"{g[0]} — protocol {g[1]}, length {g[2]}: score (retention % of dense)",
                  caption=caption(summary.settings[g]))
        t.add_column("model")
        t.add_column("budget", justify="right")
        for c in cols:
            t.add_column(c, justify="right")
        for r in (r for r in summary.rows if (r.benchmark, r.protocol, r.length) == g):
            t.add_row(r.model, _budget_text(r),
                      *(cell_text(r, c, ("[bold green]", "[/]")) for c in cols))
        tables.append(t)
        maths = [m for m in summary.math_rows if (m.benchmark, m.protocol, m.length) == g]
        if maths:
            tables.append(_math_rich(g, maths))
    return tables


def _math_rich(g: tuple, rows: list[MathRow]):
    """The MATH-500 table of one (benchmark, protocol, length) as a rich Table."""
    from rich.table import Table

    t = Table(title=f"{g[0]} — protocol {g[1]}, length {g[2]}: Table 10 columns "
                    "(retention = % of dense flex@k)")
    for i, name in enumerate(MATH_HEADER):
        t.add_column(name, justify="left" if i < 2 else "right")
    for r in rows:
        t.add_row(*math_cells(r))
    return t

"""The README's thesis table: score and retention (% of dense) per policy over
the tasks every run has finished.

    python experiments/thesis_table.py [--model gemma3-270m] [--budget 512]

Reads results/thesis (the main run) and the hybrid folders beside it (results/thesis-hybrid: the per-layer fit
at N=256; results/thesis-hybrid-selected: the mix selected by retrieval-probe NLL;
results/thesis-hybrid-ruler: the mix selected at N=512 on 4 held-out RULER samples a task, run at both
budgets; results/thesis-hybrid-budget: the mix selected at each budget on 4 or 8 held-out samples a task (the
mix JSONs say which); the selection runs under thesis-hybrid-ruler/selection/, which this table does not
read). A task counts only when every listed run has all its samples there, so each column averages the same
samples. Retention = mean score / dense mean score. The last column is the paired difference from KeyDiff in
score points with a bootstrap 95 % interval (samples resampled within each task): at 10 samples per task most
differences between policies lie inside it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from vdjax.eval.report import paired_difference

ROOT = Path(__file__).resolve().parent.parent / "results"
FOLDERS = {"thesis": None, "thesis-hybrid": "hybrid (per-layer fit, N=256)",
           "thesis-hybrid-selected": "hybrid (selected)",
           "thesis-hybrid-ruler": "hybrid (RULER-selected at N=512)",
           "thesis-hybrid-budget": "hybrid (RULER-selected at N)"}


def lines(model: str):
    """(column name, record) of every prediction line of `model` in the thesis folders."""
    for folder, label in FOLDERS.items():
        for path in sorted((ROOT / folder / "ruler" / model).glob("*/L*/predictions.jsonl")):
            for line in path.read_text().splitlines():
                r = json.loads(line)
                yield (label or r["policy"]), r


def table(model: str, budget: int, samples: int = 10, reference: str = "keydiff") -> str:
    """A markdown table of the tasks complete for every column at `budget` (dense has no budget), with each
    column's paired difference from `reference` and its bootstrap 95 % interval
    (`report.paired_difference`)."""
    scores = defaultdict(lambda: defaultdict(dict))  # column -> task -> sample -> score
    for col, r in lines(model):
        if r["budget"] in (None, budget):
            scores[col][r["task"]][r["sample_id"]] = r["score"]
    cols = ["dense"] + sorted((c for c in scores if c != "dense"), key=lambda c: -sum(
        sum(s.values()) for s in scores[c].values()))
    tasks = sorted(set.intersection(*[{t for t, s in scores[c].items() if len(s) >= samples} for c in cols]))
    if not tasks:
        return f"no task is complete for every column of {model} at N={budget}"
    mean = {c: 100 * sum(sum(scores[c][t].values()) for t in tasks) / sum(len(scores[c][t]) for t in tasks)
            for c in cols}
    head = f"{model}, N = {budget}: {len(tasks)} tasks ({', '.join(tasks)}), {samples} samples each"
    done = {c: {t: scores[c][t] for t in tasks} for c in cols}

    def versus(c: str) -> str:
        d = paired_difference(done[c], done[reference]) if reference in done and c != reference else None
        return "" if d is None else f"{d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]"

    rows = [f"| {c} | {mean[c]:.1f} | " + (f"{100 * mean[c] / mean['dense']:.1f} %" if mean["dense"] else "-")
            + f" | {versus(c)} |" for c in sorted(cols, key=lambda c: -mean[c])]
    return "\n".join([head, "", f"| policy | score | % of dense | − {reference}, score points [95 % CI] |",
                      "|---|---|---|---|", *rows])


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--reference", default="keydiff", help="the column every other is compared with")
    a = ap.parse_args()
    print(table(a.model, a.budget, reference=a.reference))


if __name__ == "__main__":
    main()

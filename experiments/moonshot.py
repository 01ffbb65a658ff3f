"""The moonshot's screen (issue 38): designs of ours against dense and each model's best paper policy, on
held-out RULER samples (seed 1, not the scored 42), every task, `--samples` a task, 2048 tokens, N=`--budget`,
B=128, paper protocol, greedy, batch of one task's samples. Prints per model the score and % of dense of
each, the paired difference design - reference with its bootstrap 95 % interval, and a per-task table; writes
them to `--out`/screen.md. Predictions stay under `--out`/ruler/<model>/ (resumable; dense and the reference
are run once for every design):

    VDJAX_CACHE=~/.cache/vdjax-leaderboard nice -n 19 .venv/bin/python experiments/moonshot.py \
        --designs adakv:hybrid,chunkkv:valuediff_dir

The hybrid's mix (its own and inside a design) is the one results/thesis-hybrid-ruler selected on RULER at the
budget (`<model>-mix-N<budget>.json`), as the leaderboard's "hybrid (RULER-selected at N)" row.

`--full` spends the full run on a design that passed the screen: the leaderboard's samples (seed 42, 10 a
task, batch 10, the samples of results/thesis) into `--out`/full/N<budget>/ruler/<model>/ (a folder per
budget: the hybrid's mix differs), whose dense lines are copied from results/thesis as
results/leaderboard/run.sh does; experiments/leaderboard_table.py reads them as rows "<design> (moonshot)":

    VDJAX_CACHE=~/.cache/vdjax-leaderboard nice -n 10 .venv/bin/python experiments/moonshot.py \
        --designs chunkkv:hybrid --full
"""

import argparse
import json
from pathlib import Path

import numpy as np

import vdjax
from vdjax.eval import ruler
from vdjax.eval.runner import evaluate
from vdjax.eval.summary_rows import paired_difference

RESULTS = Path(__file__).resolve().parent.parent / "results"
REFERENCE = {"smollm2-135m": "hybrid", "gemma3-270m": "valuediff_dir"}  # best paper policy at N = 512
MIXES = RESULTS / "thesis-hybrid-ruler"
RUN = "ruler/{model}/paper/L2048/predictions.jsonl"


def kwargs_for(spec: str, model: str, budget: int) -> dict:
    """A policy's keywords for the screen: the RULER-selected mix wherever the hybrid is the base."""
    if spec.split(":")[-1] == "hybrid":
        return {"mix": str(MIXES / f"{model}-mix-N{budget}.json")}
    return {}


def screen(model: str, designs: list[str], samples: int, budget: int, out: Path) -> dict:
    """Run dense, the reference and every design on the held-out samples: {policy: {task: {id: score}}}."""
    params, tok = vdjax.load(model), vdjax.load_tokenizer(model)
    policies = ["dense", REFERENCE[model], *designs]
    path = evaluate(params, tok, "ruler", model_name=model, policies=policies, budgets=[budget], length=2048,
                    num_samples=samples, seed=1, out_dir=out, block_size=128, batch_size=samples,
                    policy_kwargs={p: kwargs_for(p, model, budget) for p in policies if p != "dense"},
                    progress=False)
    scores: dict = {}
    for line in open(path):
        r = json.loads(line)
        if r["policy"] in policies:
            scores.setdefault(r["policy"], {}).setdefault(r["task"], {})[r["sample_id"]] = r["score"]
    return scores


def full_run(model: str, designs: list[str], budget: int, out: Path) -> Path:
    """Run the designs on the leaderboard's samples (seed 42, 10 a task, batch 10) beside results/thesis's
    dense lines (copied in once: the same samples, so every row pairs); returns the predictions file."""
    path = out / RUN.format(model=model)
    if not path.is_file() or path.stat().st_size == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        dense = [ln for ln in (RESULTS / "thesis" / RUN.format(model=model)).read_text().splitlines()
                 if json.loads(ln)["policy"] == "dense"]
        path.write_text("".join(ln + "\n" for ln in dense))
    params, tok = vdjax.load(model), vdjax.load_tokenizer(model)
    return evaluate(params, tok, "ruler", model_name=model, policies=["dense", *designs], budgets=[budget],
                    length=2048, num_samples=10, seed=42, out_dir=out, block_size=128, batch_size=10,
                    policy_kwargs={p: kwargs_for(p, model, budget) for p in designs}, progress=False,
                    allow_mixed=True)


def mean(by_task: dict) -> float:
    """RULER's score: the mean over tasks of each task's mean, in points."""
    return 100 * float(np.mean([np.mean(list(v.values())) for v in by_task.values()]))


def report(model: str, scores: dict, designs: list[str]) -> list[str]:
    """Markdown lines: each policy's score, % of dense and difference from the reference; then per task."""
    ref = REFERENCE[model]
    dense = mean(scores["dense"])
    n = sum(len(v) for v in scores["dense"].values())
    lines = [f"### {model}: {n} held-out samples (seed 1), reference `{ref}`", "",
             "| policy | score | % of dense | − reference, points [95 % CI] |", "|---|---|---|---|"]
    for p in ["dense", ref, *designs]:
        s = mean(scores[p])
        d = None if p == ref else paired_difference(scores[p], scores[ref])
        diff = "" if d is None else "{:+.1f} [{:+.1f}, {:+.1f}]".format(*d)
        lines.append(f"| `{p}` | {s:.1f} | {100 * s / dense if dense else float('nan'):.1f} % | {diff} |")
    cols = ["dense", ref, *designs]
    lines += ["", "| task | " + " | ".join(f"`{c}`" for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for task in ruler.TASKS:
        cells = [100 * np.mean(list(scores[c].get(task, {}).values()) or [np.nan]) for c in cols]
        lines.append(f"| {task} | " + " | ".join(f"{x:.1f}" for x in cells) + " |")
    return lines + [""]


def main() -> None:
    """Screen the designs on both models and print (and write) the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--designs", required=True, help="comma-separated policy specs (e.g. adakv:hybrid)")
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--out", default="results/leaderboard/moonshot")
    ap.add_argument("--full", action="store_true",
                    help="the full run (seed 42, 10 a task) into OUT/full/N<budget> (leaderboard_table.py)")
    a = ap.parse_args()
    designs, out = a.designs.split(","), Path(a.out)
    if a.full:
        for model in a.models.split(","):
            print(full_run(model, designs, a.budget, out / "full" / f"N{a.budget}"), flush=True)
        return
    lines = [f"# Moonshot screen: N = {a.budget}, RULER 2048, {a.samples} held-out samples a task", ""]
    for model in a.models.split(","):
        lines += report(model, screen(model, designs, a.samples, a.budget, out), designs)
        print("\n".join(lines), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "screen.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

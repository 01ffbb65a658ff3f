"""Expected attention's query statistics in true block mode, chosen on held-out RULER samples (issue 37):
`stats="all"` (every query so far, carried in the cache) against `stats="block"` (the current block's), each
on `--samples` samples of every RULER task but qa (seed 1, not the scored 42, as experiments/choose_mix.py),
2048 tokens, N=`--budget`, B=128, paper protocol, greedy, on each model. Prints per model the mean score of
each and the paired difference (block - all) with its bootstrap 95 % interval; the predictions stay under
`--out/<variant>/` (resumable):

    VDJAX_CACHE=~/.cache/vdjax-leaderboard .venv/bin/python experiments/ea_stats.py
"""

import argparse
import json
from pathlib import Path

import numpy as np

import vdjax
from vdjax.eval import ruler
from vdjax.eval.runner import evaluate
from vdjax.eval.summary_rows import paired_difference


def main() -> None:
    """Run both variants on both models and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--out", default="results/leaderboard/heldout-ea-stats")
    a = ap.parse_args()
    tasks = [t for t in ruler.TASKS if not t.startswith("qa")]
    for model in a.models.split(","):
        params, tok = vdjax.load(model), vdjax.load_tokenizer(model)
        scores = {}
        for stats in ("all", "block"):
            path = evaluate(params, tok, "ruler", model_name=model, policies=["expected_attention"],
                            budgets=[a.budget], length=2048, num_samples=a.samples, tasks=tasks, seed=1,
                            out_dir=Path(a.out) / stats, block_size=128, batch_size=a.samples,
                            policy_kwargs={"expected_attention": {"stats": stats}}, progress=False)
            by_task: dict = {}
            for line in open(path):
                r = json.loads(line)
                if r["policy"] == "expected_attention":
                    by_task.setdefault(r["task"], {})[r["sample_id"]] = r["score"]
            scores[stats] = by_task
        mean = {s: 100 * np.mean([np.mean(list(v.values())) for v in scores[s].values()]) for s in scores}
        d, lo, hi = paired_difference(scores["block"], scores["all"])
        n = sum(len(v) for v in scores["all"].values())
        print(f"{model}: {n} held-out samples; all {mean['all']:.1f}, block {mean['block']:.1f}; block - all "
              f"{d:+.1f} [{lo:+.1f}, {hi:+.1f}]")


if __name__ == "__main__":
    main()

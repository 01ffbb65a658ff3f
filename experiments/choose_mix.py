"""The hybrid's mix for the thesis run, chosen on held-out RULER samples
(`vdjax.app.analyze.select_on_ruler`).

Candidates (`hybrid.candidate_mixes`): the per-layer fit at N=256 and the geometry rule of
results/geometry/<model>/,
ValueDiff, KeyDiff, an even 0.5 mix, and uniform mixes `--extra` (default 0.25 and 0.75). Each runs
`--samples` samples of each RULER task but qa (seed 1, not the scored 42; qa's questions go by index; the
samples of a smaller run are the first ones of a larger) at 2048 tokens, N=`--budget`, B=128, paper protocol,
greedy. The geometry rule stays unless the highest mean score beats it on the same samples beyond their noise
(the paired bootstrap 95 % interval of the difference above 0; `--prior none`: the highest mean score wins, as
the first selections did). One selection per budget: the mix chosen at N serves runs at N. The chosen mix is
written beside this file and copied next to the converted checkpoint as the mix of that budget
(`vdjax-hybrid/fitted-N<budget>.json`), where `vdjax eval --policies hybrid
--budgets <budget>` finds it by name:

    VDJAX_CACHE=/work/vdcache .venv/bin/python experiments/choose_mix.py --model gemma3-270m
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

import vdjax
from vdjax.analysis import hybrid as HY
from vdjax.app import analyze as A

HERE = Path(__file__).resolve().parent.parent / "results" / "thesis-hybrid-ruler"  # where its outputs go

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--budget", type=int, default=512)
ap.add_argument("--samples", type=int, default=8, help="per task (the first selections used 2, then 4)")
ap.add_argument("--extra", default="0.25,0.75", help="uniform mixes added to the candidates ('' for none)")
ap.add_argument("--prior", default="geometry",
                help="the candidate kept unless beaten beyond the noise ('none')")
ap.add_argument("--allow-mixed", action="store_true",
                help="resume onto lines of another fingerprint (the N=512 selections' first 4 samples a task "
                     "were made from the same checkpoint bytes, converted under transformers 5.24.0: see the "
                     "README)")
args = ap.parse_args()

geo = Path("results/geometry") / args.model
fitted, geometry = (HY.load_mix(geo / f"hybrid-{m}.json")["weights"] for m in ("fitted", "geometry"))
candidates = HY.candidate_mixes(fitted, geometry)
for w in filter(None, args.extra.split(",")):
    candidates[f"w{float(w):g}"] = np.full_like(candidates["even"], float(w))
params, tok = vdjax.load(args.model), vdjax.load_tokenizer(args.model)
t0 = time.time()
best, scores, detail = A.select_on_ruler(params, tok, candidates, model_name=args.model, budget=args.budget,
                                         out_dir=HERE / "selection" / args.model / f"N{args.budget}",
                                         samples=args.samples, length=2048, block=128, batch_size=10,
                                         prior=None if args.prior == "none" else args.prior,
                                         allow_mixed=args.allow_mixed, progress=True)
info = {"budget": args.budget, "selection": {"benchmark": "ruler", "seed": A.VALIDATION_SEED,
        "tasks": list(A.validation_tasks()), "samples": args.samples, "length": 2048, "block_size": 128,
        "objective": A.selection_objective(None if args.prior == "none" else args.prior),
        "score": scores, **detail,
        "candidates_from": [str(geo / "hybrid-fitted.json"), str(geo / "hybrid-geometry.json")]},
        "chosen": best, "seconds": round(time.time() - t0)}
path = HY.save_mix(HERE / f"{args.model}-mix-N{args.budget}.json", candidates[best], method="fitted",
                   model=args.model, info=info)
target = HY.mix_path(params, "fitted", args.budget)  # what `--policies hybrid` at this budget uses
target.parent.mkdir(parents=True, exist_ok=True)
shutil.copyfile(path, target)
print(json.dumps({"chosen": best, "score": scores, **detail, "seconds": info["seconds"]}, indent=1))

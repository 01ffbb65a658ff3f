"""Experiment (not the default): answer NLL of each mix at N=512 on Gemma3-270M where the target is the dense
model's own greedy 16-token continuation of 2 calibration prompts per category (label-free). Output:
results/thesis-hybrid-selected/gemma3-270m-dense-target-N512.txt. Run from the repository root:
VDJAX_CACHE=... python experiments/dense_target.py \
    > results/thesis-hybrid-selected/gemma3-270m-dense-target-N512.txt
"""
import json

import numpy as np

import vdjax
from vdjax.analysis import hybrid as HY
from vdjax.analysis.calibration import Probe, calibration_prompts

params = vdjax.load("gemma3-270m")
tok = vdjax.load_tokenizer("gemma3-270m")
fit = json.load(open("results/thesis-hybrid-selected/gemma3-270m-mix-N512.json"))
w = np.array(fit["per_layer_fit"])
cands = {"fitted": w, "valuediff": np.ones_like(w), "keydiff": np.zeros_like(w), "even": np.full_like(w, 0.5)}
prompts = calibration_prompts(tok, 2048, 2, categories=("narrative", "qa", "code", "math"))
ids = [list(p.ids) for p in prompts]
dense = vdjax.generate(params, ids, "dense", max_new_tokens=16, eos_token_id=[])
probes = [Probe(p.name, p.ids, tuple(int(t) for t in row)) for p, row in zip(prompts, dense, strict=True)]
out = {}
for cat in ("narrative", "qa", "code", "math"):
    _, nll = HY.select(params, [p for p in probes if p.name.startswith(cat)], cands, budget=512,
                       reference=False)
    out[cat] = nll
    print(cat, json.dumps(nll), flush=True)

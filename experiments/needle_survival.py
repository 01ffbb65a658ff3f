"""Where a policy loses a RULER needle (issue 38's "which tasks break and why"): for each sample of a task
(seed 42, the leaderboard's samples, paper protocol: the whole prompt block-prefilled), prefill under each
policy at N and report, per layer (mean over samples and KV heads), the share of the needle's value tokens
(the answer), of its key tokens (the queried key's words in the needle) and of the whole needle sentence that
the (layer, KV head) caches still hold, the first token (the attention sink of a sink-dominated model) and the
last 64 (the question).

    VDJAX_CACHE=~/.cache/vdjax-leaderboard .venv/bin/python experiments/needle_survival.py \
        --model smollm2-135m --task niah_single_2 --policies hybrid,chunkkv:hybrid --samples 4

A phrase's tokens are the prompt tokens whose character span overlaps its first occurrence in the rendered
prompt: the needle's, as the context precedes the question. The hybrid's mix is the one
results/thesis-hybrid-ruler selected on RULER at N (as experiments/moonshot.py uses).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import vdjax
from vdjax.eval import ruler
from vdjax.eval.sample import render_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moonshot import kwargs_for  # noqa: E402  (experiments/ is no package)


def phrase_positions(offsets, text: str, phrase: str) -> np.ndarray:
    """Positions of the tokens (character `offsets` [T, 2]) overlapping `phrase`'s first occurrence in
    `text`."""
    start = text.find(phrase)
    if start < 0:
        raise ValueError(f"{phrase!r} is not in the prompt")
    end = start + len(phrase)
    return np.asarray([i for i, (a, b) in enumerate(offsets) if a < end and b > start])


def needle(text: str, value: str) -> str:
    """The needle sentence ("One of the special magic ... is: <value>.") of `value`'s first occurrence."""
    end = text.find(value) + len(value) + 1
    return text[text.rfind("One of the special magic", 0, end):end]


def survival(model: str, task: str, policies: list[str], samples: int, budget: int) -> dict:
    """{policy: {"value"|"key"|"sentence"|"first"|"last64": [S, L, K] share of those tokens each cache
    holds}}."""
    params, tok = vdjax.load(model), vdjax.load_tokenizer(model)
    out: dict = {}
    for sample in ruler.build(task, tok, length=2048, num_samples=samples, seed=42):
        text, _ = render_text(tok, sample)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], np.int32)
        where = {"value": phrase_positions(enc["offset_mapping"], text, sample.answers[0]),
                 "key": phrase_positions(enc["offset_mapping"], text, sample.extra["keys"][0]),
                 "sentence": phrase_positions(enc["offset_mapping"], text, needle(text, sample.answers[0])),
                 "first": np.asarray([0]),  # the first token: the sink of a sink-dominated model
                 "last64": np.arange(len(ids) - 64, len(ids))}  # the question and the answer prefix
        for policy in policies:
            kw = kwargs_for(policy, model, budget)
            cache, _ = vdjax.prefill(params, ids[None], policy=policy, budget=budget, block_size=128, **kw)
            layers = [layer[0] for layer in cache.kept_positions() if layer is not None]  # row 0: [L][K]
            for name, pos in where.items():
                held = [[np.isin(pos, heads).mean() for heads in layer] for layer in layers]  # [L, K]
                out.setdefault(policy, {}).setdefault(name, []).append(held)
    return {p: {n: np.asarray(v) for n, v in d.items()} for p, d in out.items()}


def main() -> None:
    """Print, per policy and layer, the shares of the needle's, the sink's and the question's tokens held."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="niah_single_2", choices=ruler.TASKS)
    ap.add_argument("--policies", default="hybrid,chunkkv:hybrid")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--budget", type=int, default=512)
    a = ap.parse_args()
    res = survival(a.model, a.task, a.policies.split(","), a.samples, a.budget)
    rows = {p: {n: [round(float(x), 2) for x in h.mean(axis=(0, 2))] for n, h in d.items()}
            for p, d in res.items()}  # h [S, L, K] -> [L]: the mean share per layer over samples and heads
    print(json.dumps({"model": a.model, "task": a.task, "budget": a.budget, "samples": a.samples,
                      "held_per_layer": rows}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""kvpress 0.5.5's kept positions for one prefill: the reference vdjax's presses are checked against.

    .venv-kvpress/bin/python bench/kvpress_reference.py --model DIR --ids ids.json --budget 128 \\
        --press keydiff,adakv:keydiff,adakv:keynorm,criticalkv:keydiff,criticaladakv:keydiff,pyramidkv \\
        --window-size 4 --out kept.json

Runs under the kvpress interpreter (.venv-kvpress: kvpress needs transformers < 5.3). Loads the HF folder once
in fp32 with sdpa attention (AdaKV's masking refuses eager), then for each press (comma-separated vdjax names:
keydiff, keynorm, expected_attention, cur, random, adakv:<base>, criticalkv:<base>, criticaladakv:<base>,
pyramidkv) prefills the ids (a JSON list) once under it and records, per layer and KV head, the sorted prompt
positions it keeps: a gathering press's (ScorerPress: KeyDiff, Knorm, ExpectedAttention, CUR, Random,
CriticalKV, PyramidKV) by matching its kept key rows to the full ones exactly, a masking press's (AdaKV,
CriticalAdaKV) as the complement of `module.masked_key_indices`.
compression_ratio is 1 - budget / T (kvpress's n_kept = int(T * (1 - ratio)) must come out as the budget).

`--presses FILE` instead: a JSON object {id: {"policy": vdjax name, "kwargs": {...}}}, the keywords given to
the base press (e.g. {"use_vnorm": false} for ExpectedAttentionPress; names as vdjax's, which are kvpress's).
`random` is RandomPress with its draw replaced by the numbers of `--random-scores` (a .npy [L, K, T]: per
layer and KV head the score of each prompt position, e.g. vdjax's own), so both sides rank the same numbers.

Writes {"T", "budget", "ratio", "presses": {id: {"press": repr, "kept": [layer][head][positions],
"layer_budgets": [cache length of each layer after a gathering press; None for a masking one]}}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import kvpress
import numpy as np
import torch
import transformers
from kvpress.presses.base_press import BasePress
from kvpress.utils import compute_n_kept
from transformers import AutoModelForCausalLM, DynamicCache


@dataclasses.dataclass
class GivenRandomPress(kvpress.RandomPress):
    """RandomPress ranking given numbers instead of its torch.rand draw: `draws` [L, K, T], layer l's scores
    draws[l] (the rest, the top-k and the gather, is RandomPress's own)."""

    draws: np.ndarray = dataclasses.field(default=None, repr=False)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        """The given draw of this layer, [1, K, T] in the keys' dtype."""
        s = torch.from_numpy(np.ascontiguousarray(self.draws[module.layer_idx]))[None].to(keys.dtype)
        if s.shape != keys.shape[:-1]:
            raise ValueError(f"--random-scores holds {tuple(s.shape)} for layer {module.layer_idx}, the keys "
                             f"{tuple(keys.shape[:-1])}")
        return s


BASES = {"keydiff": kvpress.KeyDiffPress, "keynorm": kvpress.KnormPress,
         "expected_attention": kvpress.ExpectedAttentionPress, "cur": kvpress.CURPress,
         "random": GivenRandomPress}
MASKING = (kvpress.AdaKVPress, kvpress.CriticalAdaKVPress)


def make_base(base: str, ratio: float, kwargs: dict, a) -> BasePress:
    """The base ScorerPress of a vdjax base policy name at `ratio` with `kwargs` (its own field names)."""
    cls = BASES[base]
    kwargs = dict(kwargs)
    if base == "random":
        if a.random_scores is None:
            raise SystemExit("press random needs --random-scores (the numbers both sides rank)")
        kwargs["draws"] = np.load(a.random_scores)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise SystemExit(f"{cls.__name__} has no field(s) {unknown}")
    return cls(compression_ratio=ratio, **kwargs)


def make_press(name: str, ratio: float, a, kwargs: dict | None = None) -> BasePress:
    """The kvpress press of a vdjax policy name at `ratio`, with the hyper-parameters of `a` (the wrappers')
    and `kwargs` (the base press's)."""
    if name == "pyramidkv":
        return kvpress.PyramidKVPress(compression_ratio=ratio, window_size=a.window_size,
                                      kernel_size=a.kernel_size, beta=a.beta, **(kwargs or {}))
    wrapper, _, base = name.rpartition(":")
    press = make_base(base, ratio, kwargs or {}, a)
    if wrapper == "adakv":
        return kvpress.AdaKVPress(press, alpha_safeguard=a.alpha_safeguard)
    if wrapper == "criticalkv":
        return kvpress.CriticalKVPress(press, epsilon=a.epsilon, first_stage_ratio=a.first_stage_ratio)
    if wrapper == "criticaladakv":
        return kvpress.CriticalAdaKVPress(press, alpha_safeguard=a.alpha_safeguard, epsilon=a.epsilon,
                                          first_stage_ratio=a.first_stage_ratio)
    if wrapper:
        raise ValueError(f"unknown wrapper {wrapper!r} in {name!r}")
    return press


def match_rows(full: np.ndarray, kept: np.ndarray) -> list[list[int]]:
    """Sorted positions, per head, of the key rows kept [K, n, D] among full [K, T, D] (exact equality)."""
    out = []
    for h in range(full.shape[0]):
        index: dict[bytes, int] = {}
        for i, row in enumerate(full[h]):
            index.setdefault(row.tobytes(), i)
        pos = [index.get(row.tobytes(), -1) for row in kept[h]]
        if -1 in pos:
            raise RuntimeError(f"head {h}: a kept key row matches no prompt row")
        out.append(sorted(pos))
    return out


@dataclasses.dataclass
class Recorder(BasePress):
    """Runs `press` and records, per layer, the positions each KV head keeps."""

    press: BasePress = None
    kept: dict = dataclasses.field(default_factory=dict)
    rows: dict = dataclasses.field(default_factory=dict)  # cache length per layer after a gathering press

    def post_init_from_model(self, model):
        """Passed on to the wrapped press."""
        self.press.post_init_from_model(model)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """The wrapped press's compression, its kept positions recorded."""
        k2, v2 = self.press.compress(module, hidden_states, keys, values, attentions, kwargs)
        kh, t = keys.shape[1], keys.shape[2]
        if isinstance(self.press, MASKING):
            _, heads, seq = (x.cpu().numpy() for x in module.masked_key_indices)
            keep = np.ones((kh, t), bool)
            keep[heads, seq] = False
            self.kept[module.layer_idx] = [np.flatnonzero(keep[h]).tolist() for h in range(kh)]
        else:
            self.rows[module.layer_idx] = k2.shape[2]
            self.kept[module.layer_idx] = match_rows(keys[0].float().numpy(), k2[0].float().numpy())
        return k2, v2


def main(argv=None):
    """Parse the arguments, run every press, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint folder")
    p.add_argument("--ids", required=True, help="JSON list of prompt token ids")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--press", help="comma-separated vdjax policy names")
    which.add_argument("--presses", help='JSON file: {id: {"policy": name, "kwargs": {base press keywords}}}')
    p.add_argument("--random-scores", help="random's draws: .npy [L, K, T] (float32)")
    p.add_argument("--budget", type=int, required=True, help="kept positions per head (kvpress n_kept)")
    p.add_argument("--window-size", type=int, default=64, help="PyramidKV/SnapKV window")
    p.add_argument("--kernel-size", type=int, default=5, help="PyramidKV/SnapKV pooling kernel")
    p.add_argument("--beta", type=int, default=20, help="PyramidKV beta")
    p.add_argument("--alpha-safeguard", type=float, default=0.2, help="AdaKV safeguard fraction")
    p.add_argument("--epsilon", type=float, default=1e-4, help="CriticalKV epsilon")
    p.add_argument("--first-stage-ratio", type=float, default=0.5, help="CriticalKV stage-1 share")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", required=True, help="output JSON")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    ids = json.loads(Path(a.ids).read_text())
    t = len(ids)
    ratio = 1 - a.budget / t
    if compute_n_kept(t, ratio) != a.budget:
        raise SystemExit(f"no exact compression_ratio: kvpress keeps {compute_n_kept(t, ratio)} of {t}, "
                         f"not {a.budget}; choose T and budget with T * (1 - ratio) exact")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    x = torch.tensor([ids], dtype=torch.int64)
    result = {"T": t, "budget": a.budget, "ratio": ratio, "presses": {}}
    if a.presses:
        given = json.loads(Path(a.presses).read_text())
        specs = {k: (v["policy"], v.get("kwargs", {})) for k, v in given.items()}
    else:
        specs = {name: (name, {}) for name in a.press.split(",")}
    for name, (policy, kwargs) in specs.items():
        rec = Recorder(press=make_press(policy, ratio, a, kwargs))
        t0 = time.perf_counter()
        with torch.inference_mode(), rec(model):
            model(input_ids=x, past_key_values=DynamicCache(), logits_to_keep=1)
        kept = [rec.kept[i] for i in sorted(rec.kept)]
        rows = [rec.rows[i] for i in sorted(rec.rows)] or None
        result["presses"][name] = {"press": repr(rec.press), "s": round(time.perf_counter() - t0, 3),
                                   "kept": kept, "layer_budgets": rows}
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

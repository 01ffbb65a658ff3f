#!/usr/bin/env python
"""kvpress 0.5.5's kept positions for one prefill: the reference vdjax's presses are checked against.

    .venv-kvpress/bin/python bench/kvpress_reference.py --model DIR --ids ids.json --budget 128 \\
        --press keydiff,adakv:keydiff,adakv:keynorm,criticalkv:keydiff,criticaladakv:keydiff,pyramidkv \\
        --window-size 4 --out kept.json

Runs under the kvpress interpreter (.venv-kvpress: kvpress needs transformers < 5.3). Loads the HF folder once
in fp32 with sdpa attention (AdaKV's masking refuses eager), then for each press (comma-separated vdjax names:
keydiff, keynorm, expected_attention, cur, random, lagkv, leverage, qfilter, compactor, adakv:<base>,
criticalkv:<base>, criticaladakv:<base>, chunkkv:<base>, pyramidkv, kvzip, adakv:kvzip) prefills the ids (a
JSON list) once under it and records, per layer and KV head, the sorted prompt positions it keeps: a
gathering press's (ScorerPress: KeyDiff, Knorm, ExpectedAttention, CUR, Random, LagKV, LeverageScore, QFilter,
Compactor, CriticalKV, PyramidKV, ChunkKV) by matching its kept key rows to the full ones exactly, a masking
press's (AdaKV, CriticalAdaKV, KVzip) as the complement of `module.masked_key_indices`.
compression_ratio is 1 - budget / T (kvpress's n_kept = int(T * (1 - ratio)) must come out as the budget).

`--presses FILE` instead: a JSON object {id: {"policy": vdjax name, "kwargs": {...}}}, the keywords given to
the base press (e.g. {"use_vnorm": false} for ExpectedAttentionPress; names as vdjax's, which are kvpress's);
optionally per press "ids" (a JSON file of other prompt ids) and "budget" (another budget: ChunkKV keeps whole
chunks, so it needs a prompt of whole chunks), "arrays" ({base press field: a .npy file}, the numbers a press
would otherwise draw or download) and "scores": true (record the base press's scores too, [layer][head][T],
to compare up to ties).
`random` is RandomPress with its draw replaced by the numbers of `--random-scores` (a .npy [L, K, T]: per
layer and KV head the score of each prompt position, e.g. vdjax's own), so both sides rank the same numbers.
`leverage` is LeverageScorePress; with an array "sketch" (.npy [L, K, D, m], standard normal) its
`torch.randn` sketch draw of layer l is replaced by sketch[l] (kvpress scales it by 1 / sqrt(m) as always).
`qfilter` is QFilterPress with the filters of its array "filters" (.npy [L, K, D]) instead of the Hub's.
`compactor` is CompactorPress (blending None: its compression_ratio); with an array "sketch" (as leverage's)
its LeverageScorePress projects on sketch[l]; with the keyword "exact_last_tile": true its non-causal
attention attends a partial last tile exactly (its own queries to its own keys) instead of kvpress's padding
(zero queries that attend to the whole padded tile, padded keys at logit -1e-9 instead of -inf), as vdjax
does.
`adakv:kvzip` is KVzipPress(layerwise=True) (one pool of K * N per layer, vdjax's `adakv:kvzip` with
alpha_safeguard 0: KVzip has no safeguard), `kvzip` KVzipPress() (layerwise=False: one top-k over every layer,
which vdjax does not offer); with "scores": true the scores it ranks ([layer][head][T], its sinks at max + 1).
KVzipPress loads the model folder's tokenizer and, when it has a chat template, replays (and scores) the
prompt only after the template's prefix; here the tokenizer it loads has its chat template removed (suffix
"\n", prefix_length 0: every prompt token replayed, as vdjax replays them) unless the keyword
"chat_template": true keeps it. Its entry then has "replay": the ids it replayed (repeat_ids, the first
chunk's prompt; continue_ids; suffix_ids; per chunk its prompt), prefix_length, and at layer 0 per chunk its
[start, end) of the context, the sink keys in its softmax and the replay's position ids (first, last, count).

Writes {"T", "budget", "ratio", "presses": {id: {"press": repr, "T", "budget", "kept":
[layer][head][positions], "layer_budgets": [cache length of each layer after a gathering press; None for a
masking one], "scores": [layer][head][T] or None, "replay": KVzip's (above) or None}}}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from unittest import mock

import kvpress
import numpy as np
import torch
import transformers
from kvpress.presses import kvzip_press
from kvpress.presses.base_press import BasePress
from kvpress.presses.non_causal_attention_press import NonCausalAttnPress
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


@dataclasses.dataclass
class GivenSketchLeveragePress(kvpress.LeverageScorePress):
    """LeverageScorePress whose Gaussian sketch of layer l is sketch[l] ([K, D, m] standard normal draws, e.g.
    vdjax's) instead of its `torch.randn` draw; the rest (centring, 1 / sqrt(m), Cholesky with jitter 1e-2,
    z-score) is kvpress's own. Without a sketch, kvpress's draw."""

    sketch: np.ndarray = dataclasses.field(default=None, repr=False)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        """kvpress's score with `torch.randn` answering this layer's given draw."""
        if self.sketch is None:
            return super().score(module, hidden_states, keys, values, attentions, kwargs)
        draw = self.sketch[module.layer_idx]

        def randn(*shape, device=None, dtype=None, **_):
            phi = torch.from_numpy(np.ascontiguousarray(draw))[None].to(device=device, dtype=dtype)
            if tuple(phi.shape) != tuple(shape):
                raise ValueError(f"the given sketch of layer {module.layer_idx} is {tuple(phi.shape)}, "
                                 f"kvpress draws {tuple(shape)}")
            return phi

        with mock.patch.object(torch, "randn", randn):
            return super().score(module, hidden_states, keys, values, attentions, kwargs)


class ExactTileNonCausalAttnPress(NonCausalAttnPress):
    """NonCausalAttnPress whose partial last tile is attended exactly (its queries attend to its keys only)
    instead of padded: kvpress pads it with zero queries, which attend uniformly to the whole padded tile,
    and zero keys with logit -1e-9 instead of -inf, which take their share of every softmax there. The
    whole tiles are kvpress's own computation."""

    @staticmethod
    def non_causal_chunked_attn(q: torch.Tensor, k: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """kvpress's column sums over the whole tiles, then the partial last tile's exact ones."""
        whole = (q.shape[-2] // chunk_size) * chunk_size
        parts = []
        if whole:
            parts.append(NonCausalAttnPress.non_causal_chunked_attn(q[..., :whole, :], k[..., :whole, :],
                                                                    chunk_size))
        if whole < q.shape[-2]:
            dots = torch.matmul(q[..., whole:, :], k[..., whole:, :].transpose(-2, -1))
            parts.append(torch.softmax(dots.to(torch.float32), dim=-1).sum(dim=-2))
        return torch.cat(parts, dim=-1)


@dataclasses.dataclass
class GivenSketchCompactorPress(kvpress.CompactorPress):
    """CompactorPress whose leverage part projects on the given sketch (`GivenSketchLeveragePress`'s
    sketch[l], [L, K, D, m] standard normal draws, e.g. vdjax's) instead of its `torch.randn` draw; the rest
    (sinks, non-causal tile attention, avg-pooling, z-scores, blending) is kvpress's own. `exact_last_tile`:
    a partial last tile of the non-causal attention attended exactly (`ExactTileNonCausalAttnPress`, as vdjax
    does) instead of kvpress's padding."""

    sketch: np.ndarray = dataclasses.field(default=None, repr=False)
    exact_last_tile: bool = False

    def __post_init__(self):
        """kvpress's child presses, the leverage one (and with exact_last_tile the attention one) replaced."""
        super().__post_init__()
        self._leverage_press = GivenSketchLeveragePress(compression_ratio=self.compression_ratio,
                                                        sketch_dimension=self.sketch_dimension,
                                                        sketch=self.sketch)
        if self.exact_last_tile:
            self._non_causal_press = ExactTileNonCausalAttnPress(compression_ratio=self.compression_ratio,
                                                                 chunk_size=self.chunk_size)


@dataclasses.dataclass
class GivenQFilterPress(kvpress.QFilterPress):
    """QFilterPress with given filters [L, K, D] (e.g. the ones vdjax scores with) instead of the Hub's."""

    filters: np.ndarray = dataclasses.field(default=None, repr=False)
    q_filters: torch.Tensor = dataclasses.field(init=False, default=None, repr=False)

    def post_init_from_model(self, model):
        """The given filters in the model's dtype (no download)."""
        if self.filters is None:
            raise SystemExit("press qfilter needs its filters: an array \"filters\" (.npy [L, K, D]) in "
                             "--presses (this script downloads nothing)")
        self.q_filters = torch.from_numpy(np.asarray(self.filters)).to(model.dtype)


# kvpress's KVzipPress.prepare's prompt for every chunk after the first (followed by the previous chunk's
# last 8 tokens): recorded as continue_ids when the prompt is a single chunk (else taken from the second
# chunk)
KVZIP_CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclasses.dataclass
class RecordingKVzipPress(kvpress.KVzipPress):
    """KVzipPress recording what it replays and ranks (`record`); the rest is kvpress's own. `chat_template`
    False: the tokenizer KVzipPress loads has its chat template removed (suffix "\\n", prefix_length 0, every
    prompt token replayed and scored, as vdjax does); True: kvpress's own (the template's prefix tokens not
    replayed, their scores left at 0)."""

    chat_template: bool = False
    record: dict = dataclasses.field(default_factory=dict, repr=False)

    @contextlib.contextmanager
    def __call__(self, model):
        """kvpress's context manager, its tokenizer loaded without a chat template unless `chat_template`."""
        own = kvzip_press.AutoTokenizer

        class Tokenizers:
            @staticmethod
            def from_pretrained(*args, **kwargs):
                tok = own.from_pretrained(*args, **kwargs)
                if not self.chat_template:
                    tok.chat_template = None
                return tok

        self.record.clear()
        self.record["chunks"] = []
        with mock.patch.object(kvzip_press, "AutoTokenizer", Tokenizers), super().__call__(model):
            yield

    def prepare(self, model, tokenizer, prev_postfix_size=8):
        """kvpress's chunks, each replay's ids split into its prompt, the suffix and the chunk."""
        pairs = super().prepare(model, tokenizer, prev_postfix_size)
        suffix = self._suffix_ids[0].tolist()
        prompts = []
        for a_ids, replay in pairs:
            r, chunk = replay[0].tolist(), a_ids[0].tolist()
            head = len(r) - len(chunk) - len(suffix)
            if r[head:] != suffix + chunk:
                raise RuntimeError("a KVzip replay is not its prompt, the suffix and its chunk")
            prompts.append(r[:head])
        cont = (prompts[1][:-prev_postfix_size] if len(prompts) > 1
                else tokenizer.encode(KVZIP_CONTINUE, add_special_tokens=False))
        self.record.update(prefix_length=int(self.prefix_length), suffix_ids=suffix, repeat_ids=prompts[0],
                           continue_ids=cont, prompts=prompts,
                           chunk_lengths=[int(a.shape[1]) for a, _ in pairs])
        return pairs

    def forward_hook(self, module, input, kwargs, output):
        """kvpress's hook; at layer 0 the chunk's context range, its sink keys and the replay's positions."""
        if module.layer_idx == 0:
            pos = kwargs["position_ids"][0].tolist()
            self.record["chunks"].append({"start": int(self.start_idx), "end": int(self.end_idx),
                                          "sink": min(self.n_sink, self.start_idx),
                                          "positions": [pos[0], pos[-1], len(pos)],
                                          "contiguous": pos == list(range(pos[0], pos[0] + len(pos)))})
        return super().forward_hook(module, input, kwargs, output)

    def compress_post(self, model):
        """kvpress's cut, the scores it ranks (its sinks at max + 1) recorded, [L, K, T]."""
        super().compress_post(model)
        self.record["scores"] = self.score_val[:, 0].float().cpu().numpy()


BASES = {"keydiff": kvpress.KeyDiffPress, "keynorm": kvpress.KnormPress,
         "expected_attention": kvpress.ExpectedAttentionPress, "cur": kvpress.CURPress,
         "random": GivenRandomPress, "lagkv": kvpress.LagKVPress, "leverage": GivenSketchLeveragePress,
         "qfilter": GivenQFilterPress, "compactor": GivenSketchCompactorPress}
MASKING = (kvpress.AdaKVPress, kvpress.CriticalAdaKVPress)


def make_base(base: str, ratio: float, kwargs: dict, a, arrays: dict | None = None) -> BasePress:
    """The base ScorerPress of a vdjax base policy name at `ratio` with `kwargs` (its own field names) and
    `arrays` ({field: .npy path}, loaded)."""
    cls = BASES[base]
    kwargs = {**kwargs, **{name: np.load(path) for name, path in (arrays or {}).items()}}
    if base == "random":
        if a.random_scores is None:
            raise SystemExit("press random needs --random-scores (the numbers both sides rank)")
        kwargs["draws"] = np.load(a.random_scores)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise SystemExit(f"{cls.__name__} has no field(s) {unknown}")
    return cls(compression_ratio=ratio, **kwargs)


def make_press(name: str, ratio: float, a, kwargs: dict | None = None, arrays: dict | None = None
               ) -> BasePress:
    """The kvpress press of a vdjax policy name at `ratio`, with the hyper-parameters of `a` (the wrappers')
    and `kwargs`, `arrays` (the base press's)."""
    if name == "pyramidkv":
        return kvpress.PyramidKVPress(compression_ratio=ratio, window_size=a.window_size,
                                      kernel_size=a.kernel_size, beta=a.beta, **(kwargs or {}))
    wrapper, _, base = name.rpartition(":")
    if base == "kvzip":  # not a ScorerPress: its own context manager and cut (layerwise: vdjax's adakv:)
        if wrapper not in ("", "adakv"):
            raise ValueError(f"{name!r}: KVzipPress runs alone (kvzip) or layerwise (adakv:kvzip)")
        return RecordingKVzipPress(compression_ratio=ratio, layerwise=wrapper == "adakv", **(kwargs or {}))
    press = make_base(base, ratio, kwargs or {}, a, arrays)
    if wrapper == "adakv":
        return kvpress.AdaKVPress(press, alpha_safeguard=a.alpha_safeguard)
    if wrapper == "criticalkv":
        return kvpress.CriticalKVPress(press, epsilon=a.epsilon, first_stage_ratio=a.first_stage_ratio)
    if wrapper == "criticaladakv":
        return kvpress.CriticalAdaKVPress(press, alpha_safeguard=a.alpha_safeguard, epsilon=a.epsilon,
                                          first_stage_ratio=a.first_stage_ratio)
    if wrapper == "chunkkv":
        return kvpress.ChunkKVPress(press, chunk_length=a.chunk_length)
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
    record_scores: bool = False  # record the (base) press's scores per layer too
    scores: dict = dataclasses.field(default_factory=dict)

    def post_init_from_model(self, model):
        """Passed on to the wrapped press."""
        self.press.post_init_from_model(model)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """The wrapped press's compression, its kept positions (and scores) recorded."""
        if self.record_scores:
            scorer = getattr(self.press, "press", self.press)  # a wrapper's base press
            own = scorer.score

            def score(*args):
                s = own(*args)
                self.scores[module.layer_idx] = s[0].float().numpy().tolist()
                return s

            with mock.patch.object(scorer, "score", score):
                k2, v2 = self.press.compress(module, hidden_states, keys, values, attentions, kwargs)
        else:
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


def run_kvzip(model, press: RecordingKVzipPress, x: torch.Tensor) -> tuple[list, list | None]:
    """Prefill x [1, T] under a KVzipPress (its replay and cut run as its context closes): (kept
    [layer][head][positions], the scores it ranked [layer][head][T]); `press.record` holds the rest."""
    with torch.inference_mode(), press(model):
        model(input_ids=x, past_key_values=DynamicCache(), logits_to_keep=1)
    kept = []
    for layer in model.model.layers:
        module = layer.self_attn
        _, heads, seq = (i.cpu().numpy() for i in module.masked_key_indices)
        keep = np.ones((model.config.num_key_value_heads, x.shape[1]), bool)
        keep[heads, seq] = False
        kept.append([np.flatnonzero(k).tolist() for k in keep])
        module.masked_key_indices = None  # the next press's prefill starts unmasked (as kvpress's own does)
    return kept, press.record.pop("scores").tolist()


def check_budget(t: int, budget: int) -> tuple[int, float]:
    """(T, compression_ratio 1 - budget / T), refused unless kvpress's n_kept comes out as the budget."""
    ratio = 1 - budget / t
    if compute_n_kept(t, ratio) != budget:
        raise SystemExit(f"no exact compression_ratio: kvpress keeps {compute_n_kept(t, ratio)} of {t}, "
                         f"not {budget}; choose T and budget with T * (1 - ratio) exact")
    return t, ratio


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
    p.add_argument("--chunk-length", type=int, default=20, help="ChunkKV chunk length")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", required=True, help="output JSON")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    ids = json.loads(Path(a.ids).read_text())
    t, ratio = check_budget(len(ids), a.budget)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    result = {"T": t, "budget": a.budget, "ratio": ratio, "presses": {}}
    if a.presses:
        specs = json.loads(Path(a.presses).read_text())
    else:
        specs = {name: {"policy": name} for name in a.press.split(",")}
    for name, spec in specs.items():
        own_ids = json.loads(Path(spec["ids"]).read_text()) if "ids" in spec else ids
        budget = spec.get("budget", a.budget)
        own_t, own_ratio = check_budget(len(own_ids), budget)
        press = make_press(spec["policy"], own_ratio, a, spec.get("kwargs", {}), spec.get("arrays"))
        x = torch.tensor([own_ids], dtype=torch.int64)
        t0 = time.perf_counter()
        if isinstance(press, RecordingKVzipPress):
            kept, scores = run_kvzip(model, press, x)
            rows, replay = None, dict(press.record)
            scores = scores if spec.get("scores") else None
        else:
            rec = Recorder(press=press, record_scores=bool(spec.get("scores")))
            with torch.inference_mode(), rec(model):
                model(input_ids=x, past_key_values=DynamicCache(), logits_to_keep=1)
            kept = [rec.kept[i] for i in sorted(rec.kept)]
            rows = [rec.rows[i] for i in sorted(rec.rows)] or None
            scores = [rec.scores[i] for i in sorted(rec.scores)] or None
            replay = None
        result["presses"][name] = {"press": repr(press), "s": round(time.perf_counter() - t0, 3),
                                   "T": own_t, "budget": budget, "kept": kept, "layer_budgets": rows,
                                   "scores": scores, "replay": replay}
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

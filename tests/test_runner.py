"""The evaluation runner (resumable predictions.jsonl), the summary report and the `vdjax eval` CLI.

A tiny random Llama, a character tokenizer and a fake benchmark module keep everything but the last test fast;
the last test runs the real SmolLM2-135M through the CLI on RULER (a fake RULER until eval/ruler.py exists).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import os
import random
import re
import sys
import types

import jax
import pytest

import vdjax
from tests.helpers import random_params, tiny_config
from vdjax.app.cli import main
from vdjax.engine import timing
from vdjax.eval import records as rec
from vdjax.eval import report, runner, summary_rows
from vdjax.eval.sample import Sample

CHARS = " abcdefghijklmnopqrstuvwxyz0123456789.,:?\n"


class CharTokenizer:
    """One token per character (BOS = 0, EOS = 1, unknown -> '?'); no chat template."""

    chat_template = None
    bos_token_id, eos_token_id = 0, 1

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        ids = [2 + CHARS.index(c) if c in CHARS else 2 + CHARS.index("?") for c in text.lower()]
        offsets = [(i, i + 1) for i in range(len(text))]
        if add_special_tokens:
            ids, offsets = [self.bos_token_id] + ids, [(0, 0)] + offsets
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = offsets
        return out

    def decode(self, ids, skip_special_tokens=False):
        special = {0: "<s>", 1: "</s>"}
        return "".join(("" if skip_special_tokens else special[i]) if i in special else CHARS[i - 2]
                       for i in ids)


WORDS = ("red", "blue", "green", "sky", "sea", "sun", "the", "is", "a", "code", "of", "key")


def _build(task, tokenizer, *, length, num_samples, seed=0, metric="overlap"):
    """Fake samples: ~length characters of words, two question lengths, 4-5 new tokens."""
    rng = random.Random(f"{task}-{seed}")
    out = []
    for i in range(num_samples):
        n = length - 8 * (i % 3)
        words = []
        while sum(len(w) + 1 for w in words) < n:
            words.append(rng.choice(WORDS))
        answer = f"{rng.randint(10, 99)}"
        context = " ".join(words) + f" the code is {answer}."
        question = "\nq: code?" if i % 2 else "\nq: what code?"
        out.append(Sample(id=f"{task}-{i}", task=task, context=context, question=question,
                          answers=(answer, "sky"), max_new_tokens=4 + i % 2, metric=metric,
                          answer_prefix=" a:"))
    return out


def math500_budget_rule(fractions, dense_lengths):
    from vdjax.eval.math500 import fraction_budgets

    return fraction_budgets(dense_lengths, fractions)


def fake_benchmark(tasks=("alpha", "beta"), metric="overlap", name="fake") -> types.ModuleType:
    """A module with TASKS and build, like vdjax.eval.ruler."""
    module = types.ModuleType(f"fake_{name}")
    module.NAME, module.TASKS = name, tuple(tasks)

    def build(task, tokenizer, *, length, num_samples, seed=0):
        return _build(task, tokenizer, length=length, num_samples=num_samples, seed=seed, metric=metric)

    module.build = build
    module.budget_rule = math500_budget_rule  # accepts budgets as fractions, by MATH-500's rule
    return module


def overlap(prediction, answers, sample):
    """Fraction of the first answer's characters found in the prediction (a graded, deterministic score)."""
    ref = answers[0]
    return sum(c in prediction for c in ref) / len(ref)


def length_score(prediction, answers, sample):
    return min(len(prediction), 4) / 4


METRICS = {"overlap": overlap, "length": length_score}


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(vocab_size=2 + len(CHARS), eos_token_ids=(1,))
    return random_params(cfg, seed=3), CharTokenizer()


def _run(tiny, out, benchmark=None, **kw):
    params, tok = tiny
    args = dict(model_name="tiny", policies=["dense", "valuediff", "streaming"], budgets=[16, 32], length=85,
                num_samples=4, out_dir=out, block_size=16, batch_size=2, metrics=METRICS, progress=False)
    args.update(kw)
    return runner.evaluate(params, tok, benchmark or fake_benchmark(), **args)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _expected_keys(tasks=("alpha", "beta"), n=4, protocol="paper"):
    cfgs = [("dense", None), ("valuediff", 16), ("valuediff", 32), ("streaming", 16), ("streaming", 32)]
    return {(t, f"{t}-{i}", p, b, protocol, 0) for t in tasks for i in range(n) for p, b in cfgs}


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """An uninterrupted run: its predictions file."""
    return _run(tiny, tmp_path_factory.mktemp("ref"))


# ---- runner ------------------------------------------------------------------------------------------------
def test_every_line_once(reference):
    assert reference.parts[-5:] == ("fake", "tiny", "paper", "L85", "predictions.jsonl")
    lines = _lines(reference)
    keys = [rec.record_key(r) for r in lines]
    assert len(keys) == len(set(keys)) == 40
    assert set(keys) == _expected_keys()
    for r in lines:
        assert set(runner.RECORD_FIELDS) <= set(r)
        assert (r["benchmark"], r["model"], r["length"], r["seed"]) == ("fake", "tiny", 85, 0)
        assert r["block_size"] == 16
        assert 0.0 <= r["score"] <= 1.0
        assert r["score"] == overlap(r["prediction"], r["answers"], None)
        assert r["answers"][1] == "sky" and 1 <= r["new_tokens"] <= 4 + int(r["sample_id"][-1]) % 2
        assert r["batch"] == 2 and r["input_tokens"] > 85
        assert min(r["prefill_s"], r["decode_s"], r["compile_s"]) >= 0
        assert r["hyper"] == ({"n_sink": 4} if r["policy"] == "streaming" else {})
        assert (r["budget"] is None) == (r["policy"] == "dense")
        assert r["budget_fraction"] is None  # integer budgets
    meta = json.loads((reference.parent / "run.json").read_text())
    assert [meta[k] for k in ("model", "benchmark", "length", "seed", "protocol", "block_size")] \
        == ["tiny", "fake", 85, 0, "paper", 16]
    inv = meta["invocations"][-1]
    assert inv["tasks"] == ["alpha", "beta"] and inv["samples"] == {"alpha": 4, "beta": 4}
    assert inv["budgets"] == [16, 32] and inv["jax_backend"] == "cpu" and inv["jax_devices"]
    assert "finished" in inv
    assert "vdjax_commit" in inv


def test_batched_equals_one_by_one(tiny, reference, tmp_path, monkeypatch):
    """Ragged batches of 2 give exactly the rows run alone; the paper protocol passes the whole prompt."""
    calls = []
    real_run = vdjax.run
    monkeypatch.setattr(timing, "run", lambda p, ids, *a, **k: calls.append((ids, k.get("question")))
                        or real_run(p, ids, *a, **k))
    single = _run(tiny, tmp_path, batch_size=1, policies=["valuediff"], budgets=[16], tasks=["alpha"])
    samples = _build("alpha", CharTokenizer(), length=85, num_samples=4)
    assert len(calls) == 4
    for (ids, question), s in zip(calls, samples, strict=True):
        assert question is None and len(ids) == 1
        assert len(ids[0]) == 1 + len(s.context) + len(s.question) + len(s.answer_prefix)
    ref = {rec.record_key(r): r for r in _lines(reference)}
    lines = _lines(single)
    assert len(lines) == 4 and all(r["batch"] == 1 for r in lines)
    for r in lines:
        assert (r["prediction"], r["score"]) == (ref[rec.record_key(r)]["prediction"],
                                                 ref[rec.record_key(r)]["score"])


def test_resume_after_crash(tiny, reference, tmp_path, monkeypatch):
    calls = {"n": 0}

    def crashing(prediction, answers, sample):
        calls["n"] += 1
        if calls["n"] > 7:
            raise RuntimeError("simulated crash")
        return overlap(prediction, answers, sample)

    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tiny, tmp_path, metrics={"overlap": crashing})
    path = tmp_path / "fake" / "tiny" / "paper" / "L85" / "predictions.jsonl"
    before = path.read_text().splitlines()
    assert len(before) == 7
    with open(path, "a") as f:  # a crash mid-write: half a line, no newline
        f.write('{"benchmark": "fake", "task": "alpha", "sample_id": "alp')

    seen = []
    real_run = vdjax.run
    monkeypatch.setattr(timing, "run", lambda *a, **k: seen.append(len(a[1])) or real_run(*a, **k))
    assert _run(tiny, tmp_path) == path
    lines = path.read_text().splitlines()
    assert lines[:7] == before  # nothing rewritten
    records = [json.loads(line) for line in lines]
    keys = [rec.record_key(r) for r in records]
    assert len(keys) == len(set(keys)) == 40 and set(keys) == _expected_keys()
    assert sum(seen) == 40 - 7  # only the missing (sample, policy, budget) were generated
    ref = {rec.record_key(r): (r["prediction"], r["score"]) for r in _lines(reference)}
    assert {rec.record_key(r): (r["prediction"], r["score"]) for r in records} == ref
    assert len(json.loads((path.parent / "run.json").read_text())["invocations"]) == 2

    # a third run has nothing to do
    seen.clear()
    _run(tiny, tmp_path)
    assert seen == [] and len(path.read_text().splitlines()) == 40
    assert len(json.loads((path.parent / "run.json").read_text())["invocations"]) == 2  # no empty record


def test_read_predictions_repairs_only_the_tail(tmp_path):
    path = tmp_path / "predictions.jsonl"
    good = {"task": "t", "sample_id": "1", "policy": "dense", "budget": None, "protocol": "paper"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(good | {"sample_id": "2"}))  # complete, no newline
    assert len(rec.read_predictions(path, repair=True)) == 2
    assert path.read_text().endswith("}\n")
    path.write_text(json.dumps(good) + "\nnot json\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        rec.read_predictions(path)
    path.write_text(json.dumps(good) + "\n{\"task\": \n")  # torn line followed by its newline
    assert len(rec.read_predictions(path, repair=True)) == 1
    assert path.read_text() == json.dumps(good) + "\n"


def test_resume_refuses_other_settings(tiny, reference, tmp_path):
    import shutil

    shutil.copytree(reference.parent.parent.parent.parent.parent, tmp_path, dirs_exist_ok=True)
    with pytest.raises(ValueError, match="seed=0.*seed=1"):
        _run(tiny, tmp_path, seed=1)
    with pytest.raises(ValueError, match="block_size"):
        _run(tiny, tmp_path, block_size=32)
    with pytest.raises(ValueError, match="hyper-parameters"):
        _run(tiny, tmp_path, policy_kwargs={"streaming": {"n_sink": 2}})


def test_question_agnostic_uses_question(tiny, tmp_path, monkeypatch):
    calls = []
    real_run = vdjax.run

    def spy(params, ids, *a, **k):
        calls.append((ids, k.get("question")))
        return real_run(params, ids, *a, **k)

    monkeypatch.setattr(timing, "run", spy)
    path = _run(tiny, tmp_path, protocol="question_agnostic", policies=["dense", "valuediff"], budgets=[16],
                tasks=["alpha"])
    assert path.parts[-3:-1] == ("question_agnostic", "L85")
    records = _lines(path)
    assert len(records) == 8 and {r["protocol"] for r in records} == {"question_agnostic"}
    tok = CharTokenizer()
    samples = {s.id: s for s in _build("alpha", tok, length=85, num_samples=4)}
    assert len(calls) == 4  # 2 question lengths x (dense, valuediff), 2 samples per call
    for ids, question in calls:
        assert question is not None and len(question) == len(ids) == 2
        assert len({len(q) for q in question}) == 1
        for ctx in ids:  # the context ids end at the context (the question is appended by vdjax.run)
            assert tok.decode(ctx, skip_special_tokens=True).endswith(".")
    for r in records:
        s = samples[r["sample_id"]]
        assert r["input_tokens"] == 1 + len(s.context) + len(s.question) + len(s.answer_prefix)


def test_newline_ids():
    """The newline stop ids: CharTokenizer's "\\n"; a leading SentencePiece "▁" piece is dropped."""
    assert runner.stop_ids(CharTokenizer(), "\n") == (2 + CHARS.index("\n"),)

    class Piece(CharTokenizer):  # "\n" -> ["▁", "\n"] like Llama-2's SentencePiece (▁ = id 60 here)
        def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
            return {"input_ids": [60, 43] if text == "\n" else super().__call__(text)["input_ids"]}

        def decode(self, ids, skip_special_tokens=False):
            return "".join(" " if i == 60 else super(Piece, self).decode([i]) for i in ids)

    assert runner.stop_ids(Piece(), "\n") == (43,)

    class NoNewline(CharTokenizer):
        def decode(self, ids, skip_special_tokens=False):
            return super().decode(ids).replace("\n", "?")

    with pytest.raises(ValueError, match=r"encodes the stop string '\\n' as \[43\], none of which decodes"):
        runner.stop_ids(NoNewline(), "\n")


def test_stop_at_newline(tiny, reference, tmp_path, monkeypatch):
    """Samples with stop=("\n",), min_new_tokens=1 (LongBench samsum's rule, declared by its samples) stop at
    (and keep) the first newline, never share a call with the others, and keep at least one new token; the
    others are unchanged."""
    flagged = {"alpha-0", "alpha-2"}  # their reference predictions hold a newline (seed-3 tiny model)
    bench = fake_benchmark()
    build = bench.build
    bench.build = lambda *a, **k: [dataclasses.replace(s, stop=("\n",), min_new_tokens=1) if s.id in flagged
                                   else s for s in build(*a, **k)]
    tok = CharTokenizer()
    prompt_of = {tuple(tok(s.context + s.question + s.answer_prefix)["input_ids"]): s.id
                 for s in _build("alpha", tok, length=85, num_samples=4)}
    calls = []
    real_run = vdjax.run
    monkeypatch.setattr(timing, "run", lambda p, ids, *a, **k: calls.append(
        ({prompt_of[tuple(row)] for row in ids}, k.get("eos_token_id"), k.get("min_new_tokens", 0)))
        or real_run(p, ids, *a, **k))
    path = _run(tiny, tmp_path, bench, tasks=["alpha"], policies=["valuediff"])
    assert len(calls) == 4  # 2 budgets x 2 groups: {alpha-1, alpha-3} and {alpha-0, alpha-2}
    for ids, eos, min_new in calls:
        assert ids in ({"alpha-1", "alpha-3"}, flagged)
        assert eos == ([1, 2 + CHARS.index("\n")] if ids == flagged else None)
        assert min_new == (1 if ids == flagged else 0)
    ref = {rec.record_key(r): r for r in _lines(reference)}
    records = _lines(path)
    assert len(records) == 8
    cut = forced = 0
    for r in records:
        want = ref[rec.record_key(r)]
        if r["sample_id"] in flagged and want["prediction"].startswith("\n"):  # min_new_tokens=1 forbids it
            assert not r["prediction"].startswith("\n") and "\n" not in r["prediction"][:-1]
            assert r["new_tokens"] >= 1
            forced += 1
        elif r["sample_id"] in flagged and "\n" in want["prediction"]:
            end = want["prediction"].index("\n") + 1
            assert (r["prediction"], r["new_tokens"]) == (want["prediction"][:end], end)
            cut += 1
        else:
            assert (r["prediction"], r["new_tokens"]) == (want["prediction"], want["new_tokens"])
    by_key = {(r["sample_id"], r["budget"]): r for r in records}
    # min_new_tokens masking itself: test_pipeline's test_min_new_tokens_masks_eos
    assert cut == 2 and forced == 0
    assert (by_key["alpha-0", 32]["prediction"], by_key["alpha-0", 32]["new_tokens"]) == ("6wu\n", 4)
    assert (by_key["alpha-2", 16]["prediction"], by_key["alpha-2", 16]["new_tokens"]) == ("u\n", 2)
    assert not any(r["prediction"].startswith("\n") for r in records if r["sample_id"] in flagged)


def _dense_record(sample_id, new_tokens, score, tiny):
    from vdjax.eval.provenance import fingerprint

    return {"fingerprint": fingerprint(*tiny)["id"], "benchmark": "fake", "model": "tiny", "length": 85,
            "seed": 0, "protocol": "paper",
            "block_size": 16, "task": "alpha", "sample_id": sample_id, "policy": "dense", "budget": None,
            "budget_fraction": None, "hyper": {}, "prediction": "x", "answers": ["10", "sky"], "score": score,
            "new_tokens": new_tokens}


def test_fraction_budgets_from_recorded_dense(tiny, reference, tmp_path, monkeypatch):
    """Budgets as fractions: computed from the dense new_tokens already in the file (no dense rerun)."""
    folder = tmp_path / "fake" / "tiny" / "paper" / "L85"
    folder.mkdir(parents=True)
    lengths = [40, 50, 70, 100]  # mean 65: 0.25 -> 16.25 -> 16, 0.3 -> 19.5 -> 16, 0.5 -> 32.5 -> 32 (pow2)
    (folder / "predictions.jsonl").write_text("".join(
        json.dumps(_dense_record(f"alpha-{i}", n, 1.0, tiny)) + "\n" for i, n in enumerate(lengths)))
    calls = []
    real_run = vdjax.run
    monkeypatch.setattr(timing, "run", lambda p, ids, pol, budget, *a, **k: calls.append((pol.name, budget))
                        or real_run(p, ids, pol, budget, *a, **k))
    with pytest.warns(UserWarning, match="budgets 0.25 and 0.3 both give budget 16"):
        path = _run(tiny, tmp_path, tasks=["alpha"], policies=["dense", "valuediff"],
                    budgets=[0.5, 0.3, 0.25])
    assert sorted(calls) == [("valuediff", 16)] * 2 + [("valuediff", 32)] * 2  # dense was already done
    records = _lines(path)[4:]
    assert len(records) == 8
    assert {(r["budget"], r["budget_fraction"]) for r in records} == {(16, 0.25), (32, 0.5)}
    ref = {rec.record_key(r): r["prediction"] for r in _lines(reference)}
    assert all(r["prediction"] == ref[rec.record_key(r)] for r in records)  # integer runs at 16/32 agree
    inv = json.loads((folder / "run.json").read_text())["invocations"][-1]
    meta = json.loads((folder / "run.json").read_text())
    assert inv["budgets"] == [0.25, 0.3, 0.5] and meta["dense_mean_new_tokens"] == 65.0
    assert inv["fraction_budgets"] == {"0.25": 16, "0.5": 32}
    assert meta["fraction_budgets"] == {"0.25": 16, "0.3": 16, "0.5": 32}  # frozen, every fraction asked

    # frozen: dense lines that would now give other budgets change nothing for the fractions already set;
    # a new fraction is computed from the dense lengths of now (mean 130: 0.125 -> 16.25 -> 16) and frozen too
    lines = (folder / "predictions.jsonl").read_text().splitlines()
    doubled = [json.dumps(r | {"new_tokens": 2 * r["new_tokens"]}) if r["policy"] == "dense"
               else json.dumps(r) for r in map(json.loads, lines)]
    (folder / "predictions.jsonl").write_text("\n".join(doubled) + "\n")
    calls.clear()
    with pytest.warns(UserWarning, match="budgets 0.125 and 0.25 both give budget 16"):
        _run(tiny, tmp_path, tasks=["alpha"], policies=["dense", "valuediff"], budgets=[0.5, 0.25, 0.125])
    assert calls == []  # budgets 16 and 32 again: all done
    meta = json.loads((folder / "run.json").read_text())
    assert meta["fraction_budgets"] == {"0.125": 16, "0.25": 16, "0.3": 16, "0.5": 32}

    s = report.summarize(path)
    assert {(r.budget, r.fraction) for r in s.rows} == {(16, 0.25), (32, 0.5)}
    md = s.md_path.read_text()
    assert "| tiny | 25% (N=16) | 100.0 |" in md and "| tiny | 50% (N=32) | 100.0 |" in md
    with open(s.csv_path) as f:
        assert {(r["budget"], r["budget_fraction"]) for r in csv.DictReader(f)} == {("16", "0.25"),
                                                                                   ("32", "0.5")}


def test_fraction_budgets_two_phases_resume(tiny, reference, tmp_path, monkeypatch):
    """Every dense run first, then the evicting ones at the budgets from the dense lengths; a crash in the
    second phase resumes with the same budgets and reruns nothing."""
    calls = {"n": 0}

    def crashing(prediction, answers, sample):
        calls["n"] += 1
        if calls["n"] > 6:  # after dense and valuediff on the first group
            raise RuntimeError("simulated crash")
        return overlap(prediction, answers, sample)

    order = []
    real_run = vdjax.run
    monkeypatch.setattr(timing, "run", lambda p, ids, pol, budget, *a, **k: order.append((pol.name, len(ids)))
                        or real_run(p, ids, pol, budget, *a, **k))
    kw = dict(tasks=["alpha"], policies=["valuediff", "dense"], budgets=[0.25])
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tiny, tmp_path, metrics={"overlap": crashing}, **kw)
    assert [p for p, _ in order] == ["dense", "dense", "valuediff", "valuediff"]  # dense of every group first
    path = tmp_path / "fake" / "tiny" / "paper" / "L85" / "predictions.jsonl"
    first = _lines(path)
    assert [r["policy"] for r in first] == ["dense"] * 4 + ["valuediff"] * 2
    # hand-computed: dense lengths 4, 5, 4, 5 (max_new_tokens; no EOS) -> mean 4.5 -> 0.25 x 4.5 -> 1 (pow2)
    assert [r["new_tokens"] for r in first[:4]] == [4, 5, 4, 5]
    assert {(r["budget"], r["budget_fraction"]) for r in first[4:]} == {(1, 0.25)}

    order.clear()
    assert _run(tiny, tmp_path, **kw) == path
    assert order == [("valuediff", 2)]  # the second group only
    records = _lines(path)
    assert records[:6] == first
    keys = [rec.record_key(r) for r in records]
    assert len(keys) == len(set(keys)) == 8
    assert [(r["policy"], r["budget"], r["budget_fraction"]) for r in records[4:]] \
        == [("valuediff", 1, 0.25)] * 4
    ref = {rec.record_key(r): r["prediction"] for r in _lines(reference)}
    assert all(r["prediction"] == ref[rec.record_key(r)] for r in records if r["policy"] == "dense")
    invs = json.loads((path.parent / "run.json").read_text())["invocations"]
    assert [inv["fraction_budgets"] for inv in invs] == [{"0.25": 1}] * 2



def test_evaluate_refuses_bad_input(tiny, tmp_path):
    for kw, match in [
        (dict(protocol="both"), "protocol='both'.*paper"),
        (dict(policies=["nope"]), "unknown policy 'nope'"),
        (dict(budgets=[16, 0]), "budgets entry must be an integer >= 1, got 0"),
        (dict(budgets=None), "budgets must list"),
        (dict(budgets="16"), "budgets must be a list"),
        (dict(budgets=[0.25, 16]), r"budgets=\[0.25, 16\] mixes integers \(cache slots\) and fractions"),
        (dict(budgets=[0.5, 1.0]), r"budgets entry 1.0 is not a fraction in \(0, 1\)"),
        (dict(policies=["valuediff"], budgets=[0.25]),
         r"policies must include 'dense'; got .*\['valuediff'\]"),
        (dict(tasks=["gamma"]), r"tasks=\['gamma'\] not in benchmark 'fake'"),
        (dict(length=0), "length must be an integer >= 1"),
        (dict(batch_size=1.5), "batch_size must be an integer"),
        (dict(model_name="a/b"), "model_name must be"),
        (dict(policy_kwargs={"keydiff": {}}), "policy_kwargs names"),
        (dict(metrics={"length": length_score}), "metric='overlap'"),
        (dict(benchmark="squad"), "benchmark='squad' is unknown"),
        (dict(data_dir=str(tmp_path)), "reads no data folder"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            _run(tiny, tmp_path, **kw)
    with pytest.raises(TypeError, match="unknown keyword"):
        _run(tiny, tmp_path, policy_kwargs={"streaming": {"n_snk": 2}})


# ---- report ------------------------------------------------------------------------------------------------
def _rec(model, task, sid, policy, budget, score):
    return {"benchmark": "ruler", "task": task, "sample_id": sid, "model": model, "length": 4096, "seed": 0,
            "protocol": "paper", "policy": policy, "budget": budget, "block_size": 128, "hyper": {},
            "prediction": "", "answers": [], "score": score}


HAND = [
    # m1 dense: t1 (1, 0) -> 50, t2 (1, 1) -> 100: mean 75
    ("m1", "t1", "a", "dense", None, 1.0), ("m1", "t1", "b", "dense", None, 0.0),
    ("m1", "t2", "a", "dense", None, 1.0), ("m1", "t2", "b", "dense", None, 1.0),
    # budget 64: valuediff t1 50, t2 50 -> 50 (66.7%); keydiff t1 0, t2 100 -> 50 (66.7%): a tie
    ("m1", "t1", "a", "valuediff", 64, 1.0), ("m1", "t1", "b", "valuediff", 64, 0.0),
    ("m1", "t2", "a", "valuediff", 64, 0.5), ("m1", "t2", "b", "valuediff", 64, 0.5),
    ("m1", "t1", "a", "keydiff", 64, 0.0), ("m1", "t1", "b", "keydiff", 64, 0.0),
    ("m1", "t2", "a", "keydiff", 64, 1.0), ("m1", "t2", "b", "keydiff", 64, 1.0),
    # budget 128: valuediff = dense (100%); keydiff missing; streaming partial: t1/a only, 0 vs dense 1 -> 0%
    ("m1", "t1", "a", "valuediff", 128, 1.0), ("m1", "t1", "b", "valuediff", 128, 0.0),
    ("m1", "t2", "a", "valuediff", 128, 1.0), ("m1", "t2", "b", "valuediff", 128, 1.0),
    ("m1", "t1", "a", "streaming", 128, 0.0),
    # m2: dense scores 0 -> retention n/a; best by score
    ("m2", "t1", "a", "dense", None, 0.0), ("m2", "t1", "b", "dense", None, 0.0),
    ("m2", "t1", "a", "valuediff", 64, 1.0), ("m2", "t1", "b", "valuediff", 64, 0.0),
    ("m2", "t1", "a", "keydiff", 64, 0.25), ("m2", "t1", "b", "keydiff", 64, 0.25),
]


def test_report_hand_computed(tmp_path):
    folder = tmp_path / "ruler"
    folder.mkdir()
    lines = [json.dumps(_rec(*row)) for row in HAND]
    (folder / "predictions.jsonl").write_text("\n".join(lines) + "\n" + lines[0] + "\n" + '{"torn')
    s = report.summarize(folder / "predictions.jsonl")
    assert s.policies == ["valuediff", "keydiff", "streaming"]  # registry order, dense apart
    rows = {(r.model, r.budget): r for r in s.rows}
    assert set(rows) == {("m1", 64), ("m1", 128), ("m2", 64)}
    r = rows["m1", 64]
    assert r.dense.score == pytest.approx(75.0) and r.dense.n == 4
    assert r.cells["valuediff"].score == pytest.approx(50.0)
    assert r.cells["valuediff"].retention == pytest.approx(200 / 3)
    assert r.cells["keydiff"].retention == pytest.approx(200 / 3)
    assert r.best == ["valuediff", "keydiff"]
    r = rows["m1", 128]
    assert r.cells["valuediff"].retention == pytest.approx(100.0) and "keydiff" not in r.cells
    assert r.cells["streaming"].score == 0.0 and r.cells["streaming"].retention == 0.0
    assert r.cells["streaming"].n == r.cells["streaming"].paired == 1
    assert r.best == ["valuediff"]
    r = rows["m2", 64]
    assert r.dense.score == 0.0 and r.cells["valuediff"].retention is None
    assert r.best == ["valuediff"]  # no retention: best by score (50 > 25)
    per_task = {(r.model, r.task, r.budget): r for r in s.task_rows}
    assert per_task["m1", "t2", 64].cells["valuediff"].retention == pytest.approx(50.0)
    assert per_task["m1", "t1", 64].cells["keydiff"].retention == pytest.approx(0.0)

    md = s.md_path.read_text()
    assert "| model | budget | dense | valuediff | keydiff | streaming |" in md
    assert "| m1 | 64 | 75.0 | **50.0** (66.7%) | **50.0** (66.7%) | — |" in md
    assert "| m1 | 128 | 75.0 | **75.0** (100.0%) | — | 0.0 (0.0%) |" in md
    assert "| m2 | 64 | 0.0 | **50.0** (n/a) | 25.0 (n/a) | — |" in md
    assert "| m1 | t2 | 64 | 100.0 | 50.0 (50.0%) | **100.0** (100.0%) | — |" in md

    with open(s.csv_path) as f:
        table = list(csv.DictReader(f))
    top = {(r["model"], r["budget"]): r for r in table if r["task"] == "all"}
    assert top["m1", "64"]["dense"] == "75.0000" and top["m1", "64"]["valuediff_retention"] == "66.6667"
    assert top["m1", "64"]["best"] == "valuediff;keydiff"
    assert top["m1", "128"]["keydiff"] == "" and top["m1", "128"]["streaming_n"] == "1"
    assert top["m2", "64"]["valuediff_retention"] == "n/a" and top["m2", "64"]["keydiff"] == "25.0000"
    assert len(table) == 3 + 5  # overall rows + (m1: 2 tasks x 2 budgets, m2: 1 task x 1 budget)
    assert s.png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_names_settings_and_warns_about_mixed_lines(tmp_path):
    """Captions name seed, block size, decoding and hyper-parameters; lines that differ in them are warned
    about (left out when their key is taken, flagged when a table mixes them), never dropped silently."""
    folder = tmp_path / "ruler"
    folder.mkdir()
    lines = [_rec(*row) for row in HAND[:8]]
    for r in lines:
        r["hyper"] = {"n_sink": 4} if r["policy"] == "streaming" else r["hyper"]
    lines[4]["hyper"] = {"window": 32}  # valuediff never had hyper-parameters: a mixed table
    dup = dict(lines[5], seed=1, score=1.0)  # same key as lines[5], another seed: left out, with a warning
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines + [dup]))
    s = report.summarize(folder)
    assert any("1 line(s) of" in w and "differs in seed" in w for w in s.warnings), s.warnings
    assert any("mixes lines of several valuediff hyper-parameters" in w for w in s.warnings), s.warnings
    md = s.md_path.read_text()
    assert (md.startswith("> warning:")
            and 'Settings: seed 0; block 128; decoding greedy; valuediff {"window": 32}' in md)
    assert s.rows[0].cells["valuediff"].score == 50.0  # the first line of the key kept (score 0.0, not 1.0)


def test_report_partial_and_folder(tmp_path):
    """Only evicting results (no dense yet), found through a folder: scores shown, retention '—'."""
    folder = tmp_path / "out" / "ruler" / "m" / "paper" / "L4096"
    folder.mkdir(parents=True)
    (folder / "predictions.jsonl").write_text(json.dumps(_rec("m", "t1", "a", "keydiff", 256, 0.5)) + "\n")
    s = report.summarize(tmp_path / "out")
    assert s.md_path == tmp_path / "out" / "summary.md"
    assert "| m | 256 | — | **50.0** (—) |" in s.md_path.read_text()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no predictions.jsonl"):
        report.summarize(tmp_path / "empty")
    with pytest.raises(ValueError, match="neither a predictions file nor a folder"):
        report.summarize(tmp_path / "missing")


# ---- CLI ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["eval", "squad"], "invalid choice: 'squad'"),
    (["eval", "ruler", "--policies", "dense,nope", "--budgets", "64"], "unknown policy 'nope'"),
    (["eval", "ruler", "--protocol", "both"], "invalid choice: 'both'"),
    (["eval", "ruler", "--budgets", "64,big"],
     r"--budgets: must be comma-separated integers >= 1 \(cache slots\) or fractions in \(0, 1\).*got 'big'"),
    (["eval", "ruler", "--budgets", "0"], "--budgets: must be comma-separated integers >= 1 .*got '0'"),
    (["eval", "ruler", "--budgets", "1.0"], "--budgets: must be comma-separated integers >= 1 .*got '1.0'"),
    (["eval", "ruler", "--budgets", "0.25,64"], "--budgets: mixes integers and fractions in '0.25,64'"),
    (["eval", "math500", "--policies", "valuediff", "--budgets", "0.25,0.5"],
     r"--budgets: fractions \[0.25, 0.5\] .* need 'dense' in --policies"),
    (["eval", "ruler", "--policies", "dense,valuediff"], r"--budgets: the evicting policies \['valuediff'\]"),
    (["eval", "ruler", "--samples", "0"], "--samples: must be an integer >= 1"),
    (["eval", "longbench", "--policies", "dense", "--tasks", "nope"],
     r"--tasks: \['nope'\] not in longbench"),
    (["eval", "longbench", "--policies", "dense"], "--data-dir: benchmark 'longbench' needs its data folder"),
    (["eval", "math500", "--policies", "dense", "--data-dir", "/no/such/dir"], "--data-dir: no such folder"),
    (["eval", "longbench", "--policies", "dense", "--data-dir", "."],
     r"--length: benchmark 'longbench' needs --length N .*model2maxlen.* or --length model"),
    (["eval", "math500", "--policies", "dense", "--data-dir", ".", "--draws", "5"],
     r"draws=5 with greedy decoding"),
])
def test_cli_refuses(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("VDJAX_COMPILE_CACHE", "0")
    if argv[1] == "ruler" and importlib.util.find_spec("vdjax.eval.ruler") is None:
        monkeypatch.setitem(sys.modules, "vdjax.eval.ruler", fake_benchmark(("niah_single_1",), name="ruler"))
    assert main(argv + ["--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_cli_end_to_end_smollm2(smollm2_dir, tmp_path, monkeypatch, capsys):
    """The real model through `vdjax eval`: RULER niah_single_1, 512 tokens, 2 samples, dense + valuediff."""
    monkeypatch.setenv("VDJAX_COMPILE_CACHE", "0")
    if importlib.util.find_spec("vdjax.eval.ruler") is None:  # until eval/ruler.py lands
        monkeypatch.setitem(sys.modules, "vdjax.eval.ruler",
                            fake_benchmark(("niah_single_1",), metric="string_match_all", name="ruler"))
    out = tmp_path / "results"
    rc = main(["eval", "ruler", "--model", str(smollm2_dir), "--tasks", "niah_single_1", "--length", "512",
               "--samples", "2", "--policies", "dense,valuediff", "--budgets", "128", "--block-size", "64",
               "--batch-size", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    folder = out / "ruler" / "smollm2-135m" / "paper" / "L512"
    for name in ("predictions.jsonl", "run.json", "summary.md", "summary.csv", "retention.png"):
        assert (folder / name).is_file(), name
    records = _lines(folder / "predictions.jsonl")
    assert len(records) == 4
    assert {(r["policy"], r["budget"]) for r in records} == {("dense", None), ("valuediff", 128)}
    assert all(0.0 <= r["score"] <= 1.0 and r["task"] == "niah_single_1" for r in records)
    assert all(r["input_tokens"] <= 600 and r["new_tokens"] >= 1 and r["batch"] == 2 for r in records)
    assert "valuediff" in printed and "dense" in printed and "summary" in printed


# ---- provenance, one writer, rescoring, sampled draws -----------------------------------------------------
def test_lines_record_commit_and_fingerprint(tiny, reference, tmp_path):
    """Every line carries the vdjax commit and the (checkpoint, tokenizer, template) fingerprint; resuming
    with another model, dtype or template is refused unless allow_mixed."""
    import shutil

    from vdjax.eval.provenance import fingerprint, git_commit

    params, tok = tiny
    prints = fingerprint(params, tok)
    for r in _lines(reference):
        assert r["fingerprint"] == prints["id"] and r["vdjax_commit"] == git_commit()
        assert r["metric"] == "overlap" and r["draw"] == 0 and r["sampling"] is None
    inv = json.loads((reference.parent / "run.json").read_text())["invocations"][-1]
    assert inv["fingerprint"] == prints
    shutil.copytree(reference.parent.parent.parent.parent.parent, tmp_path, dirs_exist_ok=True)
    other = random_params(params.config, seed=4)  # same shapes, other weights
    assert fingerprint(other, tok)["id"] != prints["id"]
    assert fingerprint(params, tok, {"enable_thinking": False})["id"] != prints["id"]
    assert fingerprint(jax.tree.map(lambda x: x.astype("bfloat16"), params), tok)["id"] != prints["id"]
    with pytest.raises(ValueError, match=f"fingerprint '{prints['id']}'.*allow_mixed=True"):
        _run((other, tok), tmp_path, budgets=[16, 32, 48])
    path = _run((other, tok), tmp_path, budgets=[16, 32, 48], allow_mixed=True)
    mixed = _lines(path)
    assert len(mixed) == 40 + 16 and {r["fingerprint"] for r in mixed[40:]} == {fingerprint(other, tok)["id"]}


def test_checkpoint_fingerprint_is_the_content_not_the_writer_version(tiny, tmp_path):
    """A checkpoint folder's digest covers its config values and weight bytes, not the transformers version
    that wrote it (the offline models, converted again under transformers 5.25.0 instead of 5.24.0, differed
    only in that stamp and got another fingerprint); any other config value or weight byte changes it."""
    from vdjax.eval.provenance import checkpoint_digest
    from vdjax.models.params import Params

    params, _ = tiny

    def folder(name, version, weights=b"w" * 64, **config):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(
            json.dumps({"hidden_size": 8, "transformers_version": version, **config}, indent=2))
        (d / "generation_config.json").write_text(
            json.dumps({"transformers_version": version, "eos_token_id": 1}))
        (d / "model.safetensors").write_bytes(weights)
        return Params(params.weights, params.config, source=str(d))

    a = checkpoint_digest(folder("a", "5.24.0"))
    assert checkpoint_digest(folder("b", "5.25.0")) == a
    assert checkpoint_digest(folder("c", "5.24.0", weights=b"w" * 63 + b"x")) != a
    assert checkpoint_digest(folder("d", "5.24.0", rope_theta=10000.0)) != a


def test_one_writer_per_predictions_file(tiny, tmp_path):
    """A second process writing the same predictions file gets a clear error naming the holder."""
    import subprocess

    path = tmp_path / "fake" / "tiny" / "paper" / "L85" / "predictions.jsonl"
    with rec.PredictionsFile(path):
        code = ("import sys; from vdjax.eval.records import PredictionsFile\n"
                "try:\n    PredictionsFile(sys.argv[1]).__enter__()\nexcept RuntimeError as e:\n"
                "    print(e); sys.exit(3)\n")
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
        assert out.returncode == 3, out.stderr
        assert f"pid {os.getpid()}" in out.stdout and "one writer per file" in out.stdout
        with pytest.raises(RuntimeError, match="being written by another process"):
            _run(tiny, tmp_path)
    _run(tiny, tmp_path, tasks=["alpha"], policies=["dense"], budgets=None)  # released: runs


def test_rescore_recomputes_from_predictions(tiny, reference, tmp_path):
    import shutil

    shutil.copy(reference, tmp_path / "predictions.jsonl")
    path = tmp_path / "predictions.jsonl"
    before = _lines(path)
    n, changed = rec.rescore(path, {"overlap": length_score})
    after = _lines(path)
    assert n == 40 and changed == sum(r["score"] != length_score(r["prediction"], None, None) for r in before)
    assert [r["score"] for r in after] == [length_score(r["prediction"], None, None) for r in before]
    assert [{k: v for k, v in r.items() if k != "score"} for r in after] == \
        [{k: v for k, v in r.items() if k != "score"} for r in before]
    assert rec.rescore(path, {"overlap": length_score}) == (40, 0)
    with pytest.raises(ValueError, match="line 1 .* has metric 'overlap'; known: \\['length'\\]"):
        rec.rescore(path, {"length": length_score})


def test_sampled_draws_are_per_row_and_resume_exactly(tiny, tmp_path):
    """k draws per sample from per-row keys: batched = one by one (up to XLA:CPU rounding by batch size, which
    can flip a near-tie of the sampler: at most 2 of 24 here), and a resumed run redraws only what is
    missing."""
    kw = dict(tasks=["alpha"], policies=["dense", "valuediff"], budgets=[16], draws=3,
              sampling={"temperature": 1.5, "top_p": 0.95})
    batched = _lines(_run(tiny, tmp_path / "a", batch_size=4, **kw))
    single = _lines(_run(tiny, tmp_path / "b", batch_size=1, **kw))
    key = rec.record_key
    assert len(batched) == 4 * 3 * 2 and {key(r) for r in batched} == {key(r) for r in single}
    by_key = {key(r): r["prediction"] for r in single}
    assert sum(r["prediction"] == by_key[key(r)] for r in batched) >= 22  # one shared key would give ~0
    path = tmp_path / "b" / "fake" / "tiny" / "paper" / "L85" / "predictions.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-5]) + "\n")  # five draws lost
    again = _lines(_run(tiny, tmp_path / "b", batch_size=1, **kw))
    assert [(key(r), r["prediction"]) for r in again] == [(key(r), r["prediction"]) for r in single]
    assert {r["draw"] for r in batched} == {0, 1, 2}
    assert batched[0]["sampling"] == {"temperature": 1.5, "top_k": 0, "top_p": 0.95}
    per_sample = {}
    for r in batched:
        per_sample.setdefault((r["sample_id"], r["policy"]), set()).add(r["prediction"])
    assert any(len(v) > 1 for v in per_sample.values())  # the draws differ
    _run(tiny, tmp_path / "greedy", tasks=["alpha"], policies=["dense"], budgets=None)
    with pytest.raises(ValueError, match="sampling=None; this run has sampling="):
        _run(tiny, tmp_path / "greedy", **kw)
    with pytest.raises(ValueError, match="draws=2 with greedy decoding"):
        _run(tiny, tmp_path, draws=2)
    with pytest.raises(ValueError, match="sampling keys \\['temp'\\] unknown"):
        _run(tiny, tmp_path, sampling={"temp": 1.0})


def test_seed_defaults_to_the_benchmark_seed(tiny, tmp_path):
    bench = fake_benchmark()
    bench.SEED = 7
    path = _run(tiny, tmp_path, bench, tasks=["alpha"], policies=["dense"], budgets=None, seed=None)
    assert {r["seed"] for r in _lines(path)} == {7}


# ---- the hybrid's selection on held-out RULER samples ------------------------------------------------------
def test_hybrid_runs_each_budget_with_the_mix_selected_at_it(tiny, tmp_path):
    """A mix saved for a budget (`fitted-N<budget>.json`) is what that budget's lines run and record; another
    budget takes the budget-free mix; run.json lists both; a rerun resumes (no refusal); the report's caption
    names each budget's mix and warns about nothing."""
    from vdjax.analysis import hybrid as HY
    from vdjax.models.params import Params

    params, tok = tiny
    params = Params(params.weights, params.config, source=str(tmp_path / "ckpt"))
    L, K = params.config.num_layers, params.config.num_kv_heads
    HY.save_mix(HY.mix_path(params, "fitted"), [[0.0] * K] * L, method="fitted", model="tiny")
    HY.save_mix(HY.mix_path(params, "fitted", 32), [[1.0] * K] * L, method="fitted", model="tiny")
    kw = dict(policies=["dense", "hybrid", "valuediff", "keydiff"], tasks=["alpha"], num_samples=2)
    path = _run((params, tok), tmp_path / "out", **kw)
    lines = _lines(path)
    mix = {r["budget"]: r["hyper"]["mix"] for r in lines if r["policy"] == "hybrid"}
    assert mix == {16: [[0.0] * K] * L, 32: [[1.0] * K] * L}
    pred = {(r["policy"], r["budget"], r["sample_id"]): r["prediction"] for r in lines}
    for sid in ("alpha-0", "alpha-1"):  # w = 0 is KeyDiff and w = 1 ValueDiff, exactly
        assert pred["hybrid", 16, sid] == pred["keydiff", 16, sid]
        assert pred["hybrid", 32, sid] == pred["valuediff", 32, sid]
    meta = json.loads((path.parent / "run.json").read_text())
    assert meta["invocations"][-1]["hyper"]["hybrid"] == {"by_budget": {"16": {"mix": [[0.0] * K] * L},
                                                                         "32": {"mix": [[1.0] * K] * L}}}
    assert meta["invocations"][-1]["hyper"]["valuediff"] == {}
    assert _run((params, tok), tmp_path / "out", **kw) == path and len(_lines(path)) == len(lines)  # resumed
    s = report.summarize(path)
    assert not s.warnings, s.warnings
    md = s.md_path.read_text()
    assert f'hybrid at N=16 {{"mix": {json.dumps([[0.0] * K] * L)}}}' in md
    assert f'hybrid at N=32 {{"mix": {json.dumps([[1.0] * K] * L)}}}' in md
    HY.save_mix(HY.mix_path(params, "fitted", 16), [[0.5] * K] * L, method="fitted", model="tiny")
    with pytest.raises(ValueError, match="'hybrid' results with hyper-parameters .* at budget 16"):
        _run((params, tok), tmp_path / "out", **kw)  # a new mix for 16 does not resume onto the old lines



def test_budgets_run_apart_with_their_own_mixes_share_one_file(tiny, tmp_path):
    """Each budget run on its own with its own explicit mix (experiments/bytes.py's jobs) adds to the same
    file; only lines at the budgets a run writes must match its hyper-parameters."""
    params, tok = tiny
    L, K = params.config.num_layers, params.config.num_kv_heads
    kw = dict(policies=["hybrid"], tasks=["alpha"], num_samples=2)
    path = _run(tiny, tmp_path, budgets=[32], policy_kwargs={"hybrid": {"mix": 1.0}}, **kw)
    assert _run(tiny, tmp_path, budgets=[16], policy_kwargs={"hybrid": {"mix": 0.0}}, **kw) == path
    mix = {r["budget"]: r["hyper"]["mix"] for r in _lines(path)}
    assert mix == {32: [[1.0] * K] * L, 16: [[0.0] * K] * L}
    with pytest.raises(ValueError, match="'hybrid' results with hyper-parameters .* at budget 16"):
        _run(tiny, tmp_path, budgets=[16], policy_kwargs={"hybrid": {"mix": 0.5}}, **kw)

def test_select_on_ruler_keeps_the_best_mean_score_on_held_out_samples(tiny, tmp_path, monkeypatch):
    """Each candidate mix runs as policy hybrid on RULER samples drawn with seed 1 (not RULER's 42) into its
    own resumable folder (a repeated mix shares its run); the selection is the highest mean of the lines'
    scores (ties: the first), a second call generates nothing, and qa (questions by index, the same for every
    seed) is not among the default tasks."""
    from vdjax.app import analyze as A
    from vdjax.eval import metrics

    params, tok = tiny
    for name in list(metrics.METRICS):  # a score that differs between predictions, so the choice can be wrong
        monkeypatch.setitem(metrics.METRICS, name, lambda p, a, s: (len(p) * 7 + sum(map(ord, p))) % 11 / 10)
    L, K = params.config.num_layers, params.config.num_kv_heads
    cands = {"even": [[0.5] * K] * L, "valuediff": [[1.0] * K] * L, "keydiff": [[0.0] * K] * L}
    tasks = ("niah_single_1", "niah_single_2")
    kw = dict(model_name="tiny", budget=64, block=32, length=768, samples=2, tasks=tasks, batch_size=2)
    best, scores, detail = A.select_on_ruler(params, tok, cands | {"ones": [[1.0] * K] * L}, out_dir=tmp_path,
                                             **kw)
    assert detail == {"highest": best, "prior": None, "difference": None, "level": 0.95}
    assert list(scores) == [*cands, "ones"]
    # same weights: one run
    assert scores.pop("ones") == scores["valuediff"] and not (tmp_path / "ones").exists()
    for name, w in cands.items():
        lines = _lines(tmp_path / name / "ruler" / "tiny" / "paper" / "L768" / "predictions.jsonl")
        assert len(lines) == 4 and {r["task"] for r in lines} == set(tasks)
        assert all(r["seed"] == 1 and r["policy"] == "hybrid" and r["budget"] == 64 for r in lines)
        assert all(r["hyper"]["mix"] == w and r["sample_id"].split("-")[2] == "1" for r in lines)
        assert scores[name] == pytest.approx(sum(r["score"] for r in lines) / 4)
    assert best == max(cands, key=lambda n: scores[n])
    assert len(set(scores.values())) > 1, "the candidates should score differently under this metric"
    calls = []
    monkeypatch.setattr(runner, "run_call", lambda *a, **k: calls.append(a) or iter(()))
    assert A.select_on_ruler(params, tok, cands, out_dir=tmp_path, **kw)[:2] == (best, scores) and not calls
    # a prior stays unless the highest beats it beyond the paired bootstrap interval of the same samples
    others = [n for n in cands if n != best]
    lines = {n: {r["sample_id"]: r["score"]
                 for r in _lines(tmp_path / n / "ruler" / "tiny" / "paper" / "L768" / "predictions.jsonl")}
             for n in cands}
    for prior in others:
        got, _, d = A.select_on_ruler(params, tok, cands, out_dir=tmp_path, prior=prior, **kw)
        assert d["highest"] == best and d["prior"] == prior
        diffs = [lines[best][i] - lines[prior][i] for i in lines[best]]
        # 2 samples a task: same mean
        assert d["difference"][0] == pytest.approx(100 * sum(diffs) / len(diffs))
        assert got == (best if d["difference"][1] > 0 else prior)
    assert A.select_on_ruler(params, tok, cands, out_dir=tmp_path, prior=best, **kw)[0] == best
    with pytest.raises(ValueError, match="prior='nope' is not a candidate"):
        A.select_on_ruler(params, tok, cands, out_dir=tmp_path, prior="nope", **kw)
    assert "qa_1" not in A.validation_tasks() and "fwe" in A.validation_tasks()
    with pytest.raises(ValueError, match="seed=42 is the seed RULER scores with"):
        A.select_on_ruler(params, tok, cands, out_dir=tmp_path, seed=42, **kw)
    with pytest.raises(ValueError, match="at least one candidate"):
        A.select_on_ruler(params, tok, {}, out_dir=tmp_path, **kw)


def test_paired_difference_bootstrap_by_hand():
    """The difference is the task-mean of per-task mean paired differences (x100) over shared samples; a
    constant difference has a zero-width interval; the interval holds the difference, narrows with the level,
    and is the same for the same seed."""
    a = {"t1": {"0": 1.0, "1": 0.0, "2": 1.0}, "t2": {"0": 0.5, "1": 0.5}, "t3": {"0": 1.0}}
    b = {"t1": {"0": 0.0, "1": 0.0, "2": 0.0, "9": 1.0}, "t2": {"0": 0.5, "1": 0.0}}
    d, lo, hi = summary_rows.paired_difference(a, b)
    assert d == pytest.approx(100 * (2 / 3 + 0.25) / 2)  # t3 and b's sample 9 are not shared
    assert 0 <= lo < d < hi <= 100 * (1 + 0.5) / 2
    assert summary_rows.paired_difference(a, b) == (d, lo, hi)
    d50, lo50, hi50 = summary_rows.paired_difference(a, b, level=0.5)
    assert d50 == d and lo <= lo50 <= hi50 <= hi
    const = {"t": {str(i): 0.25 for i in range(5)}}
    assert summary_rows.paired_difference(const, {"t": {str(i): 0.0 for i in range(5)}}) == pytest.approx(
        (25, 25, 25))
    assert summary_rows.paired_difference(a, {"other": {"0": 1.0}}) is None
    with pytest.raises(ValueError, match="level must lie in"):
        summary_rows.paired_difference(a, b, level=95)


# ---- shards ------------------------------------------------------------------------------------------------
TIMINGS = ("prefill_s", "decode_s", "compile_s")


def _content(lines):
    """Lines without their timings (which differ run to run)."""
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in lines]


def test_two_shards_merged_equal_one_run(tiny, reference, tmp_path):
    """Batches k % 2 == 0 and == 1 in two shard files; merged, exactly the single run's lines in its order
    (timings aside). A shard reruns as a resume; a missing shard and a duplicate line are named."""
    from vdjax.eval import shards

    out = tmp_path / "sharded"
    for i in (1, 0):  # any order
        path = _run(tiny, out, shard=f"{i}/2")
        assert path.name == f"predictions.shard-{i}-of-2.jsonl"
    folder = path.parent
    sizes = [len(_lines(folder / f"predictions.shard-{i}-of-2.jsonl")) for i in (0, 1)]
    assert sum(sizes) == len(_lines(reference)) and min(sizes) > 0
    before = (folder / "predictions.shard-0-of-2.jsonl").read_text()
    _run(tiny, out, shard="0/2")  # resumes: nothing left to do
    assert (folder / "predictions.shard-0-of-2.jsonl").read_text() == before
    merged = shards.merge(folder)
    assert merged == folder / "predictions.jsonl"
    assert _content(_lines(merged)) == _content(_lines(reference))
    meta = json.loads((folder / "run.json").read_text())
    assert meta["merged_from"] == ["predictions.shard-0-of-2.jsonl", "predictions.shard-1-of-2.jsonl"]
    assert shards.merge(folder) == merged  # a merge may be redone as shards grow
    (folder / "predictions.shard-1-of-2.jsonl").rename(folder / "aside.jsonl")
    with pytest.raises(ValueError, match="shard\\(s\\) 1/2 missing"):
        shards.merge(folder)
    dup = (folder / "aside.jsonl").read_text() + before.splitlines(keepends=True)[0]
    (folder / "predictions.shard-1-of-2.jsonl").write_text(dup)
    with pytest.raises(ValueError, match="is in shard 0/2 and shard 1/2"):
        shards.merge(folder)


def test_shard_arguments_refused(tiny, tmp_path, capsys):
    with pytest.raises(ValueError, match="shard='2/2': expected I/N with 0 <= I < N"):
        _run(tiny, tmp_path, shard="2/2")
    with pytest.raises(ValueError, match="fractional budgets need every sample's dense length"):
        _run(tiny, tmp_path, budgets=[0.5], shard="0/2")
    assert main(["eval", "merge", str(tmp_path / "nothing")]) == 2
    assert "no predictions.shard-I-of-N.jsonl files to merge" in capsys.readouterr().err
    assert main(["eval", "ruler", "--shard", "1/0"]) == 2
    assert "argument --shard: shard='1/0'" in capsys.readouterr().err


def test_kv_quant_run_has_its_folder_and_bytes(tiny, tmp_path):
    """A quantized cache's run: its own folder, kv_quant and kv_group on every line, the stored bytes below a
    dense cache's of the same tokens; int4 stores less than int8."""
    paths = {q: _run(tiny, tmp_path, policies=["valuediff"], budgets=[16], tasks=["alpha"], kv_quant=q)
             for q in ("int8", "int4")}
    assert paths["int8"].parent.name == "L85-int8-g8" and paths["int4"].parent.name == "L85-int4-g8"
    lines = {q: _lines(p) for q, p in paths.items()}
    for q, rows in lines.items():
        assert len(rows) == 4 and all(r["kv_quant"] == q and r["kv_group"] == 8 for r in rows)
        assert all(0 < r["cache_bytes"] < r["dense_cache_bytes"] for r in rows)
    assert lines["int4"][0]["cache_bytes"] < lines["int8"][0]["cache_bytes"]
    assert all(r.get("kv_quant") is None for r in _lines(_run(tiny, tmp_path, policies=["valuediff"],
                                                              budgets=[16], tasks=["alpha"])))

"""LongBench builder: official prompts (golden text), tables, middle truncation and the context/question
split."""

import hashlib
import json
import re

import pytest

from vdjax.eval import longbench as lb
from vdjax.eval.metrics import DATASET2METRIC
from vdjax.eval.sample import render_ids


class WordTokenizer:
    """Mimics an HF fast tokenizer: each word, punctuation mark and whitespace run is one token;
    id 0 = BOS."""

    def __init__(self):
        self.pieces = ["<s>"]
        self.index = {"<s>": 0}

    def _id(self, piece):
        if piece not in self.index:
            self.index[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.index[piece]

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        ids, offsets = ([0], [(0, 0)]) if add_special_tokens else ([], [])
        for m in re.finditer(r"\s+|\w+|[^\w\s]", text):
            ids.append(self._id(m.group()))
            offsets.append(m.span())
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = offsets
        return out

    def _piece(self, i):
        return self.pieces[i]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self._piece(i) for i in ids if not (skip_special_tokens and i == 0))


class LossyTokenizer(WordTokenizer):
    """Decodes blank lines as one newline (like a tokenizer's space clean-up: decode(encode(x)) != x)."""

    def _piece(self, i):
        piece = self.pieces[i]
        return "\n" if piece.count("\n") > 1 else piece


class MarkingTokenizer(WordTokenizer):
    """Appends a marker to every decoded string: decoding is not prefix-consistent (forces the fallback)."""

    def decode(self, ids, skip_special_tokens=False):
        return super().decode(ids, skip_special_tokens) + "¶"


def _row(task, i, context, input_, answers, all_classes=None, language="en"):
    return {"input": input_, "context": context, "answers": answers, "length": len(context.split()),
            "dataset": task, "language": language, "all_classes": all_classes, "_id": f"{task}-{i:03d}"}


def _write(tmp_path, task, rows):
    with open(tmp_path / f"{task}.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _official(tok, prompt, length):
    """Official pred.py middle truncation (tokenised without special tokens, as the builder does)."""
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    if len(ids) <= length:
        return prompt
    half = length // 2
    return (tok.decode(ids[:half], skip_special_tokens=True)
            + tok.decode(ids[-half:], skip_special_tokens=True))


def _words(prefix, n):
    return " ".join(f"{prefix}{i}" for i in range(n))


HOTPOT_HEAD = ("Answer the question based on the given passages. Only give me the answer and do not "
               "output any other words.\n\nThe following are given passages.\n")
HOTPOT_TAIL = ("\n\nAnswer the question based on the given passages. Only give me the answer and do not "
               "output any other words.\n\nQuestion: {q}\nAnswer:")


def test_tables():
    assert len(lb.TASKS) == 21 and len(set(lb.TASKS)) == 21
    assert set(lb.TASKS) == set(lb.DATASET2PROMPT) == set(lb.DATASET2MAXLEN) == set(DATASET2METRIC)
    assert lb.NO_CHAT_TEMPLATE == ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
    # official config/dataset2maxlen.json
    assert lb.DATASET2MAXLEN == {
        "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
        "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
        "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
        "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
    }
    # sha256 of the official config/dataset2prompt.json (json.dumps(sort_keys=True, ensure_ascii=False))
    digest = hashlib.sha256(
        json.dumps(lb.DATASET2PROMPT, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    assert digest == "e7d865d712fe45e2455f5e864ac474001d7758d68d349e76ffbcdd382483358f"
    for task in lb.TASKS:
        head, tail = lb.split_template(task)
        assert head + "{context}" + tail == lb.DATASET2PROMPT[task]


def test_golden_prompts(tmp_path):
    tok = WordTokenizer()
    _write(tmp_path, "hotpotqa", [_row("hotpotqa", 0, "Passage 1: Paris is in France.", "Where is Paris?",
                                       ["France"])])
    _write(tmp_path, "trec", [_row("trec", 0, "Question: What is a cat?\nType: Description",
                                   "Question: Who?\nType:", ["Human"],
                                   all_classes=["Human", "Description"])])
    _write(tmp_path, "gov_report", [_row("gov_report", 0, "The report body.", "", ["A summary."])])
    _write(tmp_path, "multifieldqa_zh", [_row("multifieldqa_zh", 0, "北京是中国的首都。",
                                              "中国的首都是哪里？", ["北京"], language="zh")])

    (s,) = lb.build("hotpotqa", tok, length=1000, num_samples=5, seed=3, data_dir=tmp_path)
    assert s.context == HOTPOT_HEAD + "Passage 1: Paris is in France."
    assert s.question == HOTPOT_TAIL.format(q="Where is Paris?")
    assert (s.id, s.task, s.answers, s.max_new_tokens, s.metric) == (
        "hotpotqa-000", "hotpotqa", ("France",), 32, "qa_f1")
    assert s.chat_template is True and s.answer_prefix == ""
    assert s.extra["language"] == "en" and s.extra["seed"] == 3 and s.extra["_id"] == "hotpotqa-000"
    assert s.extra["truncated"] is False and s.extra["split"] == "verbatim"

    (s,) = lb.build("trec", tok, length=1000, num_samples=1, data_dir=tmp_path)
    assert s.context == ("Please determine the type of the question below. Here are some examples of "
                         "questions.\n\nQuestion: What is a cat?\nType: Description")
    assert s.question == "\nQuestion: Who?\nType:"
    assert s.chat_template is False and s.metric == "classification" and s.max_new_tokens == 64
    assert s.extra["all_classes"] == ["Human", "Description"]

    (s,) = lb.build("gov_report", tok, length=1000, num_samples=1, data_dir=tmp_path)
    assert s.context == ("You are given a report by a government agency. Write a one-page summary of the "
                         "report.\n\nReport:\nThe report body.")
    assert s.question == "\n\nNow, write a one-page summary of the report.\n\nSummary:"
    assert (s.metric, s.max_new_tokens, s.chat_template) == ("rouge", 512, True)

    (s,) = lb.build("multifieldqa_zh", tok, length=1000, num_samples=1, data_dir=tmp_path)
    assert s.context == "阅读以下文字并用中文简短回答：\n\n北京是中国的首都。"
    assert s.question == ("\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。"
                          "\n\n问题：中国的首都是哪里？\n回答：")
    assert (s.metric, s.max_new_tokens, s.extra["language"]) == ("qa_f1_zh", 64, "zh")


def test_num_samples_takes_the_first_lines(tmp_path):
    rows = [_row("lcc", i, f"x{i} = {i}\n", "", [f"y = {i}"]) for i in range(5)]
    _write(tmp_path, "lcc", rows)
    tok = WordTokenizer()
    got = lb.build("lcc", tok, length=100, num_samples=3, data_dir=tmp_path)
    assert [s.id for s in got] == ["lcc-000", "lcc-001", "lcc-002"]
    assert got[1].context == "Please complete the code given below. \nx1 = 1\n"
    assert got[1].question == "Next line of code:\n"
    assert got[1].chat_template is False and got[1].metric == "code_sim"
    assert len(lb.build("lcc", tok, length=100, num_samples=None, data_dir=tmp_path)) == 5
    assert len(lb.build("lcc", tok, length=100, num_samples=50, data_dir=tmp_path)) == 5


def test_middle_truncation_keeps_head_and_tail(tmp_path):
    tok = WordTokenizer()
    context = _words("head", 50) + " MIDDLE " + _words("tail", 50)
    _write(tmp_path, "hotpotqa", [_row("hotpotqa", 0, context, "Who?", ["x"])])
    prompt = HOTPOT_HEAD + context + HOTPOT_TAIL.format(q="Who?")
    n = len(tok(prompt, add_special_tokens=False)["input_ids"])
    length = 160
    assert n > length
    (s,) = lb.build("hotpotqa", tok, length=length, num_samples=1, data_dir=tmp_path)
    text = s.context + s.question
    assert text == _official(tok, prompt, length)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) <= length
    assert text.startswith(HOTPOT_HEAD + "head0 head1") and "tail49" in text and "MIDDLE" not in text
    assert s.question == HOTPOT_TAIL.format(q="Who?")  # the question lies in the kept tail, verbatim
    assert s.extra == s.extra | {"truncated": True, "split": "verbatim", "prompt_tokens": n}
    # the runner's split of the rendered ids falls exactly between context and question
    ctx_ids, q_ids = render_ids(tok, s)
    assert tok.decode(q_ids) == s.question and tok.decode(ctx_ids, skip_special_tokens=True) == s.context


def test_truncation_cutting_into_the_question(tmp_path):
    tok = WordTokenizer()
    context = _words("c", 100)
    question = _words("q", 100)
    _write(tmp_path, "qmsum", [_row("qmsum", 0, context, question, ["x"])])
    head, tail = lb.split_template("qmsum")
    prompt = head + context + tail.format(input=question)
    for length in (60, 120, 300):  # head/tail cut inside the context... up to a cut inside the question
        (s,) = lb.build("qmsum", tok, length=length, num_samples=1, data_dir=tmp_path)
        assert s.context + s.question == _official(tok, prompt, length)
        assert len(tok(s.context + s.question, add_special_tokens=False)["input_ids"]) <= length
        assert s.extra["truncated"] is True
    # length 300: the kept head (150 tokens) ends inside the context and the kept tail (150) starts inside
    # the question words, so the question's start was cut: context = kept head, question = kept tail.
    (s,) = lb.build("qmsum", tok, length=300, num_samples=1, data_dir=tmp_path)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert s.extra["split"] == "question_cut"
    assert s.context == tok.decode(ids[:150]) and s.question == tok.decode(ids[-150:])
    assert s.context.startswith(head) and s.context.split()[-1].startswith("c")
    assert s.question.split()[0].startswith("q") and s.question.endswith("q99\nAnswer:")


def test_truncation_when_the_head_holds_the_whole_context(tmp_path):
    tok = WordTokenizer()
    _write(tmp_path, "qmsum", [_row("qmsum", 0, "short context.", _words("q", 300), ["x"])])
    head, tail = lb.split_template("qmsum")
    (s,) = lb.build("qmsum", tok, length=200, num_samples=1, data_dir=tmp_path)
    assert s.extra["split"] == "question_cut"
    assert s.context == head + "short context."
    prompt = head + "short context." + tail.format(input=_words("q", 300))
    assert s.context + s.question == _official(tok, prompt, 200)
    assert "q0 q1" in s.question and s.question.endswith("q299\nAnswer:")


def test_truncation_with_a_lossy_decode_splits_at_the_token_boundary(tmp_path):
    tok = LossyTokenizer()
    context = _words("w", 200)
    _write(tmp_path, "hotpotqa", [_row("hotpotqa", 0, context, "Who?", ["x"])])
    prompt = HOTPOT_HEAD + context + HOTPOT_TAIL.format(q="Who?")
    (s,) = lb.build("hotpotqa", tok, length=160, num_samples=1, data_dir=tmp_path)
    assert s.context + s.question == _official(tok, prompt, 160)
    assert s.extra["split"] == "token_boundary"
    assert s.question == HOTPOT_TAIL.format(q="Who?").replace("\n\n", "\n")
    assert s.context.endswith("w199")


def test_truncation_fallback_keeps_the_official_text(tmp_path):
    tok = MarkingTokenizer()
    context = _words("w", 200)
    _write(tmp_path, "hotpotqa", [_row("hotpotqa", 0, context, "Who?", ["x"])])
    prompt = HOTPOT_HEAD + context + HOTPOT_TAIL.format(q="Who?")
    (s,) = lb.build("hotpotqa", tok, length=160, num_samples=1, data_dir=tmp_path)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert s.extra["split"] == "head_tail"
    assert (s.context, s.question) == (tok.decode(ids[:80]), tok.decode(ids[-80:]))
    assert s.context + s.question == _official(tok, prompt, 160)


def test_missing_data(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        lb.build("narrativeqa", WordTokenizer(), length=100, num_samples=1, data_dir=tmp_path / "nowhere")
    msg = str(e.value)
    assert str(tmp_path / "nowhere" / "narrativeqa.jsonl") in msg
    assert "THUDM/LongBench" in msg and "data.zip" in msg


def test_bad_arguments(tmp_path):
    tok = WordTokenizer()
    _write(tmp_path, "lcc", [_row("lcc", 0, "x = 1\n", "", ["y"])])
    with pytest.raises(ValueError, match="'nope'"):
        lb.build("nope", tok, length=100, num_samples=1, data_dir=tmp_path)
    with pytest.raises(ValueError, match="length.*1"):
        lb.build("lcc", tok, length=1, num_samples=1, data_dir=tmp_path)
    for bad in (0, -2, "3", True):
        with pytest.raises(ValueError, match="num_samples"):
            lb.build("lcc", tok, length=100, num_samples=bad, data_dir=tmp_path)
    with open(tmp_path / "musique.jsonl", "w") as f:
        f.write(json.dumps({"input": "q", "context": "c", "_id": "m0"}) + "\n")
    with pytest.raises(ValueError, match=r"musique.jsonl:1: missing key\(s\) \['answers'\]"):
        lb.build("musique", tok, length=100, num_samples=1, data_dir=tmp_path)

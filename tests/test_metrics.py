"""Metrics: hand-computed scores for every entry of METRICS, the LongBench scorer rules and retention."""

import math

import pytest

from vdjax.eval.metrics import (
    DATASET2METRIC,
    FIRST_LINE_TASKS,
    METRICS,
    aggregate,
    first_code_line,
    first_line,
    normalize_answer,
    normalize_zh_answer,
    retention,
    score,
)
from vdjax.eval.sample import Sample


def _sample(task="custom", metric="qa_f1", answers=("x",), **extra) -> Sample:
    return Sample(id="s0", task=task, context="c", question="q", answers=tuple(answers), max_new_tokens=8,
                  metric=metric, extra=extra)


def test_metric_names():
    assert set(METRICS) == {
        "string_match_all", "string_match_part", "qa_f1", "qa_f1_zh", "rouge", "rouge_zh", "classification",
        "retrieval", "retrieval_zh", "count", "code_sim", "math_equiv", "grade_answer",
    }


def test_dataset2metric_is_the_official_table():
    # LongBench/eval.py dataset2metric, function names mapped to ours (qa_f1_score -> qa_f1, ...).
    official = {
        "narrativeqa": "qa_f1_score", "qasper": "qa_f1_score", "multifieldqa_en": "qa_f1_score",
        "multifieldqa_zh": "qa_f1_zh_score", "hotpotqa": "qa_f1_score", "2wikimqa": "qa_f1_score",
        "musique": "qa_f1_score", "dureader": "rouge_zh_score", "gov_report": "rouge_score",
        "qmsum": "rouge_score", "multi_news": "rouge_score", "vcsum": "rouge_zh_score",
        "trec": "classification_score", "triviaqa": "qa_f1_score", "samsum": "rouge_score",
        "lsht": "classification_score", "passage_retrieval_en": "retrieval_score",
        "passage_count": "count_score", "passage_retrieval_zh": "retrieval_zh_score",
        "lcc": "code_sim_score", "repobench-p": "code_sim_score",
    }
    assert DATASET2METRIC == {k: v.removesuffix("_score") for k, v in official.items()}
    assert FIRST_LINE_TASKS == ("trec", "triviaqa", "samsum", "lsht")


# ---------------------------------------------------------------------------------------------------- RULER


def test_string_match_all():
    m = METRICS["string_match_all"]
    assert m("The numbers are 123 and 456.", ["123", "456", "789"], None) == pytest.approx(2 / 3)
    assert m("KEY: AbC", ["abc"], None) == 1.0  # case-insensitive
    assert m("  \t 42 \n", ["42"], None) == 1.0
    assert m("", ["42"], None) == 0.0
    assert m("anything", [], None) == 0.0


def test_string_match_part():
    m = METRICS["string_match_part"]
    assert m("it is BAR!", ["foo", "bar"], None) == 1.0
    assert m("it is baz", ["foo", "bar"], None) == 0.0
    assert m("", ["foo"], None) == 0.0
    assert m("foo", [], None) == 0.0


# ------------------------------------------------------------------------------------------------ LongBench


def test_normalisation():
    assert normalize_answer("The  Eiffel-Tower, in a city!") == "eiffeltower in city"
    assert normalize_zh_answer("北京， 是 首都。ABC") == "北京是首都abc"


def test_qa_f1():
    m = METRICS["qa_f1"]
    # "eiffel tower paris" vs "eiffel tower": P = 2/3, R = 1 -> F1 = 0.8
    assert m("The Eiffel Tower, Paris", ["Eiffel Tower"], None) == pytest.approx(0.8)
    assert m("Paris", ["London", "paris."], None) == 1.0  # max over references
    assert m("", ["Paris"], None) == 0.0
    assert m("Paris", [], None) == 0.0
    assert m("the a an", ["the"], None) == 0.0  # all articles: nothing left to share


def test_qa_f1_zh():
    m = METRICS["qa_f1_zh"]
    # jieba: 我 / 爱 / 北京 vs 北京 -> P = 1/3, R = 1 -> F1 = 0.5
    assert m("我爱北京", ["北京"], None) == pytest.approx(0.5)
    assert m("北京。", ["北京"], None) == 1.0  # the punctuation token is normalised away
    assert m("上海", ["北京"], None) == 0.0
    assert m("", ["北京"], None) == 0.0


def test_rouge():
    m = METRICS["rouge"]
    # rouge package, summary-level ROUGE-L: LCS 5 tokens; recall 5/|set(ref)| = 5/6, precision 5/|set(pred)|
    # = 5/5 -> F = 2 * (5/6) / (11/6) = 10/11.
    assert m("the cat sat on the mat", ["the cat sat on a mat"], None) == pytest.approx(10 / 11, abs=1e-6)
    assert m("same words here", ["same words here"], None) == pytest.approx(1.0, abs=1e-6)
    assert m("", ["a reference"], None) == 0.0  # the package raises on an empty hypothesis; official -> 0
    assert m("text", [], None) == 0.0


def test_rouge_zh():
    m = METRICS["rouge_zh"]
    # jieba: 今天天气 / 很 / 好 vs 今天天气 / 不好: LCS 1, R = 1/2, P = 1/3 -> F = 0.4
    assert m("今天天气很好", ["今天天气不好"], None) == pytest.approx(0.4, abs=1e-6)
    assert m("会议讨论预算", ["会议讨论预算"], None) == pytest.approx(1.0, abs=1e-6)
    assert m("", ["会议"], None) == 0.0


def test_classification():
    m = METRICS["classification"]
    classes = ["Food", "Date", "Location"]
    s = _sample(task="custom", metric="classification", all_classes=classes)
    assert m("Type: Food", ["Food"], s) == 1.0
    assert m("Food or Date", ["Food"], s) == 0.5
    assert m("no class named", ["Food"], s) == 0.0
    # a matched class that is a sub-string of the reference is dropped
    s2 = _sample(metric="classification", all_classes=["city", "capital city"])
    assert m("capital city", ["capital city"], s2) == 1.0
    # official quirk kept: removal while iterating skips "b", so 2 matches remain -> 1/2
    s3 = _sample(metric="classification", all_classes=["a", "b", "ab"])
    assert m("ab", ["ab"], s3) == 0.5


def test_classification_needs_class_names():
    with pytest.raises(ValueError, match="all_classes"):
        METRICS["classification"]("Food", ["Food"], None)
    with pytest.raises(ValueError, match="all_classes"):
        METRICS["classification"]("Food", ["Food"], _sample(metric="classification", all_classes=None))


def test_first_line_rule_is_keyed_on_the_task():
    pred = "\nParis\nLondon is big"
    assert first_line(pred) == "Paris"
    # triviaqa is cut to its first line; hotpotqa (same metric) is not: "paris london is big" -> P 1/4, R 1
    assert METRICS["qa_f1"](pred, ["Paris"], _sample(task="triviaqa")) == 1.0
    assert METRICS["qa_f1"](pred, ["Paris"], _sample(task="hotpotqa")) == pytest.approx(0.4)
    assert METRICS["qa_f1"](pred, ["Paris"], None) == pytest.approx(0.4)
    trec = _sample(task="trec", metric="classification", all_classes=["Food", "Date"])
    assert METRICS["classification"]("Food\nDate", ["Food"], trec) == 1.0
    other = _sample(task="custom", metric="classification", all_classes=["Food", "Date"])
    assert METRICS["classification"]("Food\nDate", ["Food"], other) == 0.5


def test_count():
    m = METRICS["count"]
    assert m("There are 12 unique paragraphs", ["12"], None) == 1.0
    assert m("12 or 13", ["12"], None) == 0.5
    assert m("1, 2, 3", ["2"], None) == pytest.approx(1 / 3)
    assert m("twelve", ["12"], None) == 0.0
    assert m("", ["12"], None) == 0.0


def test_retrieval():
    m = METRICS["retrieval"]
    assert m("Paragraph 3", ["Paragraph 3"], None) == 1.0
    assert m("Paragraph 3 or Paragraph 12", ["Paragraph 3"], None) == 0.5
    assert m("I do not know", ["Paragraph 3"], None) == 0.0
    with pytest.raises(ValueError, match="paragraph number"):
        m("Paragraph 3", ["three"], None)


def test_retrieval_zh():
    m = METRICS["retrieval_zh"]
    assert m("段落5", ["段落5"], None) == 1.0
    assert m("答案是段落5，不是段落15", ["段落5"], None) == 0.5
    assert m("", ["段落5"], None) == 0.0
    with pytest.raises(ValueError, match="retrieval_zh"):
        m("段落5", ["Paragraph 5"], None)


def test_code_sim():
    m = METRICS["code_sim"]
    assert first_code_line("\n```python\n# comment\n// c\nx = 1\ny = 2") == "x = 1"
    assert first_code_line("# only\n```") == ""
    assert m("```python\n# comment\nx = 1\n", ["x = 1"], None) == 1.0
    # difflib ratio 2 * 4 matched / 10 chars = 0.8
    assert m("x = 2", ["x = 1"], None) == pytest.approx(0.8)
    assert m("# all comments", ["abc"], None) == 0.0


def test_math_equiv():
    m = METRICS["math_equiv"]
    assert m("so the answer is \\boxed{0.5}", ["\\frac{1}{2}"], None) == 1.0
    assert m("\\boxed{\\frac{1}{2}}", ["0.5"], None) == 1.0
    assert m("first \\boxed{2}, finally \\boxed{\\frac{x^{2}}{2}}", ["\\frac{x^2}{2}"], None) == 1.0
    assert m("first \\boxed{1/2}, finally \\boxed{3}", ["\\frac{1}{2}"], None) == 0.0  # the last box counts
    assert m("\\boxed{3}", ["4"], None) == 0.0
    assert m("the answer is 0.5", ["0.5"], None) == 0.0  # no box
    assert m("\\boxed{}", ["0"], None) == 0.0
    assert m("", ["0"], None) == 0.0
    assert m("\\boxed 5", ["5"], None) == 1.0
    assert m("\\boxed{5}", [], None) == 0.0


def test_bad_arguments():
    with pytest.raises(TypeError, match="answers"):
        METRICS["qa_f1"]("Paris", "Paris", None)
    with pytest.raises(TypeError, match="prediction"):
        METRICS["string_match_all"](None, ["x"], None)
    with pytest.raises(TypeError, match="answers"):
        METRICS["rouge"]("x", [1], None)


def test_score_dispatches_on_the_sample_metric():
    assert score(_sample(metric="count", answers=("3",)), "3 or 4") == 0.5
    with pytest.raises(ValueError, match="'nope'"):
        score(_sample(metric="nope"), "x")


def test_retention_and_aggregate():
    assert retention(0.45, 0.9) == pytest.approx(50.0)
    assert retention(45.0, 90.0) == pytest.approx(50.0)
    assert retention(0.0, 0.0) is None
    assert retention(0.5, 0) is None
    with pytest.raises(ValueError, match="dense_score"):
        retention(0.5, -1.0)
    with pytest.raises(ValueError, match="score"):
        retention(math.nan, 1.0)
    assert aggregate([1.0, 0.0, 0.5]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="empty"):
        aggregate([])

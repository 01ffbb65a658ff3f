"""MATH-500 builder, \\boxed extraction and the paper's fraction-of-dense-length budgets."""

import json

import pytest

from vdjax.eval import math500
from vdjax.eval.math500 import build, extract_boxed, fraction_budgets
from vdjax.eval.metrics import score

INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."

ROWS = [
    {"problem": "What is $1+1$?", "solution": "$1+1=\\boxed{2}$.", "answer": "2", "subject": "Prealgebra",
     "level": 1, "unique_id": "test/prealgebra/1.json"},
    {"problem": "Compute $\\frac{2}{4}$.", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "answer": "\\frac{1}{2}",
     "subject": "Algebra", "level": 2, "unique_id": "test/algebra/2.json"},
    {"problem": "Solve $x^2=9$, $x>0$.", "solution": "$x=\\boxed{3}$", "answer": "3", "subject": "Algebra",
     "level": 3, "unique_id": "test/algebra/3.json"},
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_build(tmp_path):
    _write(tmp_path / "test.jsonl", ROWS)
    got = build("math500", None, length=4096, num_samples=2, seed=7, data_dir=tmp_path)
    assert [s.id for s in got] == ["test/prealgebra/1.json", "test/algebra/2.json"]
    s = got[1]
    assert s.context == "Compute $\\frac{2}{4}$."
    assert s.question == INSTRUCTION
    assert (s.task, s.answers, s.max_new_tokens, s.metric, s.chat_template) == (
        "math500", ("\\frac{1}{2}",), 4096, "math_equiv", True)
    assert s.extra["subject"] == "Algebra" and s.extra["level"] == 2 and s.extra["seed"] == 7
    assert score(s, "Simplify: ... so \\boxed{0.5}") == 1.0
    assert score(s, "\\boxed{\\frac{2}{3}}") == 0.0
    assert len(build("math500", None, length=16, num_samples=None, data_dir=tmp_path)) == 3
    assert len(build("math500", None, length=16, num_samples=99, data_dir=tmp_path)) == 3


def test_math500_jsonl_is_preferred(tmp_path):
    _write(tmp_path / "test.jsonl", ROWS)
    _write(tmp_path / "math500.jsonl", ROWS[2:])
    assert [s.id for s in build("math500", None, length=16, num_samples=5, data_dir=tmp_path)] == [
        "test/algebra/3.json"]


def test_missing_data(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        build("math500", None, length=16, num_samples=1, data_dir=tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "math500.jsonl") in msg and str(tmp_path / "test.jsonl") in msg
    assert "HuggingFaceH4/MATH-500" in msg


def test_bad_arguments(tmp_path):
    _write(tmp_path / "test.jsonl", ROWS)
    with pytest.raises(ValueError, match="'gsm8k'"):
        build("gsm8k", None, length=16, num_samples=1, data_dir=tmp_path)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="length"):
            build("math500", None, length=bad, num_samples=1, data_dir=tmp_path)
    with pytest.raises(ValueError, match="num_samples"):
        build("math500", None, length=16, num_samples=0, data_dir=tmp_path)
    _write(tmp_path / "math500.jsonl", [{"problem": "p", "unique_id": "u"}])
    with pytest.raises(ValueError, match=r"math500.jsonl:1: missing key\(s\) \['answer'\]"):
        build("math500", None, length=16, num_samples=1, data_dir=tmp_path)


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{x^{2}+\\sqrt{y_{1}}}", "x^{2}+\\sqrt{y_{1}}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("the answer is $\\boxed 5$.", "5"),
    ("\\boxed {7}", "7"),
    ("\\fbox{42}", "42"),
    ("\\boxed{2} and a broken \\boxed{3", "2"),
    ("\\boxed{}", ""),
    ("no box here", None),
    ("\\boxedx{1}", None),
    ("", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_boxed_rejects_non_text():
    with pytest.raises(TypeError, match="text"):
        extract_boxed(None)


def test_fraction_budgets_reproduce_appendix_f():
    # average dense generation lengths of Table 10 -> the 25% / 50% budgets used in Table 3
    table = {932: (256, 512), 1124: (256, 512), 1228: (256, 512), 1947: (512, 1024), 2432: (512, 1024),
             3708: (1024, 2048), 4147: (1024, 2048)}
    for avg, (b25, b50) in table.items():
        assert fraction_budgets([avg]) == {0.25: b25, 0.5: b50}


def test_fraction_budgets_use_the_mean_generation_length():
    lengths = [1000, 3000]  # mean 2000 tokens per generation
    assert fraction_budgets(lengths, rounding="none") == {0.25: 500, 0.5: 1000}
    assert fraction_budgets(lengths) == {0.25: 512, 0.5: 1024}
    assert fraction_budgets(lengths, (0.1,), rounding=256) == {0.1: 256}  # 200 -> nearest multiple 256
    assert fraction_budgets(lengths, (0.3,), rounding=256) == {0.3: 512}  # 600 -> 512
    assert fraction_budgets([384 * 4], (0.25,)) == {0.25: 512}  # 384 is halfway: ties round up
    assert fraction_budgets([10], (0.25,), rounding="none") == {0.25: 2}


def test_fraction_budgets_bad_input():
    with pytest.raises(ValueError, match="empty"):
        fraction_budgets([])
    with pytest.raises(ValueError, match="-5"):
        fraction_budgets([100, -5])
    with pytest.raises(ValueError, match="positive mean"):
        fraction_budgets([0, 0])
    with pytest.raises(ValueError, match="fractions.*1.5"):
        fraction_budgets([100], (1.5,))
    with pytest.raises(ValueError, match="fractions.*0"):
        fraction_budgets([100], (0,))
    with pytest.raises(ValueError, match="rounding.*'up'"):
        fraction_budgets([100], rounding="up")
    with pytest.raises(TypeError, match="dense_lengths"):
        fraction_budgets(1124)


def test_tasks():
    assert math500.TASKS == ("math500",)

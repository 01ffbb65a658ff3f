"""MATH-500 builder, \\boxed extraction, the paper's budgets, the prm800k grader, k-draw metrics and
summary."""

import csv
import json
import time

import pytest

from vdjax.eval import grader, math500, report
from vdjax.eval.grader import exact_match, grade_answer, normalize, should_allow_eval
from vdjax.eval.latex import latex_to_text
from vdjax.eval.math500 import build, extract_boxed, fraction_budgets
from vdjax.eval.metrics import METRICS, math_at_k, math_draw, score

INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."

ROWS = [
    {"problem": "What is $1+1$?", "solution": "$1+1=\\boxed{2}$.", "answer": "2", "subject": "Prealgebra",
     "level": 1, "unique_id": "test/prealgebra/1.json"},
    {"problem": "Compute $\\frac{2}{4}$.", "solution": "It is $\\boxed{\\frac{1}{2}}$.",
     "answer": "\\frac{1}{2}", "subject": "Algebra", "level": 2, "unique_id": "test/algebra/2.json"},
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
        "math500", ("\\frac{1}{2}",), 4096, "grade_answer", True)
    assert s.extra["subject"] == "Algebra" and s.extra["level"] == 2 and s.extra["seed"] == 7
    assert score(s, "Simplify: ... so \\boxed{0.5}") == 1.0
    assert score(s, "\\boxed{\\frac{2}{3}}") == 0.0
    assert score(s, "\\boxed{\\frac{2}{4}}") == 0.0  # prm800k: an unreduced fraction is wrong
    assert math500.task_metric("math500") == "grade_answer"
    assert len(build("math500", None, length=16, num_samples=None, data_dir=tmp_path)) == 3
    assert len(build("math500", None, length=16, num_samples=99, data_dir=tmp_path)) == 3


def test_first_100_problems_by_default(tmp_path):
    rows = [dict(ROWS[0], unique_id=f"test/p/{i}.json", answer=str(i)) for i in range(120)]
    _write(tmp_path / "test.jsonl", rows)
    assert math500.PAPER_PROBLEMS == math500.DEFAULT_SAMPLES == 100
    got = build("math500", None, length=16, num_samples=None, data_dir=tmp_path)
    assert [s.id for s in got] == [f"test/p/{i}.json" for i in range(100)]  # the first 100, in file order
    assert len(build("math500", None, length=16, num_samples=120, data_dir=tmp_path)) == 120
    assert len(build("math500", None, length=16, num_samples=7, data_dir=tmp_path)) == 7


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


# ---- prm800k grade_answer ---------------------------------------------------------------------------------
# Each expected value follows from prm800k's algorithm (and agrees with openai/prm800k grader.py run with
# pylatexenc 2.10); the comment names the step that decides.
GRADES = [
    ("0.5", "\\frac{1}{2}", True),  # Hendrycks normalisation maps "0.5" to \frac{1}{2}
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),  # dfrac -> frac
    ("1/2", "\\frac{1}{2}", True),  # integer a/b -> \frac{a}{b}
    ("14/3", "\\frac{14}{3}", True),
    ("\\frac{2}{4}", "\\frac{1}{2}", False),  # two plain fractions compare as strings: unreduced is wrong
    ("\\frac{3}{6}", "\\frac{1}{2}", False),
    ("0.50", "\\frac{1}{2}", True),  # not both fractions: sympy, 1/2 - 0.50 = 0
    ("4.666", "\\frac{14}{3}", False),  # sympy: not 0
    ("1/3", "0.333", False),
    ("x = 3", "3", True),  # a short "x =" prefix is dropped
    ("3.0", "3", True),  # an integral float becomes an int
    ("1e3", "1000", True),
    ("1,000", "1000", True),  # thousands commas
    ("3.5", "3", False),  # an integer reference needs an integer answer
    ("10^2", "100", False),  # ... strictly: no sympy when only one side is an integer
    ("2^{10}", "1024", False),
    ("5 million", "5000000", False),  # "*10^6" is not an integer string
    ("90", "90^\\circ", True),  # degrees removed
    ("5 \\text{ cm}", "5", True),  # a unit after "\\text{ " removed
    ("12 inches", "12", True),  # unit words removed
    ("50\\%", "50", True),
    ("\\$5", "5", True),
    ("evelyn", "\\text{Evelyn}", True),  # \\text{} unwrapped, lower case
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),  # LaTeX to text: both "sqrt(2)/2"
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", True),  # \\sqrt3 -> \\sqrt{3}
    ("3\\sqrt{13}", "\\sqrt{117}", True),  # sympy
    ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("7 \\frac{3}{4}", "\\frac{31}{4}", True),  # a mixed number: 7+3/4
    ("1\\frac{1}{2}", "\\frac{3}{2}", True),
    ("1.5", "\\frac32", True),
    ("\\pi", "3.14159", False),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("2x+1", "1+2x", True),  # sympy, one letter
    ("x^2+2x+1", "(x+1)^2", True),
    ("q-p", "p - q", False),
    ("a+b+c", "c+b+a", False),  # three distinct letters: sympy is not tried
    ("6-5i", "6 - 5i", True),  # spaces removed
    ("-3", "- 3", True),
    ("(1, 2)", "(1,2)", True),
    ("(1,2)", "[1,2]", False),  # open vs closed interval
    ("(2,1)", "(1,2)", False),  # tuples element by element, in order
    ("3, 2", "2, 3", False),
    ("\\{1,2\\}", "\\{2,1\\}", False),  # braces are dropped, so no tuple: "1,2" vs "2,1"
    ("2 \\text{ and } 3", "2, 3", True),  # " and " -> ","
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    ("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("", "1", False),
    (None, "1", False),  # no boxed answer
]


@pytest.mark.parametrize("given, truth, expected", GRADES)
def test_grade_answer(given, truth, expected):
    assert grade_answer(given, truth) is expected


@pytest.mark.parametrize("given, truth, expected", [
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True), ("0.5", "\\frac{1}{2}", True), ("x = 3", "3", True),
    ("(1, 2)", "(1,2)", True), ("90", "90^\\circ", True),
    ("3.0", "3", False), ("1,000", "1000", False), ("2x+1", "1+2x", False),
    ("evelyn", "\\text{Evelyn}", False),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", False), (None, "1", False),
])
def test_exact_match_is_normalised_string_equality(given, truth, expected):
    assert exact_match(given, truth) is expected


@pytest.mark.parametrize("latex, text", [
    ("\\frac{1}{\\sqrt{2}}", "1/√(2)"),
    ("\\sqrt[3]{x}", "√(x)"),  # the root's index is dropped
    ("\\frac12", "1/2"),
    ("\\frac{1}", "%s/%s1"),  # a missing argument: the template is kept, the group read as text
    ("\\begin{pmatrix} 1 \\\\ 22 \\\\ -3\\end{pmatrix}", "[  1; 22; -3 ]"),
    ("\\begin{pmatrix} a&b\\\\c&d \\end{pmatrix}", "[ a b; c d ]"),
    ("\\pi r", "πr"), ("\\left\\{ 1 \\right\\}", "{ 1 }"), ("\\mathbb{R}", "ℝ"), ("\\vec{v}", "v⃗"),
    ("\\mbox{ cm}5", "5"), ("\\operatorname{lcm}(1)", "lcm(1)"), ("\\ne 3", "3"),  # unknown macros dropped
    ("\\text{ cm}", " cm"), ("a}b", "ab"), ("1 & 2", "1     2"), ("\\( x \\)", "x"),
])
def test_latex_to_text_matches_pylatexenc(latex, text):
    assert latex_to_text(latex) == text


def test_normalize_steps():
    assert normalize("\\text{5 meters}") == "5"
    assert normalize("\\$1,\\!000") == "1000"
    assert normalize("\\left( 3, \\frac{\\pi}{2} \\right)") == "(3,pi/2)"
    assert normalize("7 \\frac{3}{4}") == "7+3/4"
    assert normalize("\\infty \\cup \\sqrt{2}") == "infusqrt(2)"
    assert normalize("\\begin{pmatrix}\\end{pmatrix}") == "\\beginpmatrix\\endpmatrix"  # pylatexenc fails
    assert normalize(None) is None


def test_should_allow_eval():
    assert should_allow_eval("(x^2+y)-(2)")
    assert not should_allow_eval("(x+y+z)-(1)")  # three letters
    assert should_allow_eval("(sqrt(2)+frac)-(1)")  # sqrt and frac are not letters here
    assert not should_allow_eval("(2^{3})-(8)") and not should_allow_eval("(2^(3))-(8)")
    assert not should_allow_eval("(2^10)-(1024)") and not should_allow_eval("(2^2^2)-(16)")


def test_sympy_time_limit(monkeypatch):
    import sympy

    monkeypatch.setattr(grader, "SYMPY_TIMEOUT_S", 0.2)
    monkeypatch.setattr(sympy, "simplify", lambda expr: time.sleep(5) or 0)
    start = time.perf_counter()
    assert grader.sympy_equal("x+1", "1+x") is False  # cut off: not equal
    assert time.perf_counter() - start < 2


def test_grade_answer_metric_reads_the_last_box():
    m = METRICS["grade_answer"]
    assert m("so \\boxed{\\dfrac{1}{2}}", ["\\frac{1}{2}"], None) == 1.0
    assert m("\\boxed{1/2} then finally \\boxed{3}", ["\\frac{1}{2}"], None) == 0.0
    assert m("the answer is 1/2", ["\\frac{1}{2}"], None) == 0.0  # no box
    assert m("\\boxed{4}", ["3", "4"], None) == 1.0  # any reference


# ---- k draws ----------------------------------------------------------------------------------------------
def test_math_draw_and_at_k():
    answers = ["\\frac{1}{2}"]
    draws = [math_draw(p, answers) for p in ("\\boxed{0.5}", "\\boxed{0.50}", "no answer")]
    assert [d["flex"] for d in draws] == [1.0, 1.0, 0.0]
    assert [d["exact"] for d in draws] == [1.0, 0.0, 0.0]  # "0.50" is right only through sympy
    assert [d["empty"] for d in draws] == [0.0, 0.0, 1.0]
    got = math_at_k(draws)
    assert got["flex"] == pytest.approx(2 / 3) and got["exact"] == pytest.approx(1 / 3) and got["pass"] == 1.0
    wrong = math_at_k([math_draw("\\boxed{2}", answers)] * 3)
    assert wrong == {"flex": 0.0, "exact": 0.0, "pass": 0.0, "math_equiv": 0.0}
    one = math_at_k([math_draw("\\boxed{1/2}", answers)])  # greedy, k = 1: flex@1 = pass@1
    assert one["flex"] == one["pass"] == 1.0
    with pytest.raises(ValueError, match="at least one"):
        math_at_k([])


def _line(sid, answer, draw, policy, budget, prediction, score, new_tokens, truncated):
    return {"benchmark": "math500", "task": "math500", "sample_id": sid, "draw": draw, "model": "tiny",
            "length": 512, "seed": 0, "protocol": "paper",
            "sampling": {"temperature": 0.6, "top_k": 0, "top_p": 0.95},
            "policy": policy, "budget": budget, "budget_fraction": None if budget is None else 0.25,
            "block_size": 128, "hyper": {}, "prediction": prediction, "answers": [answer], "score": score,
            "metric": "grade_answer", "new_tokens": new_tokens, "truncated": truncated}


HALF, THREE = ("p1", "\\frac{1}{2}"), ("p2", "3")
K3 = [
    # dense, p1: right (0.5), unreduced 2/4 (grade_answer 0, math_verify 1), no box and truncated
    (*HALF, 0, "dense", None, "\\boxed{0.5}", 1.0, 100, False),
    (*HALF, 1, "dense", None, "\\boxed{\\frac{2}{4}}", 0.0, 200, False),
    (*HALF, 2, "dense", None, "I ran out of tokens", 0.0, 300, True),
    # dense, p2: three right draws
    *[(*THREE, d, "dense", None, "\\boxed{3}", 1.0, 10 * (d + 1), False) for d in range(3)],
    # valuediff at 64: p1 right once (1/2), an empty box, a wrong 2; p2 right once (3.0, not exact), twice 4
    (*HALF, 0, "valuediff", 64, "\\boxed{1/2}", 1.0, 50, False),
    (*HALF, 1, "valuediff", 64, "\\boxed{}", 0.0, 50, False),
    (*HALF, 2, "valuediff", 64, "\\boxed{2}", 0.0, 50, False),
    (*THREE, 0, "valuediff", 64, "\\boxed{3.0}", 1.0, 50, False),
    (*THREE, 1, "valuediff", 64, "\\boxed{4}", 0.0, 50, False),
    (*THREE, 2, "valuediff", 64, "\\boxed{4}", 0.0, 50, False),
]


def test_summary_math500_table_k3(tmp_path):
    folder = tmp_path / "math500"
    folder.mkdir()
    (folder / "predictions.jsonl").write_text("".join(json.dumps(_line(*row)) + "\n" for row in K3))
    s = report.summarize(folder / "predictions.jsonl")
    rows = {(r.policy, r.budget): r for r in s.math_rows}
    assert list(rows) == [("dense", None), ("valuediff", 64)]
    d = rows["dense", None]
    # p1: flex 1/3, exact 1/3, pass 1, math_equiv 2/3; p2: all 1 -> means over the two problems
    assert (d.problems, d.k) == (2, (3, 3))
    assert d.flex == pytest.approx(2 / 3) and d.exact == pytest.approx(2 / 3) and d.pass_ == 1.0
    assert d.math_equiv == pytest.approx(5 / 6)
    assert d.tokens == pytest.approx(110.0)  # (100 + 200 + 300 + 10 + 20 + 30) / 6
    assert d.empty_pct == pytest.approx(100 / 6) and d.trunc_pct == pytest.approx(100 / 6)
    assert d.retention is None
    v = rows["valuediff", 64]
    # p1: flex 1/3, exact 1/3; p2: flex 1/3, exact 0 ("3.0" is right only after float -> int)
    assert v.flex == pytest.approx(1 / 3) and v.exact == pytest.approx(1 / 6) and v.pass_ == 1.0
    assert v.math_equiv == pytest.approx(1 / 3)
    assert v.empty_pct == pytest.approx(100 / 6) and v.trunc_pct == 0.0 and v.tokens == 50.0
    assert v.retention == pytest.approx(50.0) and v.paired == 2  # (1/3) / (2/3) of dense flex@3
    assert v.fraction == 0.25

    md = s.md_path.read_text()
    assert ("| model | policy | budget | problems | k | flex@k | exact@k | pass@k | math_equiv@k | "
            "avg tokens |") in md
    assert "| tiny | dense | — | 2 | 3 | 0.667 | 0.667 | 1.000 | 0.833 | 110 | 16.7 | 16.7 | — |" in md
    assert ("| tiny | valuediff | 25% (N=64) | 2 | 3 | 0.333 | 0.167 | 1.000 | 0.333 | 50 | 16.7 | "
            "0.0 | 50.0% |") in md
    assert "| tiny | 25% (N=64) | 66.7 | **33.3** (50.0%) |" in md  # the main table: mean score = flex@k
    with open(s.math_csv_path) as f:
        table = {(r["policy"], r["budget"]): r for r in csv.DictReader(f)}
    assert (table["valuediff", "64"]["exact_at_k"] == "0.1667"
            and table["valuediff", "64"]["retention_flex"] == "50.0000")
    assert table["dense", ""]["k_min"] == table["dense", ""]["k_max"] == "3"
    assert len(report.rich_tables(s)) == 2  # the overall table and the MATH-500 one


def test_summary_greedy_k1_and_other_benchmarks(tmp_path):
    """k = 1: flex@1 = pass@1; a RULER file gets no MATH-500 table."""
    folder = tmp_path / "m"
    folder.mkdir()
    lines = [_line(*HALF, 0, "dense", None, "\\boxed{0.5}", 1.0, 7, False),
             _line(*THREE, 0, "dense", None, "\\boxed{4}", 0.0, 9, True)]
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (r,) = report.summarize(folder).math_rows
    assert r.k == (1, 1) and r.flex == r.pass_ == 0.5 and r.trunc_pct == 50.0 and r.empty_pct == 0.0
    ruler = tmp_path / "r"
    ruler.mkdir()
    line = {"benchmark": "ruler", "task": "t", "sample_id": "a", "model": "m", "length": 4096, "seed": 0,
            "protocol": "paper", "policy": "dense", "budget": None, "block_size": 128, "hyper": {},
            "prediction": "x", "answers": ["x"], "score": 1.0, "metric": "string_match_all"}
    (ruler / "predictions.jsonl").write_text(json.dumps(line) + "\n")
    s = report.summarize(ruler)
    assert s.math_rows == [] and s.math_csv_path is None and "flex@k" not in s.md_path.read_text()

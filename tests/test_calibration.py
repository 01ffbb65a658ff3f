"""Built-in calibration prompts (vdjax.analysis.calibration): sizes, determinism,
contents, file prompts, errors."""

import importlib.resources
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from fractions import Fraction
from math import gcd
from pathlib import Path

import pytest

from vdjax.analysis.calibration import (
    CATEGORIES,
    CODE_MODULES,
    CalibrationPrompt,
    builtin_texts,
    calibration_prompts,
    prompts_from_file,
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    """SmolLM2-135M's HF tokenizer (adds no BOS)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """The paper's set: 5 categories x 4 prompts of 2048 tokens."""
    return calibration_prompts(tokenizer)


class BosTokenizer:
    """A whitespace 'tokenizer' that adds BOS (id 1): one id per word."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] * add_special_tokens + [2 + len(word) for word in text.split()]}


def _essays() -> str:
    folder = importlib.resources.files("long_context_eval") / "data" / "synthetic" / "json"
    return json.loads((folder / "PaulGrahamEssays.json").read_text(encoding="utf-8"))["text"]


# ------------------------------------------------------------------------------------------ prompt sets


def test_default_set_is_20_prompts_of_2048_tokens(prompts):
    assert [p.category for p in prompts] == [c for c in CATEGORIES for _ in range(4)]
    assert [p.name for p in prompts] == [f"{c}-{i}" for c in CATEGORIES for i in range(4)]
    assert len({p.name for p in prompts}) == 20
    for p in prompts:
        assert isinstance(p, CalibrationPrompt)
        assert isinstance(p.ids, tuple) and len(p.ids) == 2048
        assert all(type(t) is int for t in p.ids)
    assert len({p.ids for p in prompts}) == 20


@pytest.mark.parametrize("length", [1, 7, 300])
def test_any_length_and_subset(tokenizer, length):
    ps = calibration_prompts(tokenizer, length, 2, categories=("math", "code"))
    assert [p.name for p in ps] == ["math-0", "math-1", "code-0", "code-1"]
    assert all(len(p.ids) == length for p in ps)
    assert [p.name for p in calibration_prompts(tokenizer, length, 1, categories="qa")] == ["qa-0"]


def test_bos_is_kept():
    ps = calibration_prompts(BosTokenizer(), 300, 2)
    assert len(ps) == 10
    for p in ps:
        assert len(p.ids) == 300 and p.ids[0] == 1 and 1 not in p.ids[1:]


def test_prompts_are_the_start_of_their_texts(tokenizer, prompts):
    for p in prompts:
        if p.category != "retrieval":
            text = tokenizer.decode(p.ids, skip_special_tokens=True)
            index = int(p.name.split("-")[1])
            assert builtin_texts(p.category, index, 40_000).startswith(text[:-8]), p.name


def test_deterministic(tokenizer):
    random.seed(123)
    first = calibration_prompts(tokenizer, 256, 2)
    random.seed(456)
    assert calibration_prompts(tokenizer, 256, 2) == first
    state = random.getstate()
    for category in CATEGORIES:
        assert builtin_texts(category, 3, 3000) == builtin_texts(category, 3, 3000)
    assert random.getstate() == state  # no shared RNG state


def test_same_texts_in_another_process():
    code = ("import json, sys; from vdjax.analysis.calibration import builtin_texts as t; "
            "json.dump([t(c, 1, 2000) for c in ('math', 'retrieval')], sys.stdout)")
    env = dict(os.environ, PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [builtin_texts(c, 1, 2000) for c in ("math", "retrieval")]


@pytest.mark.parametrize("category", CATEGORIES)
def test_texts_are_long_enough_and_differ_by_index(category):
    for n in (0, 1, 500, 5000, 20_000):
        assert len(builtin_texts(category, 0, n)) >= n
    texts = [builtin_texts(category, i, 6000) for i in range(4)]
    for i, a in enumerate(texts):
        for j, b in enumerate(texts):
            if i != j and category != "math":  # pieces do not overlap
                assert a[200:300] not in b and a[3000:3100] not in b, (i, j)
    assert len(set(texts)) == 4


# ------------------------------------------------------------------------------------------ contents


def test_narrative_is_essay_text():
    essays = _essays()
    for i in range(4):
        text = builtin_texts("narrative", i, 3000)
        assert text in essays and text[0].isupper()


def test_qa_is_squad_reading_comprehension():
    firsts = set()
    for i in range(4):
        text = builtin_texts("qa", i, 6000)
        lines = text.splitlines()
        assert text.count("Question: ") >= 5
        for k, line in enumerate(lines):
            if line.startswith("Question: "):
                assert len(line) > len("Question: ")
                assert lines[k + 1].startswith("Answer: ") and len(lines[k + 1]) > len("Answer: ")
        assert not lines[0].startswith(("Question:", "Answer:")) and len(lines[0]) > 200  # a paragraph first
        firsts.add(lines[0])
    assert len(firsts) == 4  # a different article per index


def test_code_is_standard_library_source():
    sources = [Path(importlib.util.find_spec(m).origin).read_text(encoding="utf-8") for m in CODE_MODULES]
    for i in range(4):
        text = builtin_texts("code", i, 6000)
        assert "def " in text and "return" in text
        assert re.match(r"[ \t]*(def|class) ", text)
        first = text.split("\n# File: Lib/")[0]
        assert any(first[:1000] in source for source in sources)


def _value(tex: str) -> Fraction:
    """"$-\\frac{3}{4}$", "$2$", "281.25" -> a Fraction (a fraction must be in lowest terms)."""
    tex = tex.strip("$")
    m = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", tex)
    if m:
        assert gcd(int(m[2]), int(m[3])) == 1 and int(m[3]) > 1, tex
        return Fraction(int(m[2]), int(m[3])) * (-1 if m[1] else 1)
    return Fraction(tex)


def _poly(expr: str, x: int) -> int:
    """Evaluates "3x - 7" or "x^2 - 4x + 3" at x."""
    return eval(re.sub(r"(\d)x", r"\1*x", expr.replace("^", "**")), {"x": x})


def _check_problem(problem: str, answer: str) -> str:
    """Asserts the stated answer of one problem, computed independently; returns the problem's kind."""
    if m := re.fullmatch(r"Compute \$(\d+) \\times (\d+) \+ (\d+) \\times (\d+) - (\d+)\$\.", problem):
        a, b, c, d, e = map(int, m.groups())
        assert int(answer) == a * b + c * d - e
        return "arithmetic"
    fraction = r"\\frac\{(\d+)\}\{(\d+)\}"
    if m := re.fullmatch(rf"Compute \${fraction} ([+-]) {fraction}\$ in lowest terms\.", problem):
        x, y = Fraction(int(m[1]), int(m[2])), Fraction(int(m[4]), int(m[5]))
        assert _value(answer) == (x + y if m[3] == "+" else x - y)
        return "fractions"
    if m := re.fullmatch(r"Solve for \$x\$: \$(.+) = (.+)\$\.", problem):
        x = int(re.fullmatch(r"\$x = (-?\d+)\$", answer)[1])
        assert _poly(m[1], x) == _poly(m[2], x)
        assert _poly(m[1], x + 1) - _poly(m[2], x + 1) != 0  # the only solution
        return "linear"
    if m := re.fullmatch(r"Solve \$(.+) = 0\$ by factoring\.", problem):
        roots = [int(r) for r in re.findall(r"\$x = (-?\d+)\$", answer)]
        assert answer == " or ".join(f"$x = {r}$" for r in roots) and roots == sorted(set(roots))
        product = roots * 2 if len(roots) == 1 else roots  # a double root counts twice
        for t in (-11, 0, 3):
            assert _poly(m[1], t) == (t - product[0]) * (t - product[1])
        return "quadratic"
    if m := re.fullmatch(r"What is (\d+)\\% of (\d+)\?", problem):
        assert Fraction(answer) == Fraction(int(m[1]) * int(m[2]), 100)
        return "percent"
    if m := re.fullmatch(r"A quantity of (\d+) increases by (\d+)\\% and then decreases by (\d+)\\%\. "
                         r"What is the final quantity\?", problem):
        n, p, q = map(int, m.groups())
        assert Fraction(answer) == n * Fraction(100 + p, 100) * Fraction(100 - q, 100)
        return "percent change"
    if m := re.fullmatch(r"Find the sum of the first (\d+) terms of the (arithmetic|geometric) sequence "
                         r"\$(-?\d+), (-?\d+), (-?\d+), \\ldots\$\.", problem):
        n, a, b, c = int(m[1]), int(m[3]), int(m[4]), int(m[5])
        if m[2] == "arithmetic":
            assert b - a == c - b
            assert int(answer) == sum(a + k * (b - a) for k in range(n))
        else:
            assert b * b == a * c
            assert int(answer) == sum(a * (b // a) ** k for k in range(n))
        return m[2] + " sum"
    raise AssertionError(f"unknown problem: {problem}")


def test_math_problems_are_solved_correctly():
    kinds, count = set(), 0
    for i in range(4):
        blocks = builtin_texts("math", i, 15_000).split("\n\n")
        for k, block in enumerate(blocks, 1):
            m = re.fullmatch(r"Problem (\d+)\. (.+)\nSolution: (.+)\nAnswer: (.+)", block)
            assert m and int(m[1]) == k, block
            kinds.add(_check_problem(m[2], m[4]))
            assert m[4].strip("$").split(" or ")[-1].strip("$") in m[3]  # the solution reaches the answer
            count += 1
    assert count > 100
    assert kinds == {"arithmetic", "fractions", "linear", "quadratic", "percent", "percent change",
                     "arithmetic sum", "geometric sum"}


def _check_retrieval(text: str, min_needles: int) -> None:
    """The text ends with a question about a key whose unique needle comes earlier."""
    m = re.search(r"\nWhat is the special magic number for (\S+) mentioned in the provided text\?\nAnswer:\Z",
                  text)
    assert m, text[-200:]
    needles = re.findall(r"The special magic number for (\S+) is: (\d{7})\.", text)
    assert len(needles) >= min_needles
    assert [value for key, value in needles if key == m[1]] and [k for k, _ in needles].count(m[1]) == 1
    assert text.index(f"The special magic number for {m[1]} is: ") < m.start()


def test_retrieval_haystack():
    for i in range(4):
        text = builtin_texts("retrieval", i, 6000)
        _check_retrieval(text, 15)
        keys = re.findall(r"The special magic number for (\S+) is", text)
        assert len(set(keys)) == len(keys)
        assert all(re.fullmatch(r"[A-Za-z]+-[A-Za-z]+", k) for k in keys)
        assert len(re.findall(r"\n(?!The special magic number)[A-Z\[\"'(0-9]", text)) >= 5  # essay lines


def test_retrieval_prompts_keep_the_question_and_the_needle(tokenizer, prompts):
    for p in prompts:
        if p.category == "retrieval":
            _check_retrieval(tokenizer.decode(p.ids), 20)
    for p in calibration_prompts(tokenizer, 300, 4, categories=["retrieval"]):
        _check_retrieval(tokenizer.decode(p.ids), 2)


# ------------------------------------------------------------------------------------------ user prompts


def test_jsonl_file(tmp_path, tokenizer):
    long = "word " * 500
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"text": "Hello there.", "name": "greet", "category": "chat"}) + "\n\n"
                    + json.dumps({"text": long}) + "\n")
    ps = prompts_from_file(path, tokenizer, length=64)
    assert [(p.category, p.name) for p in ps] == [("chat", "greet"), ("file", "mine-1")]
    assert ps[0].ids == tuple(tokenizer("Hello there.")["input_ids"])
    assert ps[1].ids == tuple(tokenizer(long)["input_ids"][:64])
    assert prompts_from_file(str(path), tokenizer)[1].ids == tuple(tokenizer(long)["input_ids"])


def test_txt_file(tmp_path, tokenizer):
    path = tmp_path / "mine.txt"
    path.write_text("---\nFirst prompt,\n  two lines.\n---\n\nSecond.\n  ---  \nThird.\n---\n")
    ps = prompts_from_file(path, tokenizer, length=3)
    assert [(p.category, p.name) for p in ps] == [("file", "mine-0"), ("file", "mine-1"), ("file", "mine-2")]
    assert ps[0].ids == tuple(tokenizer("First prompt,\n  two lines.")["input_ids"][:3])
    assert ps[2].ids == tuple(tokenizer("Third.")["input_ids"])
    assert prompts_from_file(path, BosTokenizer())[1].ids == (1, 9)


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("kwargs, match", [
    (dict(length=0), r"length must be an integer >= 1, got 0"),
    (dict(length=2.5), r"length must be an integer >= 1, got 2.5"),
    (dict(per_category=0), r"per_category must be an integer >= 1, got 0"),
    (dict(categories=("math", "poetry")),
     r"category 'poetry' is unknown: the built-in categories are narrative, qa, code, math, retrieval"),
    (dict(categories="file"), r"category 'file' is unknown"),
    (dict(categories=()), r"categories must name at least one of narrative, qa, code, math, retrieval"),
    (dict(categories=("qa", "qa")), r"categories must not repeat a category, got \('qa', 'qa'\)"),
])
def test_calibration_prompts_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        calibration_prompts(BosTokenizer(), **kwargs)


@pytest.mark.parametrize("args, match", [
    (("poetry", 0, 10), r"category 'poetry' is unknown: the built-in categories are"),
    (("file", 0, 10), r"category 'file' is unknown"),
    (("math", -1, 10), r"index must be an integer >= 0, got -1"),
    (("math", 0, -5), r"min_chars must be an integer >= 0, got -5"),
])
def test_builtin_texts_errors(args, match):
    with pytest.raises(ValueError, match=match):
        builtin_texts(*args)


@pytest.mark.parametrize("name, content, error, match", [
    ("missing.jsonl", None, FileNotFoundError, r"calibration prompt file '.*missing\.jsonl' does not exist"),
    ("p.csv", "a,b\n", ValueError, r"has the extension '\.csv': use \.jsonl .* or \.txt"),
    ("empty.jsonl", "\n\n", ValueError, r"'.*empty\.jsonl' holds no prompts"),
    ("empty.txt", "---\n  \n---\n", ValueError, r"'.*empty\.txt' holds no prompts"),
    ("p.jsonl", '{"text": "ok"}\n{"name": "x"}\n', ValueError,
     r"p\.jsonl:2: missing key\(s\) \['text'\]; a calibration prompt row needs \['text'\]"),
    ("p.jsonl", '{"text": ""}\n', ValueError, r"line 1: needs a JSON object"),
    ("p.jsonl", '["text"]\n', ValueError, r"p\.jsonl:1: expected a JSON object, got list"),
    ("p.jsonl", "{text: 1}\n", ValueError, r"p\.jsonl:1: not valid JSON"),
    ("p.jsonl", '{"text": "a", "name": "x"}\n{"text": "b", "name": "x"}\n', ValueError,
     r"repeats the names \['x'\]: names must be unique"),
])
def test_file_errors(tmp_path, name, content, error, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(error, match=match):
        prompts_from_file(path, BosTokenizer())


def test_file_length_error(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("hello\n")
    with pytest.raises(ValueError, match=r"length must be an integer >= 1, got 0"):
        prompts_from_file(path, BosTokenizer(), length=0)

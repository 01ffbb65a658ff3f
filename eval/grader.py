"""MATH grading as in openai/prm800k `grading/grader.py` + `grading/math_normalize.py` (MIT, OpenAI 2023).

The paper (Appendix F) scores MATH-500 with prm800k's `grade_answer(given, ground_truth) -> bool` on the
content of the last `\\boxed{}`. This module re-implements that algorithm step by step:

1. `mathd_normalize` (Hendrycks MATH `_strip_string`): equal normal forms -> correct.
2. `normalize` (prm800k `_normalize`): text/units/`$`/`%` removed, LaTeX turned into plain text by
   `latex_to_text` (`vdjax.eval.latex`), spaces and braces dropped, lower case; equal forms -> correct.
3. Tuples and intervals (`split_tuple`) are compared element by element: two plain fractions must match as
   strings (an unreduced fraction is wrong), an integer on one side only is wrong, anything else is
   `sympy_equal` (sympy simplifies `(gt)-(given)` to 0), refused when the expression has more than two
   distinct letters or a power that sympy could hang on (`^{`, `^(`, `^12`, `^2^`).

Differences from prm800k, all outside what it decides in practice:

- prm800k calls pylatexenc 2.10 `LatexNodes2Text().latex_to_text`, which is not a dependency here.
  `latex_to_text` reproduces its behaviour on what answers contain (macro arguments, groups, `\\frac` as
  `a/b`, `\\sqrt` as `√(x)`, matrices as `[ a b; c d ]`, accents, `\\mathbb`-style letters, unknown macros
  dropped, stray braces dropped) with a table of about 200 math macros; pylatexenc knows ~1000 more
  (mostly text symbols and arrows), which are dropped here instead of becoming a Unicode symbol.
- `sympy_equal` stops after `SYMPY_TIMEOUT_S` seconds (in the main thread, like math_verify) and counts
  that as not equal; prm800k has no time limit.
- Errors are caught as `Exception` (prm800k's bare `except:` also swallows KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading

from vdjax.eval.latex import latex_to_text

SYMPY_TIMEOUT_S = 5.0


# ---- Hendrycks MATH normalisation (prm800k math_normalize.py) --------------------------------------------
_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def mathd_normalize(answer: str | None) -> str | None:
    """prm800k `math_normalize.normalize_answer`: strip, unwrap one `\\text{}`, then `_strip_string`."""
    if answer is None:
        return None
    answer = answer.strip()
    try:
        m = _TEXT_WRAPPED.search(answer)
        if m is not None:
            answer = m.group("text").strip()
        return _strip_string(answer)
    except Exception:  # a malformed \sqrt / \frac / unit: the stripped answer as is
        return answer


def _strip_string(s: str) -> str:
    """Hendrycks `_strip_string`; raises on a malformed `\\sqrt`, `\\frac` or a second `\\text{ `."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    s = _remove_right_units(s)
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> "5"
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def _remove_right_units(s: str) -> str:
    """Drop everything from `\\text{ ` on (a unit); AssertionError when it occurs twice."""
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    assert len(parts) == 2, s
    return parts[0]


def _fix_sqrt(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}` (the first character only); IndexError on a trailing `\\sqrt`."""
    head, *rest = s.split("\\sqrt")
    out = [head]
    for part in rest:
        out.append("\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:])
    return "".join(out)


def _fix_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1b` -> `\\frac{1}{b}`, `\\frac1{72}` -> `\\frac{1}{72}`."""
    head, *rest = s.split("\\frac")
    out = [head]
    for part in rest:
        out.append("\\frac")
        if part[0] == "{":  # IndexError on a trailing \frac, as in the original
            out.append(part)
        elif len(part) < 2:
            return s
        elif part[1] != "{":
            out.append("{" + part[0] + "}{" + part[1] + "}" + part[2:])
        else:
            out.append("{" + part[0] + "}" + part[1:])
    return "".join(out)


def _fix_a_slash_b(s: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are integers written plainly."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


# ---- prm800k _normalize -----------------------------------------------------------------------------------
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard")
_UNIT_RES = [re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS]
_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")


def _parse_latex(expr: str) -> str:
    """prm800k `_parse_latex`: LaTeX to text, then √ π ∞ ∪ · × to what sympy reads."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex_to_text(expr)
    for old, new in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(old, new)
    return expr.strip()


def _is_float(text: str) -> bool:
    """`float(text)` works (it takes "inf", "1e3", " 2 ")."""
    try:
        float(text)
        return True
    except ValueError:
        return False


def _near_int(x: float) -> bool:
    """Within 1e-7 of an integer (inf and nan are not)."""
    try:
        return abs(x - round(x)) <= 1e-7
    except (OverflowError, ValueError):
        return False


def strip_thousands_commas(expr: str) -> str:
    """`1,234,567` -> `1234567`; commas between tuple elements stay."""
    while True:
        nxt = _THOUSANDS.sub(r"\1\3\4", expr)
        if nxt == expr:
            return expr
        expr = nxt


def _str_is_int(text: str) -> bool:
    """prm800k `_str_is_int`: a number (thousands commas allowed) within 1e-7 of an integer."""
    try:
        return _near_int(float(strip_thousands_commas(text)))
    except ValueError:
        return False


def normalize(expr: str | None) -> str | None:
    """prm800k `_normalize`: the answer without text, units, `$`, `%`, LaTeX, spaces or braces, lower case."""
    if expr is None:
        return None
    m = _TEXT_WRAPPED.search(expr)
    if m is not None:
        expr = m.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for unit in _UNIT_RES:
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _near_int(float(expr)):
        expr = str(round(float(expr)))
    if "\\" in expr:
        with contextlib.suppress(Exception):  # pylatexenc's failures (an empty matrix) keep the expression
            expr = _parse_latex(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: "7 3/4" -> "7+3/4"
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


# ---- comparison -------------------------------------------------------------------------------------------
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_REGEXES = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_TUPLE_CHARS = "()[]"
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")


class _SympyTimeout(Exception):
    """sympy ran past SYMPY_TIMEOUT_S."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise _SympyTimeout after `seconds` (SIGALRM, main thread only; elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise _SympyTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def should_allow_eval(expr: str) -> bool:
    """prm800k's guard before sympy: at most two distinct letters, no `^{`, `^(`, `^12` or `^2^`."""
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or any(bad in expr for bad in _BAD_SUBSTRINGS):
        return False
    return not any(r.search(expr) for r in _BAD_REGEXES)


def sympy_equal(ground_truth: str, given: str) -> bool:
    """sympy simplifies `(ground_truth)-(given)` to 0 (both already `normalize`d); False on any failure."""
    expr = f"({ground_truth})-({given})"
    if not should_allow_eval(expr):
        return False
    try:
        import sympy
        from sympy.parsing import sympy_parser

        transformations = sympy_parser.standard_transformations + (
            sympy_parser.implicit_multiplication_application,)
        with _time_limit(SYMPY_TIMEOUT_S):
            diff = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations)
            return bool(sympy.simplify(diff) == 0)
    except Exception:  # parse errors, sympy errors, the time limit
        return False


def split_tuple(expr: str) -> list[str]:
    """The elements of `(a,b)` / `[a,b)` ... (no bracket inside), else [expr]; [] for ''."""
    expr = strip_thousands_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if (len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS
            and not any(ch in inner for ch in _TUPLE_CHARS)):
        return [e.strip() for e in inner.split(",")]
    return [expr]


def _elements_equal(gt: str, given: str) -> bool:
    """One tuple element: plain fractions by string, an integer on one side only never, else sympy."""
    if _FRACTION.search(gt) and _FRACTION.search(given):
        return gt == given
    if _str_is_int(gt) != _str_is_int(given):
        return False
    return sympy_equal(gt, given)


def grade_answer(given: str | None, ground_truth: str) -> bool:
    """prm800k `grade_answer`: `given` (an extracted answer, None if there is none) matches the reference."""
    if given is None:
        return False
    if mathd_normalize(ground_truth) == mathd_normalize(given):
        return True
    gt, ans = normalize(ground_truth), normalize(given)
    if gt is None:
        return False
    if gt == ans:
        return True
    if not ans:
        return False
    gt_elems, ans_elems = split_tuple(gt), split_tuple(ans)
    if len(gt_elems) > 1 and (gt[0] != ans[0] or gt[-1] != ans[-1]):  # ( vs [: open vs closed interval
        return False
    if len(gt_elems) != len(ans_elems):
        return False
    return all(_elements_equal(g, a) for g, a in zip(gt_elems, ans_elems, strict=False))


def exact_match(given: str | None, ground_truth: str) -> bool:
    """The normalised answers are the same string (Hendrycks MATH normalisation, prm800k's first test)."""
    return given is not None and mathd_normalize(given) == mathd_normalize(ground_truth)

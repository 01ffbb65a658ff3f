"""MATH answer grading as in openai/prm800k `grading/grader.py` + `grading/math_normalize.py` (MIT, OpenAI 2023).

The paper (Appendix F) scores MATH-500 with prm800k's `grade_answer(given, ground_truth) -> bool` on the
content of the last `\\boxed{}`. This module re-implements that algorithm step by step:

1. `mathd_normalize` (Hendrycks MATH `_strip_string`): equal normal forms -> correct.
2. `normalize` (prm800k `_normalize`): text/units/`$`/`%` removed, LaTeX turned into plain text by
   `latex_to_text`, spaces and braces dropped, lower case; equal forms -> correct.
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
import unicodedata

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


# ---- LaTeX to text (the part of pylatexenc 2.10 LatexNodes2Text that answers use) --------------------------
_GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu",
          "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega")


def _greek() -> dict[str, str]:
    """pylatexenc's Greek letters: lower and capital; epsilon and phi are the lunate / symbol forms."""
    out = {}
    for name in _GREEK:
        upper = "LAMDA" if name == "lambda" else name.upper()
        small = {"EPSILON": "GREEK LUNATE EPSILON SYMBOL", "PHI": "GREEK PHI SYMBOL"}.get(
            upper, "GREEK SMALL LETTER " + upper)
        out[name] = unicodedata.lookup(small)
        out[name[0].upper() + name[1:]] = unicodedata.lookup("GREEK CAPITAL LETTER " + upper)
    out.update(varepsilon="ε", vartheta="ϑ", varpi="ϖ", varrho="ϱ", varsigma="ς", varphi="φ")
    return out


# macro -> its text: a fixed string, or a %-template over the arguments ("%s" in order, "%(2)s" by position)
_SYMBOLS = {
    **_greek(),
    "frac": "%s/%s", "nicefrac": "%s/%s", "sqrt": "√(%(2)s)", "infty": "∞", "cup": "∪", "cap": "∩",
    "cdot": "·", "times": "×", "div": "÷", "pm": "±", "mp": "∓", "circ": "∘", "bullet": "∙", "ast": "∗",
    "le": "≤", "ge": "≥", "leq": "≤", "geq": "≥", "leqslant": "⩽", "geqslant": "⩾", "neq": "≠", "ll": "≪",
    "gg": "≫", "approx": "≈", "sim": "∼", "simeq": "≃", "cong": "≅", "equiv": "≡", "propto": "∝",
    "in": "∈", "notin": "∉", "ni": "∋", "subset": "⊂", "supset": "⊃", "subseteq": "⊆", "supseteq": "⊇",
    "subsetneq": "⊊", "supsetneq": "⊋", "setminus": "∖", "emptyset": "∅", "varnothing": "∅",
    "forall": "∀", "exists": "∃", "partial": "∂", "nabla": "∇", "aleph": "ℵ", "hbar": "ħ", "ell": "ℓ",
    "sum": "∑", "prod": "∏", "int": "∫", "oint": "∮", "wedge": "∧", "vee": "∨", "lnot": "¬",
    "parallel": "∥", "perp": "⊥", "angle": "∠", "measuredangle": "∡", "square": "□", "star": "⋆",
    "therefore": "∴", "surd": "√", "prime": "'", "dag": "†", "dagger": "†", "mid": "|", "nmid": "∤",
    "vert": "|", "lvert": "|", "rvert": "|", "Vert": "‖", "lVert": "‖", "rVert": "‖",
    "langle": "⟨", "rangle": "⟩", "lfloor": "⌊", "rfloor": "⌋", "lceil": "⌈", "rceil": "⌉",
    "lbrace": "{", "rbrace": "}", "ldots": "…", "dots": "…", "dotsc": "…", "dotsb": "…", "dotsm": "…",
    "dotsi": "…", "dotso": "…",
    "cdots": "⋯", "vdots": "⋮", "ddots": "⋱", "to": "→", "rightarrow": "→", "leftarrow": "←",
    "uparrow": "↑", "downarrow": "↓", "leftrightarrow": "↔", "Rightarrow": "⇒", "Leftarrow": "⇐",
    "Leftrightarrow": "⇔", "longrightarrow": "⟶", "longleftarrow": "⟵", "mapsto": "↦",
    "sin": "sin", "cos": "cos", "tan": "tan", "arcsin": "arcsin", "arccos": "arccos", "arctan": "arctan",
    "sinh": "sinh", "cosh": "cosh", "tanh": "tanh", "ln": "ln", "log": "log", "exp": "exp", "max": "max",
    "min": "min", "sup": "sup", "inf": "inf", "lim": "lim", "textdegree": "°", "textdollar": "$",
    ",": " ", ";": " ", ":": " ", " ": " ", "!": "", "quad": "  ", "qquad": "    ", "\\": "\n",
    "hspace": "", "vspace": "\n", "{": "{", "}": "}", "$": "$", "&": "&", "#": "#", "_": "_", "%": "%",
    "~": "~", "backslash": "\\",
    **{name: "%s" for name in ("overline", "underline", "widehat", "widetilde", "overbrace", "underbrace",
                               "overrightarrow", "overleftarrow")},
}
# macros whose text is their arguments' text
_CONTENT = {"text", "textrm", "textit", "textbf", "textsc", "textsl", "emph", "mathrm"}
# accents: a combining character after each character of the argument
_ACCENTS = {"vec": "\u20d7", "hat": "\u0302", "bar": "\u0305", "dot": "\u0307", "ddot": "\u0308",
            "tilde": "\u0303", "check": "\u030c", "breve": "\u0306", "acute": "\u0301", "grave": "\u0300",
            "not": "\u0338", "'": "\u0301", "`": "\u0300", '"': "\u0308", "^": "\u0302", "=": "\u0304",
            ".": "\u0307"}
# math alphabets: (first capital, first small) code points, and the letters that live elsewhere
_STYLES = {"mathbf": (0x1D400, 0x1D41A), "mathit": (0x1D434, 0x1D44E), "mathcal": (0x1D49C, 0x1D4B6),
           "mathscr": (0x1D49C, 0x1D4B6), "mathfrak": (0x1D504, 0x1D51E), "mathbb": (0x1D538, 0x1D552),
           "mathsf": (0x1D5A0, 0x1D5BA), "mathtt": (0x1D670, 0x1D68A)}
_STYLE_HOLES = {"mathit": {"h": "ℎ"}, "mathcal": dict(zip("BEFHILMRego", "ℬℰℱℋℐℒℳℛℯℊℴ")),
                "mathfrak": dict(zip("CHIRZ", "ℭℌℑℜℨ")), "mathbb": dict(zip("CHNPQRZ", "ℂℍℕℙℚℝℤ"))}
_STYLE_HOLES["mathscr"] = _STYLE_HOLES["mathcal"]
# argument specs of the macros that take arguments ("{" mandatory, "[" optional, "*" a star)
_ARGS = {"frac": "{{", "nicefrac": "{{", "sqrt": "[{", "\\": "*[", "hspace": "*{", "vspace": "*{",
         "mbox": "{", "textup": "{", "texttt": "{", "textsf": "{", "textmd": "{", "ensuremath": "{",
         "label": "{", "hphantom": "{", "vphantom": "{",
         **{m: "{" for m in (*_CONTENT, *_ACCENTS, *_STYLES, "overline", "underline", "widehat", "widetilde",
                             "overbrace", "underbrace", "overrightarrow", "overleftarrow")}}
_SPECIALS = {"---": "—", "--": "–", "``": "“", "''": "”", "!`": "¡", "?`": "¿", "~": "\u00a0", "&": "   "}
_MATRICES = {"array", "matrix", "pmatrix", "bmatrix", "smallmatrix", "psmallmatrix", "bsmallmatrix"}
_DISPLAY = {"equation", "equation*", "eqnarray", "eqnarray*", "align", "align*", "multline", "multline*",
            "gather", "gather*", "dmath", "dmath*"}
_ENV_ARGS = {"array": "[{", "tabular*": "{{", "tabularx": "{[{", "alignat": "{", "alignat*": "{"}


class _Parser:
    """pylatexenc's LatexWalker, tolerant mode, on what answers hold. Nodes are tuples:
    ("chars", str) | ("group", nodes) | ("macro", name, args, post_space) | ("special", str) |
    ("env", name, nodes) | ("math", display, nodes); args is a list of nodes (None: parsed without any)."""

    def __init__(self, text: str):
        self.s, self.i = text, 0
        self.chars_end = -1  # where the last plain character ended

    def nodes(self, stop: str | None = None) -> list:
        """Nodes up to the closing `stop` ("}", "]", "\\)", "\\]", an environment name) or the end."""
        out: list = []
        while self.i < len(self.s):
            c, start = self.s[self.i], self.i
            if (c == stop and stop in "}]") or (stop and stop[0] == "\\" and self.s.startswith(stop, self.i)):
                self.i += len(stop)
                return out
            if c == "\\":
                node = self.macro()
                if node[0] == "end":
                    if node[1] == stop:
                        return out
                    continue  # a stray \end{...}, \) or \]: dropped
                out.append(node)
            elif c == "{":
                self.i += 1
                out.append(("group", self.nodes("}")))
            elif c == "}":
                self.i += 1  # a stray closing brace: dropped
            elif self.special() is not None:
                out.append(("special", self.special_take()))
            else:
                self.i += 1
                if out and out[-1][0] == "chars" and self.chars_end == start:  # one run of plain text
                    out[-1] = ("chars", out[-1][1] + c)
                else:
                    out.append(("chars", c))
                self.chars_end = self.i
        return out

    def special(self) -> str | None:
        """The special sequence (`&`, `~`, `--`, ...) starting here, longest first, or None."""
        return next((k for k in _SPECIALS if self.s.startswith(k, self.i)), None)

    def special_take(self) -> str:
        """Consume the special sequence starting here."""
        key = self.special()
        self.i += len(key)
        return key

    def macro(self) -> tuple:
        """A macro, an environment, inline / display math, or ("end", name) for `\\end{name}`."""
        self.i += 1
        m = re.match(r"[A-Za-z]+", self.s[self.i:])
        if m:
            name = m.group(0)
            self.i += len(name)
            after_name = self.i
            self.skip_space()  # the macro's post-space
            post_space = self.s[after_name:self.i]
        elif self.i < len(self.s):
            name, post_space = self.s[self.i], ""
            self.i += 1
        else:
            return ("chars", "")  # a lone trailing backslash
        if name in ("begin", "end"):
            env = self.env_name()
            if env is None:  # no {name}: pylatexenc keeps the word
                self.i = after_name
                return ("chars", "\\" + name)
            if name == "end":
                return ("end", env)
            self.args(_ENV_ARGS.get(env, ""))
            return ("env", env, self.nodes(env))
        if name in ("(", "["):
            return ("math", name == "[", self.nodes("\\)" if name == "(" else "\\]"))
        if name in (")", "]"):  # a stray end of math: nothing
            return ("end", "\\" + name)
        return ("macro", name, self.args(_ARGS.get(name, "")), post_space)

    def env_name(self) -> str | None:
        """The `{name}` after `\\begin` / `\\end`, None when there is none."""
        m = re.match(r"\s*\{([^{}\\]*)\}", self.s[self.i:])
        if not m:
            return None
        self.i += m.end()
        return m.group(1).strip()

    def args(self, spec: str) -> list | None:
        """The arguments of `spec`; None (no arguments at all) when a mandatory one is missing."""
        start, out = self.i, []
        for kind in spec:
            if kind == "*":
                out.append(self.star(no_space=spec == "*["))
            elif kind == "[":
                out.append(self.optional(no_space=spec == "*["))
            else:
                arg = self.mandatory()
                if arg is None:
                    self.i = start
                    return None
                out.append(arg)
        return out

    def skip_space(self) -> None:
        """Move past whitespace."""
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def star(self, no_space: bool):
        """A `*` (None when absent)."""
        j = self.i
        if not no_space:
            self.skip_space()
        if self.s.startswith("*", self.i):
            self.i += 1
            return ("chars", "*")
        self.i = j
        return None

    def optional(self, no_space: bool):
        """A `[...]` argument (None when absent)."""
        j = self.i
        if not no_space:
            self.skip_space()
        if not self.s.startswith("[", self.i):
            self.i = j
            return None
        self.i += 1
        return ("group", self.nodes("]"))

    def mandatory(self):
        """A `{...}` group, one special, one macro (without its own arguments) or one character; None at the end."""
        self.skip_space()
        if self.i >= len(self.s):
            return None
        c = self.s[self.i]
        if c == "}":  # pylatexenc takes a closing brace as an empty argument (and leaves it)
            return ("group", [])
        if c == "{":
            self.i += 1
            return ("group", self.nodes("}"))
        if self.special() is not None:
            return ("special", self.special_take())
        if c == "\\":
            return self.macro_token()
        self.i += 1
        return ("chars", c)

    def macro_token(self):
        """A macro as an argument: its name only; `\\begin`, `\\end{name}` and math delimiters are empty."""
        start = self.i
        self.i += 1
        m = re.match(r"[A-Za-z]+", self.s[self.i:])
        name = m.group(0) if m else self.s[self.i:self.i + 1]
        self.i += len(name)
        if m:
            self.skip_space()
        if name == "end":  # left in place: it still closes its environment
            self.i = start
        if name in ("begin", "end", "(", ")", "[", "]"):
            return ("group", [])
        return ("macro", name, None, "")


class _Renderer:
    """LatexNodes2Text on parsed nodes. Inside math (`\\(..\\)`, `\\[..\\]`, display environments) spaces
    follow the source: whitespace-only text is dropped and a bare macro's trailing space is kept."""

    def __init__(self):
        self.math = 0  # depth of math nodes being rendered

    def text(self, nodes: list) -> str:
        """The text of a node list."""
        out, prev = [], None
        for n in nodes:
            if self.math and n[0] == "chars":
                if prev is not None and prev[0] == "macro" and not prev[2]:
                    out.append(prev[3])
                if not n[1].strip():
                    prev = n
                    continue
            out.append(self.node(n))
            prev = n
        return "".join(out)

    def arg(self, node) -> str:
        """The text of one macro argument ('' when absent)."""
        return "" if node is None else self.node(node)

    def node(self, node) -> str:
        """The text of one node."""
        kind = node[0]
        if kind == "chars":
            return node[1]
        if kind == "group":
            return self.text(node[1])
        if kind == "special":
            return _SPECIALS[node[1]]
        if kind == "math":
            content = self.math_text(node[2])
            return _indented(content) if node[1] else content
        if kind == "env":
            return self.env(node[1], node[2])
        return self.macro(node[1], node[2])

    def math_text(self, nodes: list) -> str:
        """Math content, stripped."""
        self.math += 1
        try:
            return self.text(nodes).strip()
        finally:
            self.math -= 1

    def macro(self, name: str, args: list | None) -> str:
        """Its template, its arguments' text, an accented / styled argument, or '' (unknown: dropped)."""
        args = args or []
        if name in _CONTENT:
            return "".join(self.arg(a) for a in args)
        if name in _ACCENTS:
            chars = self.arg(args[0]).strip() if args else " "
            return "".join(unicodedata.normalize("NFC", c + _ACCENTS[name]) for c in chars)
        if name in _STYLES:
            return "".join(_styled(c, name) for c in (self.arg(args[0]) if args else ""))
        template = _SYMBOLS.get(name, "")  # unknown macros are dropped, their arguments unread
        if "%" not in template or len(template) == 1:
            return template
        texts = [self.arg(a) for a in args]
        try:
            if "%s" in template:
                return template % tuple(texts)
            return template % {str(k + 1): t for k, t in enumerate(texts)}
        except (TypeError, ValueError):  # too few arguments: pylatexenc keeps the template (a KeyError escapes)
            return template

    def env(self, name: str, nodes: list) -> str:
        """Matrices as `[ a b; c d ]`, display math indented, any other environment its content."""
        if name in _DISPLAY:
            return _indented(self.math_text(nodes))
        if name not in _MATRICES:
            return self.text(nodes)
        rows, row, cell = [], [], []
        for n in nodes + [("macro", "\\", None, "")]:
            if n == ("special", "&") or (n[0] == "macro" and n[1] == "\\"):
                if cell:
                    row.append(self.text(cell).strip())
                cell = []
                if n[1] == "\\":
                    rows.append(row)
                    row = []
            else:
                cell.append(n)
        width = max(len(x) for r in rows for x in r)  # ValueError for an empty matrix, as in pylatexenc
        return "[ " + "; ".join(" ".join(x.rjust(width) for x in r) for r in rows) + " ]"


def _styled(c: str, style: str) -> str:
    """One ASCII letter in a math alphabet (`\\mathbb{R}` -> ℝ); anything else unchanged."""
    hole = _STYLE_HOLES.get(style, {}).get(c)
    if hole:
        return hole
    upper, lower = _STYLES[style]
    if "A" <= c <= "Z":
        return chr(upper + ord(c) - ord("A"))
    if "a" <= c <= "z":
        return chr(lower + ord(c) - ord("a"))
    return c


def _indented(content: str) -> str:
    """A display block: on its own lines, indented by four spaces."""
    return "\n    " + content.replace("\n", "\n    ") + "\n"


def latex_to_text(latex: str) -> str:
    """Plain text of a LaTeX answer, as pylatexenc 2.10 `LatexNodes2Text().latex_to_text` gives it."""
    return _Renderer().text(_Parser(latex).nodes())


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
    """prm800k `grade_answer`: `given` (an extracted answer, None when there is none) matches the reference."""
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
    return all(_elements_equal(g, a) for g, a in zip(gt_elems, ans_elems))


def exact_match(given: str | None, ground_truth: str) -> bool:
    """The normalised answers are the same string (Hendrycks MATH normalisation, prm800k's first test)."""
    return given is not None and mathd_normalize(given) == mathd_normalize(ground_truth)

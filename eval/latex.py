"""LaTeX to plain text: the part of pylatexenc 2.10's LatexNodes2Text that MATH answers use."""

from __future__ import annotations

import re
import unicodedata

_GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
          "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega")


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
_STYLE_HOLES = {"mathit": {"h": "ℎ"}, "mathcal": dict(zip("BEFHILMRego", "ℬℰℱℋℐℒℳℛℯℊℴ", strict=False)),
                "mathfrak": dict(zip("CHIRZ", "ℭℌℑℜℨ", strict=False)),
                "mathbb": dict(zip("CHNPQRZ", "ℂℍℕℙℚℝℤ", strict=False))}
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
        """A `{...}` group, a special, a macro (without its own arguments) or a character; None at the end."""
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
        except (TypeError, ValueError):  # too few arguments: pylatexenc keeps the template (KeyError escapes)
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

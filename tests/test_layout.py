"""The house rules: sub-packages by layer with imports pointing one way, no import cycles, small files.

Every import of every library file is read, also those inside functions (only `if TYPE_CHECKING:` blocks
are left out: they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package it installs as (pyproject's package-dir mapping)
PACKAGES = {"vdjax": "vdjax", "models": "vdjax.models", "convert": "vdjax.convert", "eval": "vdjax.eval"}
MAX_LINES = 600
# layer -> the layers it must never import (a layer is a module-name prefix)
FORBIDDEN = {
    "vdjax.models": ("vdjax.engine", "vdjax.loading", "vdjax.analysis", "vdjax.app", "vdjax.text",
                     "vdjax.eval",
                     "vdjax.convert"),
    "vdjax.convert": ("vdjax.engine", "vdjax.loading", "vdjax.analysis", "vdjax.app", "vdjax.text",
                      "vdjax.eval"),
    "vdjax.engine": ("vdjax.analysis", "vdjax.eval", "vdjax.app", "vdjax.loading", "vdjax.text",
                     "vdjax.convert"),
    "vdjax.loading": ("vdjax.engine", "vdjax.analysis", "vdjax.eval", "vdjax.app", "vdjax.text"),
    "vdjax.text": ("vdjax.analysis", "vdjax.eval", "vdjax.app", "vdjax.loading"),
    "vdjax.analysis": ("vdjax.eval", "vdjax.app"),
    "vdjax.eval": ("vdjax.app",),
    "vdjax.checks": ("vdjax.",),
}


def library_files() -> dict[str, Path]:
    """{module name: file} of every library module."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = library_files()


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _from_base(node: ast.ImportFrom, path: Path, module: str) -> str:
    """The module a `from ... import` reads, relative imports resolved against `module`'s package."""
    base = node.module or ""
    if node.level:
        pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
    return base


def imports_of(path: Path, module: str) -> set[str]:
    """The library modules `path` imports, anywhere in the file (functions
    included, TYPE_CHECKING excluded)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for top in ast.walk(tree) if isinstance(top, ast.If) and _type_checking(top)
            for stmt in top.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, path, module)
            # `from pkg import mod` names a submodule when one exists
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "vdjax" or n.startswith("vdjax."))
    return {n for n in found if n in MODULES}


GRAPH = {m: imports_of(p, m) for m, p in MODULES.items()}


def _layer(module: str) -> str | None:
    return next((layer for layer in sorted(FORBIDDEN, key=len, reverse=True)
                 if module == layer or module.startswith(layer + ".")), None)


def test_the_import_reader_sees_imports_inside_functions():
    """The reader itself: a function-level import counts, a TYPE_CHECKING one does
    not (so the rules can fail)."""
    src = ROOT / "tests" / "_layout_probe.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vdjax.app import cli\n"
                   "def f():\n    from vdjax.engine import policies\n    import vdjax.analysis.hybrid\n")
    try:
        assert imports_of(src, "vdjax.probe") == {"vdjax.engine.policies", "vdjax.analysis.hybrid"}
    finally:
        src.unlink()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_one_way(module):
    """Each layer imports only the layers below it (engine: nothing of analysis, eval, app, loading; loading:
    nothing of the engine; nothing but the app imports the app)."""
    layer = _layer(module)
    bad = sorted(dep for dep in GRAPH[module] if layer and any(
        dep == f or dep.startswith(f if f.endswith(".") else f + ".") for f in FORBIDDEN[layer]))
    if not module.startswith("vdjax.app"):
        bad += sorted(dep for dep in GRAPH[module] if dep.startswith("vdjax.app"))
    if module != "vdjax" and not module.startswith("vdjax.app"):
        bad += ["vdjax"] if "vdjax" in GRAPH[module] else []  # the root imports everything: never back up
    assert not bad, f"{module} imports {bad}"


def test_no_import_cycles():
    """The module graph (imports inside functions included) has no cycle."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for dep in sorted(GRAPH[m]):
            if dep == m:
                continue
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_library_files_are_small(module):
    """No library file over 600 lines."""
    n = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{MODULES[module]} has {n} lines (at most {MAX_LINES})"


def test_every_public_function_has_a_docstring():
    """A one-line docstring on every public function and class of the engine and loading layers."""
    missing = []
    for module, path in MODULES.items():
        if not module.startswith(("vdjax.engine", "vdjax.loading")):
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                if not ast.get_docstring(node):
                    missing.append(f"{module}.{node.name}")
    assert not missing, missing


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: Path, module: str) -> list[str]:
    """Where `path` (the library module `module`) reads another library module's underscore name:
    `from M import _x`, `import M as m; m._x`, `from P import m; m._x` (dunder names are public).
    Each as 'line N: M._x'."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: dict[str, str] = {}  # local name -> library module (or package prefix) it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    bound[a.asname] = a.name
                else:
                    bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, path, module)
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES:
                    bound[a.asname or a.name] = full
                elif base in MODULES and base != module and _private(a.name):
                    found.append(f"line {node.lineno}: {base}.{a.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, cur = [node.attr], node.value
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if not isinstance(cur, ast.Name) or cur.id not in bound:
            continue
        target, *attrs = [bound[cur.id], *reversed(chain)]
        while attrs and f"{target}.{attrs[0]}" in MODULES:  # a.b.c: walk down the submodules
            target = f"{target}.{attrs.pop(0)}"
        if attrs and target in MODULES and target != module and _private(attrs[0]):
            found.append(f"line {node.lineno}: {target}.{attrs[0]}")
    return sorted(set(found))  # m._x.y is read as both m._x.y and m._x: one line


def test_the_private_name_reader_sees_each_form():
    """The reader itself: `from M import _x`, `import M as m; m._x`, `from P import m; m._x`,
    `import a.b; a.b._x` and a relative import are caught; dunders, public names, a module's own names and
    modules outside the library are not (so the rule can fail)."""
    src = ROOT / "tests" / "_private_probe.py"
    src.write_text("import os\nimport vdjax.engine.scores\nfrom vdjax.app.args import UsageError, __doc__\n"
                   "from vdjax.app.args import _hidden\nimport vdjax.engine.forms as F\n"
                   "from vdjax.eval import summary_rows\nfrom .args import _rel\n"
                   "from vdjax.app.cli import _own\n"
                   "def f():\n    os._exit, F.scan_form, F.__name__\n"
                   "    return F._scan.x, summary_rows._rows(), vdjax.engine.scores._INF\n")
    try:
        assert private_uses(src, "vdjax.app.cli") == [
            "line 11: vdjax.engine.forms._scan", "line 11: vdjax.engine.scores._INF",
            "line 11: vdjax.eval.summary_rows._rows", "line 4: vdjax.app.args._hidden",
            "line 7: vdjax.app.args._rel"]
    finally:
        src.unlink()


def test_no_library_module_reads_another_ones_private_names():
    """What another library module uses is public: no `from M import _x` or `m._x` of another library
    module's underscore name (dunder names allowed); tests and bench may still reach in."""
    bad = [f"{MODULES[m].relative_to(ROOT)} {use}" for m in sorted(MODULES)
           for use in private_uses(MODULES[m], m)]
    assert not bad, "\n".join(bad)

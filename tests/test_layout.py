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
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
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

"""CI's VDJAX_STRICT=1 (tests/conftest.py): a skip or a missing import fails the run,
an `optional:` skip does not."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")
SKIPPING = '''
import pytest

def test_needs_something():
    pytest.skip("needs something")

def test_optional():
    pytest.skip("optional: a separate environment")
'''
IMPORTING = ("import pytest\nmissing = pytest.importorskip('no_such_module_for_vdjax')\n\n"
             "def test_x():\n    pass\n")


def _pytest(tmp_path, text: str, strict: bool):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_case.py").write_text(text)
    env = dict(os.environ, VDJAX_STRICT="1" if strict else "0")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_strict_mode_turns_skips_into_failures(tmp_path):
    out = _pytest(tmp_path, SKIPPING, strict=True)
    assert out.returncode == 1 and "1 failed, 1 skipped" in out.stdout, out.stdout
    assert "skipped under VDJAX_STRICT=1 (CI)" in out.stdout
    assert _pytest(tmp_path, SKIPPING, strict=False).returncode == 0


def test_strict_mode_fails_a_missing_import(tmp_path):
    out = _pytest(tmp_path, IMPORTING, strict=True)
    assert out.returncode != 0 and "No module named 'no_such_module_for_vdjax'" in out.stdout, out.stdout
    out = _pytest(tmp_path, IMPORTING, strict=False)
    assert out.returncode in (0, 5) and "1 skipped" in out.stdout, out.stdout  # 5: the module skipped whole

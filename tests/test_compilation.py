"""The persistent compile cache vdjax.generate turns on, and the CLI's --layer-scan choice."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vdjax.cli import _layer_scan

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import vdjax
from helpers import random_ids, random_params, tiny_config
m = random_params(tiny_config())
vdjax.generate(m, random_ids(40, m.config.vocab_size, 1), "valuediff", 16, 16, max_new_tokens=4)
"""


def _run(tmp_path: Path, **env) -> Path:
    """generate on a tiny model in a fresh process with VDJAX_CACHE=tmp_path; returns the compile-cache folder."""
    base = {k: v for k, v in os.environ.items() if k not in ("VDJAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    code = SCRIPT.format(tests=str(Path(__file__).parent))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600,
                   env=base | {"VDJAX_CACHE": str(tmp_path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"} | env)
    return tmp_path / "jax-compile"


def test_generate_writes_the_persistent_compile_cache(tmp_path):
    folder = _run(tmp_path)
    entries = [p for p in folder.iterdir() if p.is_file()] if folder.exists() else []
    assert len(entries) >= 2, f"prefill and decode programs cached, found {entries}"


def test_compile_cache_off(tmp_path):
    assert not _run(tmp_path, VDJAX_COMPILE_CACHE="0").exists()


@pytest.mark.parametrize("flag, one_shot, want", [("auto", True, True), ("auto", False, None), ("on", False, True),
                                                  ("off", True, False), ("on", True, True)])
def test_layer_scan_flag(flag, one_shot, want):
    assert _layer_scan(argparse.Namespace(layer_scan=flag), one_shot) is want

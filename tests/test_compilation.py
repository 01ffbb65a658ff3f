"""The persistent compile cache (switched on by vdjax.compile_cache / vdjax.load only), and
the CLI's --layer-scan choice."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vdjax.app.args import layer_scan_of

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import vdjax
from helpers import random_ids, random_params, tiny_config
import jax
if {enable}:
    vdjax.compile_cache()
m = random_params(tiny_config())
vdjax.generate(m, random_ids(40, m.config.vocab_size, 1), "valuediff", 16, 16, max_new_tokens=4)
assert bool(jax.config.jax_compilation_cache_dir) == ({enable} and {on}), jax.config.jax_compilation_cache_dir
"""


def _run(tmp_path: Path, enable: bool = True, **env) -> Path:
    """generate on a tiny model in a fresh process with VDJAX_CACHE=tmp_path, after `vdjax.compile_cache()`
    when `enable`; returns the compile-cache folder."""
    base = {k: v for k, v in os.environ.items() if k not in ("VDJAX_COMPILE_CACHE",
                                                             "JAX_COMPILATION_CACHE_DIR")}
    code = SCRIPT.format(tests=str(Path(__file__).parent), enable=enable,
                         on=env.get("VDJAX_COMPILE_CACHE") != "0")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600,
                   env=base | {"VDJAX_CACHE": str(tmp_path),
                               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"} | env)
    return tmp_path / "jax-compile"


def test_generate_writes_the_persistent_compile_cache(tmp_path):
    folder = _run(tmp_path)
    entries = [p for p in folder.iterdir() if p.is_file()] if folder.exists() else []
    assert len(entries) >= 2, f"prefill and decode programs cached, found {entries}"


def test_compile_cache_off(tmp_path):
    assert not _run(tmp_path, VDJAX_COMPILE_CACHE="0").exists()


def test_generate_alone_changes_no_global_state(tmp_path):
    """No hidden global state: generate without `vdjax.compile_cache()` leaves jax's config as it was."""
    assert not _run(tmp_path, enable=False).exists()


@pytest.mark.parametrize("flag, one_shot, want", [("auto", True, True), ("auto", False, None), ("on", False,
                                                                                                True),
                                                  ("off", True, False), ("on", True, True)])
def test_layer_scan_flag(flag, one_shot, want):
    assert layer_scan_of(argparse.Namespace(layer_scan=flag), one_shot) is want


def test_compile_split_keeps_a_background_compile_out_of_the_prefill_time():
    """A call prefilled in [0, 10] and decoded in [10, 14] on thread 1: its own compiles in [0, 3] (prefill)
    and [11, 12] (decode); thread 2 compiled the decode program in [4, 11] while the prefill ran (from 10 to
    11 the decode waited for it). Prefill time loses 3 s, decode time 2 s (10-12),
    the total is 3 + 7 + 1 = 11 s."""
    from vdjax.engine.timing import compile_split, union_seconds

    spans = [(0.0, 3.0, 1), (4.0, 11.0, 2), (11.0, 12.0, 1)]
    assert compile_split(spans, 0.0, 10.0, 14.0, me=1) == (3.0, 2.0, 11.0)
    assert compile_split([(0.0, 3.0, 1), (2.0, 5.0, 1)], 0.0, 4.0, 6.0, me=1) == (4.0, 1.0,
                                                                                  5.0)  # overlaps once
    assert union_seconds([(5.0, 9.0), (1.0, 2.0)], 3.0, 8.0) == 3.0

"""bench/vs_kvpress.py: says plainly how to create the kvpress environment when it is missing; where it exists
(.venv-kvpress is git-ignored and CI does not create it) a tiny KeyDiff run (54 s on 2 cores with other jobs
holding about one of them) agrees at layer 0, where BlockPress's simulated blocks equal vdjax's true ones."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "vs_kvpress.py"
KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"


def test_says_how_to_create_the_kvpress_venv(tmp_path):
    md = tmp_path / "vs.md"
    out = subprocess.run([sys.executable, str(SCRIPT), "--kvpress-python",
                          str(tmp_path / "none" / "python"), "--out", str(md)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("python -m venv .venv-kvpress && .venv-kvpress/bin/pip install torch==2.13.0 kvpress==0.5.5"
            in out.stdout)
    assert "Nothing was measured" in out.stdout and not md.exists()


@pytest.mark.skipif(not KVPRESS_PYTHON.exists(),
                    reason="optional: no .venv-kvpress (see bench/README.md, vs_kvpress.py)")
def test_tiny_keydiff_run_agrees_at_layer_0(tmp_path, smollm2_dir):
    md = tmp_path / "vs.md"
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", str(smollm2_dir), "--lengths", "384",
                          "--budget", "256", "--new", "2", "--presses", "keydiff", "--retries", "0",
                          "--max-wait", "0", "--out", str(md)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {r["policy"]: r for r in json.loads(md.with_suffix(".json").read_text())["results"]}
    r = rows["keydiff"]
    assert r["kvpress"]["cache_after_prefill"] == 256 and r["kvpress"]["unmatched"] == 0
    assert r["vdjax"]["compiled"] == 0 and r["vdjax"]["s"] > 0 and r["kvpress"]["s"] > 0
    # layer 0 sees the same keys on both sides: BlockPress(KeyDiffPress) simulates vdjax's true blocks exactly
    assert r["agreement"]["layer0_overlap"] >= 0.99
    assert "| BlockPress(KeyDiffPress, 128) | keydiff | 384 |" in md.read_text()

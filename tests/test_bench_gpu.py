"""bench/gpu.py keeps working: it says plainly when no GPU is visible, and its CPU
smoke mode fills the table."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"


CPU_ONLY = dict(os.environ, JAX_PLATFORMS="cpu")  # the same on every machine, a GPU one included


def test_says_plainly_without_a_gpu(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "gpu.md")],
                         capture_output=True, text=True, timeout=300, env=CPU_ONLY)
    assert out.returncode == 0, out.stderr
    assert "No GPU visible" in out.stdout and "nothing was measured" in out.stdout
    assert not (tmp_path / "gpu.md").exists()


def test_cpu_smoke_run_fills_the_table(tmp_path):
    md = tmp_path / "gpu.md"
    out = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--allow-cpu", "--lengths", "512",
                          "--policies", "dense,valuediff", "--budget", "128", "--decode-steps", "4",
                          "--decode-context", "200", "--out", str(md)],
                         capture_output=True, text=True, timeout=600, env=CPU_ONLY)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [ln for ln in md.read_text().splitlines() if ln.startswith("| tiny | 512 |")]
    assert [r.split("|")[3].strip() for r in rows] == ["dense", "valuediff"]
    cells = rows[1].split("|")
    assert cells[4].strip() == "128" and float(cells[5]) > 0 and float(cells[6]) > 0  # N, TTFT, floor
    saved = json.loads((tmp_path / "gpu.json").read_text())
    row = saved["rows"][1]
    assert row["policy"] == "valuediff" and row["slots"] == 128
    assert row["floor_s"] > 0 and row["ttft_s"] > 0
    assert float(cells[7]) == pytest.approx(row["ttft_s"] / row["floor_s"], abs=0.006)  # TTFT / floor
    decode = [ln.split("|") for ln in md.read_text().splitlines() if ln.startswith("| tiny | ") and
              len(ln.split("|")) == 9]
    assert [d[2].strip() for d in decode] == ["dense", "valuediff"]
    steps = saved["decode"][1]
    assert steps["steps"] == 3
    assert float(decode[1][3]) == pytest.approx(steps["steps"] / steps["decode_s"], rel=0.01)

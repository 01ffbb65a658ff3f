"""experiments/leaderboard_table.py on synthetic prediction lines: retention, the paired difference's sign,
unfinished rows left out, incomplete tasks dropped, and the figure."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "leaderboard_table.py"
TASKS = ("t1", "t2", "t3")
# model -> folder -> policy -> task -> scores of samples 0, 1, ... (dense has no budget; the rest run at 512)
DATA = {
    "model-a": {
        "thesis": {"dense": {t: [1, 1, 1, 1] for t in TASKS},
                   "keydiff": {"t1": [1, 1, 0, 0], "t2": [1, 0, 0, 0], "t3": [1, 1, 1, 1]}},
        # no thesis-hybrid-budget line at N = 512: the N = 512 mix of thesis-hybrid-ruler is the hybrid row
        "thesis-hybrid-ruler": {"hybrid": {"t1": [1, 0, 0, 0], "t2": [0, 0, 0, 0], "t3": [0, 0, 0, 0]}},
        "leaderboard": {"dense": {t: [1, 1, 1, 1] for t in TASKS},
                        # t3 lacks a sample: t3 leaves model-a's table
                        "expected_attention": {"t1": [1, 1, 1, 0], "t2": [1, 1, 0, 0], "t3": [1, 1, 1]},
                        "kvzip": {"t1": [1, 1, 1, 1]}},  # unfinished: no line for t2, t3
        # a design of ours given the full run: its own row, beside its own copy of the dense lines
        "leaderboard/moonshot/full/N512": {"dense": {t: [1, 1, 1, 1] for t in TASKS},
                                      "chunkkv:hybrid": {"t1": [1, 1, 1, 1], "t2": [1, 1, 1, 0],
                                                         "t3": [1, 1, 1, 1]}},
    },
    "model-b": {
        "thesis": {"dense": {"t1": [1, 1, 1, 1], "t2": [1, 1, 1, 1], "t3": [1, 1, 0, 0]},
                   "keydiff": {"t1": [1, 1, 1, 1], "t2": [1, 1, 1, 0], "t3": [1, 0, 0, 0]}},
        "leaderboard": {"dense": {"t1": [1, 1, 1, 1], "t2": [1, 1, 1, 1], "t3": [1, 1, 0, 0]},
                        "expected_attention": {"t1": [1, 0, 0, 0], "t2": [0, 0, 0, 0], "t3": [1, 0, 0, 0]},
                        "kvzip": {"t1": [0, 0, 0, 0], "t2": [0, 0, 0, 0]}},
    },
}


def _load():
    """The script as a module (experiments/ is no package)."""
    spec = importlib.util.spec_from_file_location("leaderboard_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def lt():
    """The leaderboard_table module."""
    return _load()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A results folder with DATA in results/<folder>/ruler/<model>/paper/L2048/predictions.jsonl."""
    for model, folders in DATA.items():
        for folder, policies in folders.items():
            path = tmp_path / folder / "ruler" / model / "paper" / "L2048" / "predictions.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            lines, commit = [], "abcdef0123" if folder == "thesis" else "1234567fff"
            for policy, tasks in policies.items():
                for task, scores in tasks.items():
                    for i, score in enumerate(scores):
                        lines.append(json.dumps({
                            "policy": policy, "budget": None if policy == "dense" else 512, "task": task,
                            "sample_id": f"{task}-2048-42-{i}", "score": float(score),
                            "prefill_s": 8.0, "decode_s": 2.0, "batch": 4, "hyper": {}, "seed": 42,
                            "block_size": 128, "vdjax_commit": commit}))
            path.write_text("\n".join(lines) + "\n")
    return tmp_path


def test_tables(lt, root: Path):
    """Retention over the complete tasks, the paired difference's sign, unfinished rows and dropped tasks."""
    a = lt.build(root, "model-a", 512)
    rows = {r.label: r for r in a.rows}
    assert a.tasks == ["t1", "t2"] and a.dropped_tasks == ["t3"] and a.samples == 8
    ours = "chunkkv:hybrid (moonshot)"
    assert set(rows) == {"dense", "keydiff", lt.HYBRID, "expected_attention", ours}
    by_score = ["dense", ours, "expected_attention", "keydiff", lt.HYBRID]
    assert [r.label for r in a.rows] == by_score
    assert rows[ours].retention == pytest.approx(87.5) and not rows[ours].paper
    assert rows[ours].difference[0] == pytest.approx(50.0)
    assert rows["keydiff"].retention == pytest.approx(37.5)
    assert rows["expected_attention"].retention == pytest.approx(62.5)
    assert rows[lt.HYBRID].retention == pytest.approx(12.5) and rows[lt.HYBRID].paper
    assert not rows["expected_attention"].paper
    assert a.best == "keydiff" and rows["keydiff"].difference is None
    assert rows["expected_attention"].difference[0] == pytest.approx(25.0)
    assert rows[lt.HYBRID].difference[0] == pytest.approx(-25.0)
    assert a.left_out == [("kvzip", 4)]
    assert rows["dense"].prefill == pytest.approx(2.0) and rows["dense"].decode == pytest.approx(0.5)
    assert rows["dense"].lines == 12  # the leaderboard's and the moonshot's dense copies are the same lines
    assert rows["expected_attention"].per_task == {"t1": pytest.approx(75.0), "t2": pytest.approx(50.0)}

    b = lt.build(root, "model-b", 512)
    rows = {r.label: r for r in b.rows}
    assert b.tasks == list(TASKS) and not b.dropped_tasks
    assert rows["dense"].score == pytest.approx(100 * 10 / 12)
    assert rows["keydiff"].retention == pytest.approx(80.0)
    assert rows["expected_attention"].retention == pytest.approx(20.0)
    low_high = rows["expected_attention"].difference
    assert low_high[0] == pytest.approx(-50.0) and low_high[2] <= 0
    assert b.left_out == [("kvzip", 8)]

    text = lt.markdown(a)
    assert "Left out, unfinished: kvzip (4 lines)." in text
    assert "Tasks left out (a row lacks samples): t3." in text
    assert "| expected_attention | 62.5 | 62.5 % | +25.0 [" in text
    assert "seed 42; N = 512; block size 128; commits 1234567, abcdef0." in text


def test_cli_and_figure(lt, root: Path, tmp_path: Path):
    """--root, --out and --figure: the markdown holds every table, the figure is a non-empty PNG (Agg)."""
    out, fig = tmp_path / "out" / "TABLES.md", tmp_path / "out" / "retention.png"
    lt.main(["--models", "model-a,model-b", "--budgets", "512,1024", "--root", str(root), "--out", str(out),
             "--figure", str(fig)])
    import matplotlib

    assert matplotlib.get_backend().lower() == "agg"
    text = out.read_text()
    for head in ("### model-a, N = 512", "### model-b, N = 512", "#### model-a, N = 512: per task"):
        assert head in text
    assert "### model-b, N = 1024\n\nno evicting line of model-b at N = 1024." in text
    assert "#### model-b, N = 1024" not in text
    assert fig.stat().st_size > 1000 and fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_signals(lt):
    """Exact names, prefixes, the hybrid's label, and an unknown policy -> "other" with a warning."""
    assert lt.signal_of("keydiff") == "key geometry"
    assert lt.signal_of("adakv:expected_attention") == "adaptive"
    assert lt.signal_of("pyramidkv:snapkv") == "attention"
    assert lt.signal_of("pyramidkv:valuediff") == "adaptive"
    assert lt.signal_of(lt.HYBRID) == "value geometry"
    assert lt.signal_of("chunkkv:hybrid (moonshot)") == "value geometry"
    assert lt.signal_of("chunkkv:snapkv") == "attention"
    with pytest.warns(UserWarning, match="no SIGNALS group"):
        assert lt.signal_of("no-such-policy-xyz") == lt.OTHER

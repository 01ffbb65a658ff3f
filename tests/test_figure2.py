"""eval/figure2.py: the ValueDiff − KeyDiff gap vs geometry report, on a tiny hand-made results tree.

The gaps are computed by hand below (not with the module's helpers) from the scores written into the fake
predictions.jsonl; samples missing for dense, valuediff or keydiff carry scores that would change the gap if
they were counted.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from vdjax.analysis import geometry as G
from vdjax.eval import figure2 as F2
from vdjax.eval.records import PredictionsFile

MODEL, LENGTH = "tiny-model", 1000

# scores[(policy, budget)][task][sample] = score, or a list of scores (one per draw)
SCORES = {
    ("dense", None): {"t1": {"a": 1.0, "b": 1.0, "c": 0.5, "d": 1.0}, "t2": {"e": 1.0, "f": 0.5}},
    # budget 100: t1/d has no keydiff line, t2/g has no dense line -> both left out
    ("valuediff", 100): {"t1": {"a": 1.0, "b": 0.0, "c": 0.5, "d": 1.0},
                         "t2": {"e": 1.0, "f": 1.0, "g": 1.0}},
    ("keydiff", 100): {"t1": {"a": 0.0, "b": 0.0, "c": 0.5}, "t2": {"e": 1.0, "f": 0.0, "g": 0.0}},
    # budget 200: only t1/a and t1/b have all three; valuediff's t1/a has two draws (mean 0.5); t1/c has no
    # valuediff line; t2 has no keydiff line at all
    ("valuediff", 200): {"t1": {"a": [1.0, 0.0], "b": 1.0}, "t2": {"e": 0.0}},
    ("keydiff", 200): {"t1": {"a": 1.0, "b": 0.0, "c": 0.0}},
    ("streaming", 100): {"t1": {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}},  # another policy: ignored
}


def _hand_gaps():
    """(valuediff retention, keydiff retention, gap) per budget, by hand."""
    # budget 100: kept t1 {a, b, c}, t2 {e, f}
    dense = 100 * ((1 + 1 + 0.5) / 3 + (1 + 0.5) / 2) / 2
    vd = 100 * ((1 + 0 + 0.5) / 3 + (1 + 1) / 2) / 2
    kd = 100 * ((0 + 0 + 0.5) / 3 + (1 + 0) / 2) / 2
    b100 = (100 * vd / dense, 100 * kd / dense)
    # budget 200: kept t1 {a, b}; dense 100, valuediff (0.5 + 1) / 2, keydiff (1 + 0) / 2
    b200 = (100 * 0.75, 100 * 0.5)
    return {b: (v, k, v - k) for b, (v, k) in ((100, b100), (200, b200))}


def _record(task, sid, policy, budget, score, draw=0, benchmark="ruler"):
    return {"benchmark": benchmark, "model": MODEL, "length": LENGTH, "seed": 42, "protocol": "paper",
            "block_size": 128, "sampling": None, "task": task, "sample_id": f"{task}-{sid}", "draw": draw,
            "policy": policy, "budget": budget, "budget_fraction": None, "hyper": {}, "prediction": "x",
            "answers": ["x"], "score": float(score), "metric": "string_match_all", "metric_extra": {},
            "input_tokens": 900, "new_tokens": 4, "truncated": False, "fingerprint": "f"}


def _geometry() -> G.Geometry:
    """4 layers (sliding, global, sliding, global), 2 KV heads, 4 query heads, chosen statistics."""
    sk = np.array([[1.0, 3.0], [4.0, 4.0], [2.0, 2.0], [6.0, 2.0]])
    sv = np.array([[2.0, 4.0], [1.0, 1.0], [3.0, 3.0], [2.0, 2.0]])
    bos = np.array([[0.5, 0.3], [-0.2, -0.4], [0.1, 0.1], [-0.6, -0.6]])
    kv = {"sigma_k": sk, "sigma_v": sv, "s1_k": sk, "s1_v": sv, "bos_cos": bos, "wk_norm": np.ones((4, 2)),
          "wv_norm": np.ones((4, 2))}
    sink = np.array([[0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]], float)
    q = {"bos_attn": 0.5 * sink, "sink": sink, "learned_sink": np.full((4, 4), np.nan),
         "jaccard": np.full((4, 4), 0.3)}
    return G.Geometry(MODEL, kv | q, [16, None, 16, None], [{"name": "p0", "category": "qa", "tokens": 64}],
                      {"tau": 0.3, "topk": 256, "n_queries": 128, "margin": 32, "jaccard_prompts": 1})


@pytest.fixture
def tree(tmp_path):
    """(results folder, geometry folder) of a fake run: ruler/tiny-model/paper/L1000 + its geometry.json."""
    results, geometry = tmp_path / "results", tmp_path / "geometry"
    pred = results / "ruler" / MODEL / "paper" / f"L{LENGTH}" / "predictions.jsonl"
    with PredictionsFile(pred) as f:
        for (policy, budget), by_task in SCORES.items():
            for task, by_id in by_task.items():
                for sid, score in by_id.items():
                    for draw, s in enumerate(score if isinstance(score, list) else [score]):
                        f.append(_record(task, sid, policy, budget, s, draw))
        f.append(_record("t1", "a", "valuediff", 100, 0.0, benchmark="longbench"))  # another benchmark
    (geometry / MODEL).mkdir(parents=True)
    (geometry / MODEL / "geometry.json").write_text(json.dumps(_geometry().to_json()))
    return results, geometry


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_gaps_pairing_and_paper_points(tree, tmp_path):
    results, geometry = tree
    paths = F2.figure2(results, geometry, tmp_path / "out")
    assert {"md", "csv", "png", "groups_csv"} <= set(paths)
    rows = _rows(paths["csv"])
    ours = [r for r in rows if r["source"] == "ours"]
    assert [r["budget"] for r in ours] == ["100", "200", ""]  # two budgets, then the mean
    hand = _hand_gaps()
    for r in ours[:2]:
        v, k, gap = hand[int(r["budget"])]
        assert float(r["valuediff"]) == pytest.approx(v, rel=1e-5)
        assert float(r["keydiff"]) == pytest.approx(k, rel=1e-5)
        assert float(r["gap"]) == pytest.approx(gap, rel=1e-5)
    # only the samples dense, valuediff and keydiff all have: 2 tasks / 5 samples, then 1 task / 2 samples
    assert (ours[0]["tasks"], ours[0]["samples"], ours[0]["task_names"]) == ("2", "5", "t1;t2")
    assert (ours[1]["tasks"], ours[1]["samples"], ours[1]["task_names"]) == ("1", "2", "t1")
    assert float(ours[2]["gap"]) == pytest.approx((hand[100][2] + hand[200][2]) / 2, rel=1e-5)
    # our geometry: the model-level aggregate (ratio of means)
    agg = _geometry().aggregate()
    assert float(ours[0]["ratio"]) == pytest.approx(agg["ratio"], rel=1e-5)
    assert float(ours[0]["bos_cos"]) == pytest.approx(agg["bos_cos"], rel=1e-5)
    assert float(ours[0]["sink_rate"]) == pytest.approx(agg["sink_rate"], rel=1e-5)

    md = paths["md"].read_text()
    assert f"| {hand[100][2]:+.1f} | 2 / 5 |" in md and f"| {hand[200][2]:+.1f} | 1 / 2 |" in md

    # the paper's 11 models of Tables 1/4/5, per budget and mean; Gemma2-9B: +0.4, +0.7, mean 0.55 ("+0.6 pt")
    paper = [r for r in rows if r["source"] == "paper"]
    assert len({r["model"] for r in paper}) == 11 and len(paper) == 33
    g9 = {r["budget"]: r for r in paper if r["model"] == "Gemma2-9B"}
    assert float(g9["2k"]["gap"]) == pytest.approx(0.4) and float(g9["4k"]["gap"]) == pytest.approx(0.7)
    assert float(g9[""]["gap"]) == pytest.approx(0.55)
    assert (float(g9[""]["ratio"]), float(g9[""]["bos_cos"]),
            float(g9[""]["sink_rate"])) == (1.0, -0.424, 0.542)
    llama = {r["budget"]: r for r in paper if r["model"] == "Llama 3.1-8B"}
    assert (float(llama["2k"]["valuediff"]), float(llama["2k"]["keydiff"])) == (88.1, 89.6)
    assert "| Gemma2-9B | paper |" in md

    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_layer_groups(tree, tmp_path):
    results, geometry = tree
    paths = F2.figure2(results, geometry, tmp_path / "out")
    groups = {r["group"]: r for r in _rows(paths["groups_csv"])}
    assert set(groups) == {"sliding W=16", "global"}
    sl, gl = groups["sliding W=16"], groups["global"]
    assert sl["layers"] == "0;2" and gl["layers"] == "1;3"
    assert float(sl["ratio"]) == pytest.approx(((2 + 4 + 3 + 3) / 4) / ((1 + 3 + 2 + 2) / 4))
    assert float(gl["ratio"]) == pytest.approx(((1 + 1 + 2 + 2) / 4) / ((4 + 4 + 6 + 2) / 4))
    assert float(gl["bos_cos"]) == pytest.approx((-0.2 - 0.4 - 0.6 - 0.6) / 4)
    assert float(gl["sink_rate"]) == pytest.approx(5 / 8) and float(sl["sink_rate"]) == 0.0
    assert "## Per layer group" in paths["md"].read_text()
    # one kind of attention layer: nothing to split
    geo = _geometry()
    geo.windows = [None] * 4
    assert F2.layer_groups(geo) == []


def test_budgets_filter_and_cli(tree, tmp_path, capsys):
    results, geometry = tree
    out = tmp_path / "cli"
    assert F2.main(["--results", str(results), "--geometry", str(geometry), "--out", str(out),
                    "--budgets", "200", "--no-paper"]) == 0
    rows = _rows(out / "figure2.csv")
    assert [(r["source"], r["budget"]) for r in rows] == [("ours", "200"), ("ours", "")]
    assert float(rows[1]["gap"]) == pytest.approx(_hand_gaps()[200][2])
    assert (out / "figure2.png").stat().st_size > 0
    assert "png:" in capsys.readouterr().out


def test_missing_inputs_name_the_path(tree, tmp_path, capsys):
    results, geometry = tree
    with pytest.raises(FileNotFoundError, match="nowhere"):
        F2.figure2(tmp_path / "nowhere", geometry, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no-geometry"):
        F2.figure2(results, tmp_path / "no-geometry", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no predictions.jsonl"):
        F2.figure2(tmp_path / "empty", geometry, tmp_path / "out")
    with pytest.raises(ValueError, match="no math500 predictions"):
        F2.figure2(results, geometry, tmp_path / "out", benchmark="math500")
    other = tmp_path / "other-geometry"
    other.mkdir()
    with pytest.raises(FileNotFoundError, match=str(other / MODEL / "geometry.json")):
        F2.figure2(results, other, tmp_path / "out")
    assert F2.main(["--results", str(results), "--geometry", str(other), "--out", str(tmp_path / "o")]) == 2
    assert "geometry.json" in capsys.readouterr().err

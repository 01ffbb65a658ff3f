"""vdjax against kvpress 0.5.5 (its own interpreter, .venv-kvpress: git-ignored, built by .ci/install).

bench/vs_kvpress.py says plainly how to create the kvpress environment when it is missing, and a tiny
KeyDiff run (54 s on 2 cores with other jobs holding about one of them) agrees at layer 0, where BlockPress's
simulated blocks equal vdjax's true ones. The adaptive budgets (adakv:, criticalkv:, criticaladakv:,
pyramidkv) keep, in full-prefill mode (one block of the whole prompt), the positions kvpress's presses keep,
layer by layer and KV head by KV head (bench/kvpress_reference.py records kvpress's side; one model load for
all presses)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "vs_kvpress.py"
REFERENCE = ROOT / "bench" / "kvpress_reference.py"
KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"
# not "optional:": CI builds .venv-kvpress (.ci/install), so under VDJAX_STRICT=1 a missing one fails
needs_kvpress = pytest.mark.skipif(not KVPRESS_PYTHON.exists(),
                                   reason="no .venv-kvpress: .ci/install builds it (see bench/README.md)")


def test_says_how_to_create_the_kvpress_venv(tmp_path):
    md = tmp_path / "vs.md"
    out = subprocess.run([sys.executable, str(SCRIPT), "--kvpress-python",
                          str(tmp_path / "none" / "python"), "--out", str(md)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("python -m venv .venv-kvpress && .venv-kvpress/bin/pip install torch==2.13.0 kvpress==0.5.5"
            in out.stdout)
    assert "Nothing was measured" in out.stdout and not md.exists()


@needs_kvpress
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


# ---- adaptive budgets against kvpress's presses, full prefill -------------------------------------------
T, N = 512, 128  # kvpress's compression_ratio 0.75: n_kept = T * (1 - ratio) = N exactly, and CriticalKV's
# stage-1 budget int((1 - ratio) * T * 0.5) = vdjax's int(0.5 * N)
PYRAMID_WINDOW = 4  # PyramidKV's pyramid needs N / beta >= window_size (else every layer gets N): 6.4 >= 4
PRESSES = ["keydiff", "adakv:keydiff", "adakv:keynorm", "criticalkv:keydiff", "criticaladakv:keydiff",
           "pyramidkv"]
HEAD_ADAPTIVE = ("adakv:", "criticaladakv:")
# Measured on SmolLM2-135M (random ids, seed 0): 0 of 11,520 kept positions differ for every press, per-head
# counts and PyramidKV's layer budgets equal. The allowance is for ties and fp32 rounding (torch vs XLA) at
# the cut on other CPUs: 0.1 % of positions, 11 here; an off-by-one budget or a wrong score moves far more.
MAX_DIFFERING = 0.001


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir):
    """T random but fixed token ids of SmolLM2's vocabulary."""
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    return np.random.default_rng(0).integers(0, vocab, T).astype(np.int32)


@pytest.fixture(scope="module")
def kvpress_kept(tmp_path_factory, smollm2_dir, prompt_ids):
    """kvpress's kept positions for every press (bench/kvpress_reference.py, one subprocess). Started at once,
    read on first use: it runs while the vdjax side compiles."""
    if not KVPRESS_PYTHON.exists():
        yield None  # the tests skip on needs_kvpress first
        return
    d = tmp_path_factory.mktemp("kvpress_reference")
    (d / "ids.json").write_text(json.dumps(prompt_ids.tolist()))
    proc = subprocess.Popen([str(KVPRESS_PYTHON), str(REFERENCE), "--model", str(smollm2_dir), "--ids",
                             str(d / "ids.json"), "--press", ",".join(PRESSES), "--budget", str(N),
                             "--window-size", str(PYRAMID_WINDOW), "--threads", "1", "--out",
                             str(d / "kept.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = {}

    def get():
        if not result:
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, out
            result.update(json.loads((d / "kept.json").read_text()))
        return result

    yield get
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def params(smollm2_dir):
    """SmolLM2-135M's vdjax params in fp32 (kvpress's side runs in fp32 too)."""
    import vdjax

    return vdjax.load(smollm2_dir, dtype="float32")


def _compare(vd, ref) -> tuple[int, int, list[str]]:
    """(positions kvpress keeps, positions vdjax keeps that kvpress does not, per-head count mismatches) over
    every layer and KV head: vd [layer][head] int arrays, ref [layer][head] lists."""
    total = differ = 0
    counts = []
    for layer, (vd_heads, ref_heads) in enumerate(zip(vd, ref, strict=True)):
        for head, (a, b) in enumerate(zip(vd_heads, ref_heads, strict=True)):
            a, b = set(a.tolist()), set(b)
            total += len(b)
            differ += len(a - b)
            if len(a) != len(b):
                counts.append(f"layer {layer} head {head}: vdjax keeps {len(a)}, kvpress {len(b)}")
    return total, differ, counts


def _first_difference(vd, ref) -> str:
    """Where the two first disagree, for the failure message."""
    for layer, (vd_heads, ref_heads) in enumerate(zip(vd, ref, strict=True)):
        for head, (a, b) in enumerate(zip(vd_heads, ref_heads, strict=True)):
            a, b = set(a.tolist()), set(b)
            if a != b:
                return (f"first difference: layer {layer} head {head}: only vdjax keeps "
                        f"{sorted(a - b)[:12]}, only kvpress keeps {sorted(b - a)[:12]}")
    return "no difference"


@needs_kvpress
@pytest.mark.parametrize("policy", PRESSES)
def test_full_prefill_keeps_what_kvpress_keeps(policy, params, prompt_ids, kvpress_kept):
    import vdjax

    kw = {"window_size": PYRAMID_WINDOW} if policy == "pyramidkv" else {}
    # one scan step for every layer compiles much faster; PyramidKV's layer budgets need the unrolled layers
    scan = policy != "pyramidkv"
    cache, _ = vdjax.prefill(params, prompt_ids[None], policy, N, block_size=T, layer_scan=scan, **kw)
    vd = [layer[0] for layer in vdjax.kept_positions(cache)]  # row 0: [layer][head]
    ref = kvpress_kept()["presses"][policy]
    assert kvpress_kept()["T"] == T and kvpress_kept()["budget"] == N

    total, differ, counts = _compare(vd, ref["kept"])
    kh = params.config.num_kv_heads
    assert total == params.config.num_layers * kh * N  # the same memory: L * K * N in all
    assert differ <= MAX_DIFFERING * total, (f"{policy}: {differ} of {total} kept positions differ; "
                                             + _first_difference(vd, ref["kept"]))
    if policy.startswith(HEAD_ADAPTIVE):
        # kvpress's head budgets: the per-head counts, unequal (else the test would not test the pooling)
        assert not counts, f"{policy}: per-head counts differ: {counts[:5]}"
        assert any(len({len(h) for h in layer}) > 1 for layer in ref["kept"])
    else:
        assert all(len(h) == n for layer, n in zip(vd, ref["layer_budgets"], strict=True) for h in layer)
    if policy == "pyramidkv":
        budgets = ref["layer_budgets"]
        assert len(set(budgets)) > 1 and budgets[0] > N > budgets[-1], budgets  # the pyramid is active
        assert [len(layer[0]) for layer in vd] == budgets
        assert sum(budgets) == params.config.num_layers * N

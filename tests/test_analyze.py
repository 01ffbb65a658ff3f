"""`vdjax analyze` end to end on a tiny random Llama checkpoint: files, tables,
figures, hybrid weights by name."""

import csv
import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import vdjax  # noqa: E402
from vdjax.app.cli import main  # noqa: E402
from vdjax.engine.policies import default_policies  # noqa: E402

from helpers import tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 3-layer random LlamaForCausalLM with a byte-level tokenizer, saved as an HF folder."""
    path = tmp_path_factory.mktemp("tiny_llama_geo")
    tok = tiny_tokenizer(chat=False)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=1024, tie_word_embeddings=True,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   bos_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def test_analyze_writes_tables_figures_and_weights_used_by_name(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VDJAX_COMPILE_CACHE", "0")
    out = tmp_path / "geo"
    args = ["analyze", "--model", str(tiny_dir), "--out", str(out), "--length", "256", "--per-category", "1",
            "--topk", "8", "--n-queries", "6", "--jaccard-prompts", "2", "--fit", "--budget", "16",
            "--block-size", "32", "--fit-prompts", "2", "--fit-steps", "3", "--select-probes", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "KV geometry of" in printed and "held-out attention-output error" in printed
    folder = out / tiny_dir.name
    for name in ("geometry.json", "layers.csv", "heads.csv", "summary.md", "sigma_per_layer.png",
                 "sink_rate_per_layer.png", "ratio_per_layer.png", "bos_cos_per_layer.png",
                 "jaccard_per_layer.png", "hybrid-geometry.json", "hybrid-fitted.json"):
        assert (folder / name).is_file(), name
    for name in ("models.md", "models.csv", "figure1.png"):
        assert (out / name).is_file(), name
    assert (folder / "sigma_per_layer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    geo = json.loads((folder / "geometry.json").read_text())
    assert [p["category"] for p in geo["prompts"]] == ["narrative", "qa", "code", "math", "retrieval"]
    assert all(p["tokens"] == 256 for p in geo["prompts"]) and geo["settings"]["jaccard_prompts"] == 2
    sk, sv = np.array(geo["heads"]["sigma_k"]), np.array(geo["heads"]["sigma_v"])
    assert sk.shape == (3, 2) and geo["aggregate"]["ratio"] == pytest.approx(sv.mean() / sk.mean())
    with open(folder / "layers.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    assert float(rows[1]["ratio"]) == pytest.approx(sv[1].mean() / sk[1].mean(), rel=1e-4)
    models = (out / "models.csv").read_text()
    assert tiny_dir.name in models and "Llama 3.2-3B" in models and "Gemma3-4B" in models

    fitted = json.loads((folder / "hybrid-fitted.json").read_text())
    assert fitted["format"] == "vdjax-hybrid/1" and np.array(fitted["weights"]).shape == (3, 2)
    assert set(fitted["held_out_error_per_layer"]) == {"fitted", "geometry", "valuediff", "keydiff", "even"}
    nll = fitted["selection"]["nll"]  # the end-to-end selection: the saved mix is the lowest-NLL candidate
    assert set(nll) == {"fitted", "geometry", "valuediff", "keydiff", "even", "dense"}
    # on a tie in NLL, the first candidate is chosen
    assert fitted["selected"] == fitted["chosen"] == min([k for k in nll if k != "dense"], key=nll.get)
    expect = {"valuediff": 1.0, "keydiff": 0.0, "even": 0.5}.get(fitted["chosen"])
    want = np.array(fitted["per_layer_fit"]) if fitted["chosen"] == "fitted" else expect
    if want is not None:
        np.testing.assert_allclose(fitted["weights"], np.broadcast_to(want, (3, 2)))
    assert "End-to-end selection at N=16" in (folder / "summary.md").read_text()
    # saved next to the checkpoint: "hybrid" by name uses the fitted weights
    saved = (folder / "hybrid-fitted.json").read_text()
    assert (tiny_dir / "vdjax-hybrid" / "fitted.json").read_text() == saved
    # ... and as the mix of the budget it was fitted and selected at
    assert (tiny_dir / "vdjax-hybrid" / "fitted-N16.json").read_text() == saved
    params = vdjax.load(tiny_dir)
    ids = np.random.RandomState(0).randint(0, params.config.vocab_size, 80)
    by_name = vdjax.generate(params, ids, "hybrid", budget=16, block_size=16, max_new_tokens=4)
    by_path = vdjax.generate(params, ids, "hybrid", budget=16, block_size=16, max_new_tokens=4,
                             mix=str(folder / "hybrid-fitted.json"))
    np.testing.assert_array_equal(by_name, by_path)
    assert "hybrid" in default_policies(params) and "hybrid" not in default_policies(None)

    # a second model analysed into the same folder joins the all-models table
    assert main(args[:4] + [str(out)] + ["--length", "80", "--per-category", "1", "--topk", "0"]) == 0
    assert (out / "models.md").read_text().count(tiny_dir.name) == 1  # same model name: replaced, not doubled


def test_analyze_rejects_bad_arguments(tiny_dir, tmp_path, capsys):
    assert main(["analyze", "--model", str(tiny_dir), "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "--prompts" in capsys.readouterr().err
    assert main(["analyze", "--model", str(tiny_dir), "--tau", "1.5"]) == 2
    assert "--tau" in capsys.readouterr().err
    assert main(["analyze", "--model", str(tiny_dir), "--select-on", "perplexity"]) == 2
    assert "--select-on" in capsys.readouterr().err


def test_analyze_select_on_ruler_saves_the_chosen_mix(tiny_dir, tmp_path, monkeypatch):
    """--select-on ruler hands the five candidates to `select_on_ruler` (held-out seed, folder
    OUT/<model>/selection-N<budget>, the geometry rule as the prior) and saves the one it returns, with its
    scores and how it beat the prior, as the fitted mix."""
    from vdjax.app import analyze as A

    monkeypatch.setenv("VDJAX_COMPILE_CACHE", "0")
    seen = {}

    def spy(params, tok, candidates, **kw):
        seen.update(kw, candidates=candidates)
        detail = {"highest": "even", "prior": kw["prior"], "difference": [40.0, 10.0, 70.0], "level": 0.95}
        return "even", {name: 0.5 if name == "even" else 0.1 for name in candidates}, detail

    monkeypatch.setattr(A, "select_on_ruler", spy)
    out = tmp_path / "geo"
    assert main(["analyze", "--model", str(tiny_dir), "--out", str(out), "--length", "128",
                 "--per-category", "1", "--topk", "0", "--fit", "--budget", "16", "--block-size", "32",
                 "--fit-prompts", "1", "--fit-steps", "2", "--select-on", "ruler",
                 "--select-samples", "3"]) == 0
    folder = out / tiny_dir.name
    assert set(seen["candidates"]) == {"fitted", "geometry", "valuediff", "keydiff", "even"}
    assert seen["budget"] == 16 and seen["samples"] == 3 and seen["out_dir"] == folder / "selection-N16"
    assert seen["prior"] == "geometry"
    fitted = json.loads((folder / "hybrid-fitted.json").read_text())
    assert fitted["chosen"] == "even" and fitted["selection"]["seed"] == A.VALIDATION_SEED != 42
    np.testing.assert_allclose(fitted["weights"], np.full((3, 2), 0.5))
    assert fitted["selection"]["score"]["even"] == 0.5 and "qa_1" not in fitted["selection"]["tasks"]
    assert fitted["selection"]["prior"] == "geometry"
    assert fitted["selection"]["difference"] == [40.0, 10.0, 70.0]
    assert "mean RULER score of 3 held-out samples" in (folder / "summary.md").read_text()

"""Q-filters (policy `qfilter`): `vdjax.analysis.qfilters.fit_qfilters` against a NumPy principal direction of
a tiny model's post-RoPE queries, the saved filters found by name in a prefill, and `vdjax analyze --qfilters`
end to end on SmolLM2-135M (a copy of its folder: saved filters change the model's `default_policies`), whose
filters keep the tokens the held-out prompt's queries attend to (`orientation` > 0.5; negated, < 0.5).

tests/test_scorers.py has the score's NumPy reference and `bind`'s errors; tests/test_vs_kvpress.py the
kept positions against kvpress's QFilterPress given the same filters."""

import dataclasses
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import vdjax
from vdjax.analysis.qfilters import fit_qfilters, orientation
from vdjax.engine.policies import default_policies
from vdjax.engine.qfilters import load_qfilters, qfilter_path, save_qfilters

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import random_ids, random_params, tiny_config  # noqa: E402


def ref_queries(params, ids):
    """Post-RoPE queries [T, Nq, D] of every layer of one prompt, run densely layer by layer."""
    from models import transformer as tf

    cfg = params.config
    x = tf.embed(params, jnp.asarray(np.asarray(ids, np.int32)[None]))
    pos = jnp.arange(len(ids))[None]
    out = []
    for i, lw in enumerate(params.weights["layers"]):
        inv_freq = jnp.asarray(tf.layer_settings(cfg, i)[0])
        h = tf.rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        out.append(np.asarray(tf.project_qkv(lw, h, pos, cfg, inv_freq)[0][0], np.float64))
        x = tf.dense_layer(lw, x, pos, cfg, inv_freq)[0]
    return out


def test_fit_qfilters_is_the_queries_principal_direction():
    """Per layer and KV head: minus the first right singular vector of the group's stacked queries (every
    prompt's), signed so the queries' mean projects positively on it."""
    cfg = tiny_config(num_layers=3)
    params = random_params(cfg, seed=1)
    prompts = [random_ids(n, cfg.vocab_size, seed=n) for n in (17, 23)]
    got = fit_qfilters(params, prompts)
    kh, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    assert got.shape == (cfg.num_layers, kh, cfg.head_dim)
    queries = [ref_queries(params, ids) for ids in prompts]
    for layer in range(cfg.num_layers):
        for h in range(kh):
            q = np.concatenate([qs[layer][:, h * g:(h + 1) * g].reshape(-1, cfg.head_dim) for qs in queries])
            sv = np.linalg.svd(q, compute_uv=False)
            assert sv[0] > 1.05 * sv[1]  # a well-separated principal direction: the test can tell
            u = np.linalg.svd(q)[2][0]
            u = u if q.sum(0) @ u > 0 else -u
            np.testing.assert_allclose(got[layer, h], -u, atol=1e-5)
            assert q.mean(0) @ -got[layer, h] > 0


def test_saved_filters_are_found_by_name(tmp_path):
    """A prefill under policy="qfilter" with the checkpoint's saved filters keeps what it keeps when given
    the same filters."""
    cfg = tiny_config(num_layers=2)
    params = dataclasses.replace(random_params(cfg, seed=3), source=str(tmp_path))
    filters = np.random.RandomState(3).randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    ids = [random_ids(21, cfg.vocab_size, seed=1), random_ids(14, cfg.vocab_size, seed=2)]
    with pytest.raises(ValueError, match="run `vdjax analyze --model M --qfilters` first"):
        vdjax.prefill(params, ids, "qfilter", 6, block_size=4)
    save_qfilters(tmp_path, filters, model="tiny")
    found, _ = vdjax.prefill(params, ids, "qfilter", 6, block_size=4)
    given, _ = vdjax.prefill(params, ids, "qfilter", 6, block_size=4, filters=filters.tolist())
    other, _ = vdjax.prefill(params, ids, "qfilter", 6, block_size=4, filters=(-filters).tolist())
    kept = [[h.tolist() for h in row] for layer in vdjax.kept_positions(found) for row in layer]
    assert kept == [[h.tolist() for h in row] for layer in vdjax.kept_positions(given) for row in layer]
    assert kept != [[h.tolist() for h in row] for layer in vdjax.kept_positions(other) for row in layer]


def test_analyze_qfilters_end_to_end(smollm2_dir, tmp_path, capsys):
    """`vdjax analyze --model COPY --qfilters` on SmolLM2 (4 prompts of 512 tokens fitted, 1 held out) saves
    unit filters beside the copy; on the held-out prompt most KV heads' top quarter by -<f, k> receives more
    attention than the rest (0.92 of them measured; 0.89 on another unseen prompt, 0.02 with the filters
    negated)."""
    from vdjax.analysis.calibration import calibration_prompts
    from vdjax.app.cli import main

    copy = tmp_path / "smollm2"
    copy.mkdir()
    for f in smollm2_dir.iterdir():  # the weights linked, not copied; the shared folder stays as it is
        if f.is_file():
            (copy / f.name).symlink_to(f)
    args = ["analyze", "--model", str(copy), "--qfilters", "--length", "512", "--per-category", "1"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Q-filters" in printed and "of KV heads oriented" in printed
    assert not qfilter_path(smollm2_dir).exists() and qfilter_path(copy).is_file()
    saved = load_qfilters(qfilter_path(copy))
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    filters = np.asarray(saved["filters"])
    assert filters.shape == (cfg["num_hidden_layers"], cfg["num_key_value_heads"], 64)
    np.testing.assert_allclose(np.linalg.norm(filters, axis=-1), 1.0, rtol=1e-6)
    assert saved["prompts"] == 4 and saved["length"] == 512
    assert saved["held_out_oriented"] > 0.5, saved["held_out_oriented"]
    assert "qfilter" in default_policies(copy) and "qfilter" not in default_policies(smollm2_dir)
    params = vdjax.load(copy, dtype="float32")
    bound = vdjax.bind("qfilter", params, 64)
    np.testing.assert_array_equal(np.asarray(dict(bound.hyper)["filters"]), filters)
    # a prompt none of them was fitted on: the filters oriented, their negation not
    ids = calibration_prompts(vdjax.load_tokenizer(copy), length=512, per_category=2)[1].ids
    share, flipped = orientation(params, filters, ids), orientation(params, -filters, ids)
    assert share > 0.5 > flipped, (share, flipped)

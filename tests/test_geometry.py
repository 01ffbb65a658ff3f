"""KV-geometry statistics against NumPy references and constructed inputs with known answers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import vdjax
from vdjax.analysis import geometry as G

from helpers import random_ids, random_params, tiny_config


def _np_dispersion(x):
    d = np.linalg.norm(x - x.mean(axis=-2, keepdims=True), axis=-1)
    return d.std(axis=-1)


def _np_jaccard(probs, positions, k):
    """Appendix D literally: every ordered pair, top-k sets over the shared prefix
    (ties -> earlier position)."""
    h, n = probs.shape[0], len(positions)
    out = np.zeros((h, n))
    for head in range(h):
        for a, ti in enumerate(positions):
            vals = []
            for b, tj in enumerate(positions):
                if a == b:
                    continue
                c = min(ti, tj)
                A = set(np.argsort(-probs[head, ti, :c], kind="stable")[:k].tolist())
                B = set(np.argsort(-probs[head, tj, :c], kind="stable")[:k].tolist())
                vals.append(len(A & B) / len(A | B))
            out[head, a] = np.mean(vals)
    return out


def test_kv_statistics_match_numpy():
    rng = np.random.default_rng(0)
    k = rng.normal(size=(3, 50, 8)).astype(np.float32)
    k = k * rng.uniform(0.5, 3, size=(3, 1, 1)).astype(np.float32)
    v = rng.normal(size=(3, 50, 8)).astype(np.float32)
    np.testing.assert_allclose(G.dispersion(jnp.asarray(k)), _np_dispersion(k.astype(np.float64)), rtol=1e-5)
    np.testing.assert_allclose(G.top_singular(jnp.asarray(v)),
                               [np.linalg.svd(x.astype(np.float64), compute_uv=False)[0] for x in v],
                               rtol=1e-5)
    rest = k[:, 1:].mean(axis=1)
    ref = np.sum(k[:, 0] * rest, -1) / np.linalg.norm(k[:, 0], axis=-1) / np.linalg.norm(rest, axis=-1)
    np.testing.assert_allclose(G.bos_key_cosine(jnp.asarray(k)), ref, rtol=1e-5, atol=1e-6)
    wk, wv = rng.normal(size=(16, 3, 8)), rng.normal(size=(16, 3, 8))
    nk, nv = G.weight_norms(wk, wv)
    np.testing.assert_allclose(nk, [np.linalg.norm(wk[:, j], 2) for j in range(3)], rtol=1e-5)
    np.testing.assert_allclose(nv, [np.linalg.norm(wv[:, j], 2) for j in range(3)], rtol=1e-5)


def test_known_answers():
    # distances to the mean alternate 1 and 3 -> std 1; a BOS key opposite to the others -> cosine -1
    x = np.zeros((1, 4, 2), np.float32)
    x[0, :, 0] = [1, -1, 3, -3]
    assert float(G.dispersion(jnp.asarray(x))[0]) == pytest.approx(1.0)
    k = np.tile(np.array([[1.0, 2.0]], np.float32), (1, 5, 1))
    k[0, 0] = [-2.0, -4.0]
    assert float(G.bos_key_cosine(jnp.asarray(k))[0]) == pytest.approx(-1.0)
    # query heads whose non-BOS queries give BOS 0.5 / 0.1 / 0.31 / 0.29: sinks are > tau only
    t = 6
    probs = np.zeros((4, t, t), np.float32)
    for h, w in enumerate([0.5, 0.1, 0.31, 0.29]):
        probs[h, :, 0] = w
        probs[h, 0, 0] = 1.0  # the BOS query itself is excluded
    np.testing.assert_allclose(G.bos_attention(jnp.asarray(probs)), [0.5, 0.1, 0.31, 0.29], rtol=1e-6)
    st = G.layer_stats(jnp.asarray(k.repeat(2, 0)), jnp.asarray(k.repeat(2, 0)), jnp.asarray(probs),
                       topk=None)
    np.testing.assert_array_equal(st["sink"], [1, 0, 1, 0])


@pytest.mark.parametrize("ties", [False, True])
def test_jaccard_matches_numpy(ties):
    rng = np.random.default_rng(1)
    h, t, k = 2, 90, 12
    probs = rng.random((h, t, t)).astype(np.float32)
    if ties:  # many exact ties, like the zero weights beyond a sliding window
        probs[:, :, 20:50] = 0.0
        probs[:, :, 60:70] = 0.25
    pos = G.jaccard_positions(t, k, 9, 6)
    got = np.asarray(G.topk_jaccard(jnp.asarray(probs[:, pos]), jnp.asarray(pos), k=k))
    np.testing.assert_allclose(got, _np_jaccard(probs, pos, k), rtol=1e-6, atol=1e-7)


def test_jaccard_constructed():
    t, k, n = 200, 20, 8
    pos = G.jaccard_positions(t, k, n, 25)  # every shared prefix holds >= 2k positions
    # every query ranks positions the same way -> identical sets, J = 1
    same = np.tile(np.linspace(1, 0, t, dtype=np.float32), (1, t, 1))
    np.testing.assert_allclose(G.topk_jaccard(jnp.asarray(same[:, pos]), jnp.asarray(pos), k=k), 1.0)
    # even query rows prefer even positions, odd rows odd ones (prefixes >= 2k): same parity J = 1, else 0
    parity = np.zeros((1, t, t), np.float32)
    for q in range(t):
        parity[0, q] = np.where(np.arange(t) % 2 == q % 2, 1.0, 0.0) + np.linspace(0.5, 0, t)
    got = np.asarray(G.topk_jaccard(jnp.asarray(parity[:, pos]), jnp.asarray(pos), k=k))[0]
    same_parity = np.array([[pi % 2 == pj % 2 for pj in pos] for pi in pos])
    np.testing.assert_allclose(got, (same_parity.sum(1) - 1) / (len(pos) - 1), atol=1e-7)
    with pytest.raises(ValueError, match="more than k"):
        G.jaccard_positions(100, 256)


def test_appendix_d_positions():
    pos = G.jaccard_positions(2048)
    assert len(pos) == 128 and pos[0] == 288 and pos[-1] == 2047 and np.all(np.diff(pos) > 0)


def test_capture_matches_dense_cache_and_analyze_aggregates(tmp_path):
    cfg = tiny_config(num_layers=3)
    params = random_params(cfg, seed=3)
    ids = random_ids(40, cfg.vocab_size, seed=4)
    cache, _ = vdjax.prefill(params, ids, "dense", block_size=8)
    layers = list(G.capture(params, ids))
    assert len(layers) == 3
    for i, k, v, probs in layers:
        keep = np.asarray(cache[i].pos[0, 0]) >= 0  # dense: slot = position
        np.testing.assert_allclose(k, np.asarray(cache[i].k[0])[:, keep], rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(v, np.asarray(cache[i].v[0])[:, keep], rtol=1e-4, atol=2e-5)
        assert probs.shape == (cfg.num_heads, 40, 40)
        np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-5)
        assert np.all(np.triu(np.asarray(probs), 1) == 0)
    prompts = [ids, random_ids(36, cfg.vocab_size, seed=5)]
    geo = G.analyze(params, prompts, model="tiny", topk=4, n_queries=6, margin=4)
    # per-head numbers are the mean over prompts of the per-prompt statistics
    per_prompt = [[G.layer_stats(k, v, p, topk=4, n_queries=6, margin=4)
                   for _, k, v, p in G.capture(params, x)]
                  for x in prompts]
    for name in ("sigma_k", "sigma_v", "bos_cos", "bos_attn", "sink", "jaccard", "s1_k"):
        ref = np.mean([[layer[name] for layer in pp] for pp in per_prompt], axis=0)
        np.testing.assert_allclose(geo.heads[name], ref, rtol=1e-6, err_msg=name)
    agg = geo.aggregate()
    assert agg["ratio"] == pytest.approx(geo.heads["sigma_v"].mean() / geo.heads["sigma_k"].mean())
    assert agg["sink_rate"] == pytest.approx(geo.heads["sink"].mean())
    assert agg["w_ratio"] == pytest.approx(geo.heads["wv_norm"].mean() / geo.heads["wk_norm"].mean())
    assert agg["jaccard_std"] == pytest.approx(np.std(geo.heads["jaccard"].mean(axis=1)))
    back = G.Geometry.from_json(json.loads(json.dumps(geo.to_json())))
    for name in geo.heads:
        np.testing.assert_allclose(back.heads[name], geo.heads[name])
    assert back.aggregate() == pytest.approx(agg, nan_ok=True)  # learned_sink: NaN without learned sinks


def test_analyze_rejects_bad_input():
    params = random_params(tiny_config())
    with pytest.raises(ValueError, match="at least one prompt"):
        G.analyze(params, [])
    with pytest.raises(ValueError, match="tau"):
        G.analyze(params, [[1, 2, 3]], tau=1.5)
    with pytest.raises(ValueError, match="at least 2"):
        G.analyze(params, [[1]])

"""The key/value hybrid policy: exact endpoints, the mix, the geometry rule, the eviction simulation, the fit,
and weights saved with the model and used by name."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import vdjax
from vdjax.analysis import hybrid as HY
from vdjax.engine import policies as P
from vdjax.models.params import Params

from helpers import random_ids, random_params, tiny_config


def _z(s, valid):
    out = np.zeros_like(s)
    for idx in np.ndindex(s.shape[:-1]):
        m = valid[idx]
        x = s[idx][m]
        out[idx][m] = (x - x.mean()) / np.sqrt(x.var() + 1e-12)
    return out


def _np_scores(k, v, pos):
    valid = pos >= 0
    vd, kd = np.zeros(pos.shape), np.zeros(pos.shape)
    for idx in np.ndindex(pos.shape[:-1]):
        m = valid[idx]
        vd[idx] = np.linalg.norm(v[idx] - v[idx][m].mean(0), axis=-1)
        unit = k[idx][m] / np.linalg.norm(k[idx][m], axis=-1, keepdims=True)
        mu = unit.mean(0)
        kd[idx] = -(k[idx] @ mu) / (np.linalg.norm(k[idx], axis=-1) * np.linalg.norm(mu))
    return vd, kd, valid


def test_score_is_the_numpy_mix_and_exact_at_the_endpoints():
    rng = np.random.default_rng(0)
    b, kh, c, d = 2, 3, 20, 8
    k = rng.normal(size=(b, kh, c, d)).astype(np.float32)
    v = rng.normal(size=(b, kh, c, d)).astype(np.float32)
    pos = np.tile(np.arange(c), (b, kh, 1))
    pos[0, 1, 5:9] = -1
    attn = P.AttnInfo(jnp.zeros((b, kh, 1, 1, c)), jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, kh, c)),
                      layer=1)
    vd, kd, valid = _np_scores(k, v, pos)
    w = ((1.0, 1.0, 1.0), (0.25, 1.0, 0.0))  # layer 1: a mix, pure ValueDiff, pure KeyDiff head
    got = np.asarray(HY.hybrid(jnp.asarray(k), jnp.asarray(v), attn, jnp.asarray(pos), mix=w))
    ref = 0.25 * _z(vd, valid) + 0.75 * _z(kd, valid)
    np.testing.assert_allclose(got[:, 0][valid[:, 0]], ref[:, 0][valid[:, 0]], rtol=1e-4, atol=1e-5)
    exact_vd = np.asarray(P.valuediff(jnp.asarray(k), jnp.asarray(v), attn, jnp.asarray(pos)))
    exact_kd = np.asarray(P.keydiff(jnp.asarray(k), jnp.asarray(v), attn, jnp.asarray(pos)))
    np.testing.assert_array_equal(got[:, 1], exact_vd[:, 1])  # bit-identical, not just rank-equivalent
    np.testing.assert_array_equal(got[:, 2], exact_kd[:, 2])
    layer0 = P.AttnInfo(attn.probs, attn.q_pos, attn.acc, layer=0)
    np.testing.assert_array_equal(HY.hybrid(jnp.asarray(k), jnp.asarray(v), layer0, jnp.asarray(pos), mix=w),
                                  exact_vd)


@pytest.mark.parametrize("w, same_as", [(1.0, "valuediff"), (0.0, "keydiff")])
def test_endpoints_generate_exactly_like_valuediff_and_keydiff(w, same_as):
    cfg = tiny_config(num_layers=3)
    params = random_params(cfg, seed=1)
    ids = [random_ids(70, cfg.vocab_size, seed=2), random_ids(53, cfg.vocab_size, seed=3)]
    kw = dict(budget=16, block_size=8, max_new_tokens=8, eos_token_id=[])
    ref = vdjax.run(params, ids, same_as, **kw)
    got = vdjax.run(params, ids, "hybrid", mix=w, **kw)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(np.asarray(got.cache.pos), np.asarray(ref.cache.pos))
    other = vdjax.run(params, ids, "keydiff" if same_as == "valuediff" else "valuediff", **kw)
    assert not np.array_equal(np.asarray(other.cache.pos), np.asarray(ref.cache.pos))  # the test can fail


def test_per_head_and_per_layer_weights_pick_each_heads_policy():
    cfg = tiny_config(num_layers=2)
    params = random_params(cfg, seed=4)
    ids = random_ids(64, cfg.vocab_size, seed=5)
    vd, _ = vdjax.prefill(params, ids, "valuediff", budget=12, block_size=8)
    kd, _ = vdjax.prefill(params, ids, "keydiff", budget=12, block_size=8)
    # layer 0 head 0 ValueDiff, head 1 KeyDiff: layer 0 keeps what each policy keeps in that head
    mixed, _ = vdjax.prefill(params, ids, "hybrid", budget=12, block_size=8, mix=[[1.0, 0.0], [1.0, 1.0]])
    pos = lambda c, h: sorted(np.asarray(c[0].pos[0, h]).tolist())  # noqa: E731
    assert pos(mixed, 0) == pos(vd, 0) and pos(mixed, 1) == pos(kd, 1)
    assert pos(vd, 1) != pos(kd, 1)


def test_mix_checked_and_resolved(tmp_path):
    cfg = tiny_config(num_layers=3)
    params = random_params(cfg)
    assert HY.check_mix(0.5, 3, 2) == ((0.5, 0.5),) * 3
    assert HY.check_mix([0, 1, 0.5], 3, 2) == ((0.0, 0.0), (1.0, 1.0), (0.5, 0.5))
    with pytest.raises(ValueError, match=r"num_layers=3"):
        HY.check_mix([0.5, 0.5], 3, 2)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        HY.check_mix(1.5, 3, 2)
    with pytest.raises(ValueError, match="analyze"):  # nothing saved with this model
        vdjax.generate(params, [1, 2, 3], "hybrid", budget=4)
    # saved next to the checkpoint -> used by name; fitted wins over geometry
    with_source = Params(params.weights, cfg, source=str(tmp_path))
    HY.save_mix(HY.mix_path(with_source, "geometry"), np.ones((3, 2)), method="geometry", model="t")
    assert HY.resolve_mix(with_source, None) == ((1.0, 1.0),) * 3
    HY.save_mix(HY.mix_path(with_source, "fitted"), np.zeros((3, 2)), method="fitted", model="t")
    assert HY.resolve_mix(with_source, None) == ((0.0, 0.0),) * 3
    assert HY.resolve_mix(with_source, "geometry") == ((1.0, 1.0),) * 3
    ids = random_ids(40, cfg.vocab_size, seed=6)
    np.testing.assert_array_equal(vdjax.generate(with_source, ids, "hybrid", budget=8, block_size=8),
                                  vdjax.generate(params, ids, "keydiff", budget=8, block_size=8))
    # a mix selected at one budget serves that budget; others keep the budget-free file
    HY.save_mix(HY.mix_path(with_source, "fitted", 8), np.ones((3, 2)), method="fitted", model="t")
    assert HY.mix_path(with_source, "fitted", 8).name == "fitted-N8.json"
    assert HY.resolve_mix(with_source, None, 8) == ((1.0, 1.0),) * 3
    assert HY.resolve_mix(with_source, None, 16) == ((0.0, 0.0),) * 3 == HY.resolve_mix(with_source, None)
    assert HY.resolve_mix(with_source, 0.5, 8) == ((0.5, 0.5),) * 3  # given weights win over any file
    np.testing.assert_array_equal(vdjax.generate(with_source, ids, "hybrid", budget=8, block_size=8),
                                  vdjax.generate(params, ids, "valuediff", budget=8, block_size=8))
    np.testing.assert_array_equal(vdjax.generate(with_source, ids, "hybrid", budget=12, block_size=8),
                                  vdjax.generate(params, ids, "keydiff", budget=12, block_size=8))
    with pytest.raises(ValueError, match="budget must be an integer >= 1, got 0"):
        HY.mix_path(with_source, "fitted", 0)
    other = HY.save_mix(tmp_path / "w.json", np.zeros((2, 2)), method="fitted", model="other")
    with pytest.raises(ValueError, match="2 layers x 2 KV heads"):
        HY.resolve_mix(params, str(other))
    (tmp_path / "bad.json").write_text(json.dumps({"weights": [1]}))
    with pytest.raises(ValueError, match="not a vdjax hybrid mix file"):
        HY.resolve_mix(params, str(tmp_path / "bad.json"))


def test_geometry_rule_follows_the_two_axis_picture():
    # value-dominant or anchor dissolved -> ValueDiff; key-dominant with an intact BOS anchor -> KeyDiff
    assert HY.geometry_rule(1.2, -0.6) == 1.0
    assert HY.geometry_rule(0.4, 0.2) == 1.0
    assert HY.geometry_rule(0.4, -0.6) == 0.0
    assert HY.geometry_rule(0.75, -0.6) == pytest.approx(0.5)
    assert HY.geometry_rule(0.4, -0.15) == pytest.approx(0.5)
    assert HY.geometry_rule(0.75, -0.15) == pytest.approx(0.75)


# ---- the teacher-forced simulation and the fit -------------------------------------------------------------
def _np_eviction_error(k, v, probs, w, budget, block, rows):
    """Hard block eviction with the NumPy hybrid score; error of each next block's measured queries."""
    p_, kh, t, _ = k.shape
    err, energy = np.zeros((p_, kh)), np.zeros((p_, kh))
    for p in range(p_):
        for h in range(kh):
            kept = np.zeros(t, bool)
            for b in range(t // block - 1):
                end = (b + 1) * block
                cand = kept.copy()
                cand[b * block:end] = True
                pos = np.where(cand, np.arange(t), -1)[None, None]
                vd, kd, valid = _np_scores(k[p, h][None, None], v[p, h][None, None], pos)
                s = (vd if w[h] == 1 else kd if w[h] == 0
                     else w[h] * _z(vd, valid) + (1 - w[h]) * _z(kd, valid))
                order = sorted(np.flatnonzero(cand), key=lambda j: (-s[0, 0, j], j))
                kept = np.zeros(t, bool)
                kept[order[:budget]] = True
                present = np.where(np.arange(t) < end, kept, True)
                for q in rows[b]:
                    for g in range(probs.shape[2]):
                        a = probs[p, h, g, q]
                        full = a @ v[p, h]
                        part = (a * present) @ v[p, h] / (a * present).sum()
                        err[p, h] += np.sum((full - part) ** 2)
                        energy[p, h] += np.sum(full ** 2)
    return err, energy


def _synthetic(seed, p=2, t=192, d=16, g=2):
    """Two KV heads with known winners. Head 0: attention goes to tokens whose keys share the query direction
    and whose values are outliers (ValueDiff keeps them, KeyDiff evicts them as typical keys). Head 1:
    attention goes to keys anti-aligned with the common key direction, with near-mean
    values (KeyDiff keeps them)."""
    rng = np.random.default_rng(seed)
    e0, e1 = np.eye(d)[0], np.eye(d)[1]
    imp0, imp1 = rng.random((p, t)) < 0.15, rng.random((p, t)) < 0.15
    k0 = rng.normal(size=(p, t, d)) * 0.3 + 2 * e1 * imp0[..., None]
    v0 = np.where(imp0[..., None], 3.0, 0.1) * rng.normal(size=(p, t, d))
    q0 = 3 * e1 + rng.normal(size=(p, g, t, d)) * 0.3
    k1 = rng.normal(size=(p, t, d)) * 0.3 + np.where(imp1[..., None], -2.0, 2.0) * e0
    v1 = np.where(imp1[..., None], 0.1, 1.0) * rng.normal(size=(p, t, d))
    q1 = -3 * e0 + rng.normal(size=(p, g, t, d)) * 0.3
    k, v, q = np.stack([k0, k1], 1), np.stack([v0, v1], 1), np.stack([q0, q1], 1)
    logits = np.where(np.tril(np.ones((t, t), bool)), np.einsum("pkgqd,pktd->pkgqt", q, k), -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return k.astype(np.float32), v.astype(np.float32), probs.astype(np.float32)


@pytest.mark.parametrize("w", [(1.0, 0.0), (0.3, 0.8)])
def test_eviction_error_matches_numpy(w):
    k, v, probs = _synthetic(0, p=1, t=64, d=8)
    block, budget = 16, 20
    where = HY.query_rows(64, block, 5)
    got_e, got_n = HY.eviction_error(jnp.asarray(k), jnp.asarray(v), jnp.asarray(probs[:, :, :, where]),
                                     jnp.asarray(w, jnp.float32), budget=budget, block=block)
    ref_e, ref_n = _np_eviction_error(k, v, probs, w, budget, block, where)
    np.testing.assert_allclose(got_n, ref_n, rtol=1e-4)
    np.testing.assert_allclose(got_e, ref_e, rtol=2e-3, atol=1e-7)


def test_simulation_keeps_what_the_pipeline_keeps_at_layer_0():
    """Layer 0 under block processing sees exactly the prompt's K/V: the teacher-forced simulation's final
    kept set must be the pipeline's, for both endpoints and a mix."""
    cfg = tiny_config(num_layers=2)
    params = random_params(cfg, seed=7)
    ids = random_ids(64, cfg.vocab_size, seed=8)
    from vdjax.analysis.hybrid import layer_data

    (_, _, k, v, _), = [x for x in layer_data(params, ids[None], 16, 2) if x[0] == 0]
    for w in (1.0, 0.0, 0.4):
        cache, _ = vdjax.prefill(params, ids, "hybrid", budget=12, block_size=16, mix=w)
        mix = jnp.full((cfg.num_kv_heads,), w, jnp.float32)
        kept = np.asarray(HY.kept_after(k, v, mix, budget=12, block=16))
        for h in range(cfg.num_kv_heads):
            assert sorted(np.flatnonzero(kept[0, h]).tolist()) == sorted(
                x for x in np.asarray(cache[0].pos[0, h]).tolist() if x >= 0), (w, h)


def test_fitted_weights_beat_the_better_endpoint_on_a_held_out_prompt():
    block, budget = 32, 48
    where = HY.query_rows(192, block, 8)

    def data(seed):
        k, v, probs = _synthetic(seed)
        return jnp.asarray(k), jnp.asarray(v), jnp.asarray(probs[:, :, :, where])

    k, v, rows = data(0)
    w, info = HY.fit_layer(k, v, rows, budget=budget, block=block, per_head=True, steps=30)
    assert set(info["chosen"]) <= {"fitted", "geometry", "keydiff", "valuediff"}
    hk, hv, hrows = data(1)  # held out

    def err(weights):
        e, n = HY.eviction_error(hk, hv, hrows, jnp.asarray(weights, jnp.float32), budget=budget, block=block)
        return float(jnp.sum(e / n))

    fitted, vd, kd = err(w), err([1.0, 1.0]), err([0.0, 0.0])
    assert fitted <= min(vd, kd)
    assert fitted < 0.5 * min(vd, kd)  # per-head weights win clearly where each head favours another signal
    # one weight per layer cannot split the heads, but is never worse than its endpoints on the fit data
    w_layer, info_layer = HY.fit_layer(k, v, rows, budget=budget, block=block, per_head=False, steps=10)
    assert w_layer[0] == w_layer[1]
    errs = info_layer["relative_error"]
    chosen = info_layer["chosen"][0]
    assert sum(errs[chosen]) <= min(sum(errs["valuediff"]), sum(errs["keydiff"]))


def test_select_keeps_the_lowest_answer_nll_and_its_endpoints_are_the_policies():
    """`select` scores each mix by teacher-forced answer NLL under eviction; mix 1 / 0 give exactly
    ValueDiff's / KeyDiff's NLL (the same kept tokens), and the winner is the argmin."""
    from vdjax.analysis.calibration import retrieval_probes

    from helpers import tiny_tokenizer

    tok = tiny_tokenizer(chat=False)
    params = random_params(tiny_config(vocab_size=len(tok)), seed=2)
    probes = retrieval_probes(tok, 256, 2)
    assert all(tok.decode(list(p.answer)).strip().isdigit() and len(p.ids) == 256 for p in probes)
    cfg = params.config
    cands = {"valuediff": np.ones((cfg.num_layers, cfg.num_kv_heads)),
             "keydiff": np.zeros((cfg.num_layers, cfg.num_kv_heads)), "even": np.full((2, 2), 0.5)}
    best, nll = HY.select(params, probes, cands, budget=48, block=32, layer_scan=False)
    assert best == min(cands, key=nll.get) and "dense" in nll
    for name in ("valuediff", "keydiff"):
        lp = vdjax.continuation_logprobs(params, [list(p.ids) for p in probes],
                                         [list(p.answer) for p in probes], name, 48, 32)
        assert nll[name] == pytest.approx(-lp.mean(), rel=1e-6)
    assert len({round(v, 6) for v in nll.values()}) > 1  # the budget bites: the mixes differ
    with pytest.raises(ValueError, match="at least one candidate"):
        HY.select(params, probes, {}, budget=48)

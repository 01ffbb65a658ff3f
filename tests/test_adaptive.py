"""Adaptive budgets (`vdjax.engine.adaptive`, the wrappers adakv, criticaladakv, criticalkv, pyramidkv):

* the pure rules against loop-based NumPy references written from kvpress 0.5.5's AdaKVPress,
  CriticalKVPress, CriticalAdaKVPress and PyramidKVPress;
* the engine's invariants on a tiny random model after a multi-block prefill and after decoding: a pooled
  layer holds exactly min(K * N, K * seen) tokens, each head at least min(safeguard, seen), no duplicates,
  positions within [0, seen); a uniform or pyramid layer min(N_l, seen) per head;
* a budget of T + new is dense; each row of a ragged batch decides alone; composition and errors;
  `Generation` fields; a 2x2 mesh gives the single-device tokens; the pool's memory;
* the wrappers around bases that carry their own per-token feature (compactor, kvzip): the budget kept, and
  CriticalKV's ||W_o v||_1 recomputed from the candidates' values instead of read from the carried feature.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vdjax
from vdjax.engine import adaptive, inputs
from vdjax.engine import policies as P
from vdjax.engine.cache import keep_mask

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from helpers import layer0_kv, random_ids, random_params, tiny_config  # noqa: E402

# ---- NumPy references (from kvpress 0.5.5's presses, not from vdjax's code) ------------------------------


def ref_safeguard(n_kept: int, alpha: float) -> int:
    """AdaKVPress.compress's n_safe."""
    n_safe = int(n_kept * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe) if n_kept > 0 else 0
    return n_safe


def ref_layer_budget(layer_idx: int, q_len: int, compression_ratio: float, window_size: int, beta: float,
                     num_layers: int) -> int:
    """PyramidKVPress.get_layer_budget, its arithmetic as written."""
    max_capacity_prompt = window_size + q_len * (1 - compression_ratio)
    min_num = (max_capacity_prompt - window_size) / beta
    max_num = (max_capacity_prompt - window_size) * 2 - min_num
    if max_num >= q_len - window_size:
        max_num = q_len - window_size
        min_num = (max_capacity_prompt - window_size) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window_size):
        return max(1, round(q_len * (1 - compression_ratio)))
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return round(max_num - layer_idx * steps)


def ref_wo_l1(v: np.ndarray, wo: np.ndarray) -> np.ndarray:
    """CriticalKVPress.vwl1norm: v [B, K, C, D], wo [Nq, D, H] -> [B, K, C] (query head h reads KV head
    h // G, as repeat_kv; the mean over each KV head's G query heads)."""
    b_, k_, c_, _ = v.shape
    g_ = wo.shape[0] // k_
    out = np.zeros((b_, k_, c_))
    for b, k, c in np.ndindex(b_, k_, c_):
        out[b, k, c] = np.mean([np.abs(v[b, k, c].astype(np.float64) @ wo[k * g_ + g]).sum()
                                for g in range(g_)])
    return out


def _order(s: np.ndarray, idx) -> list:
    """Candidate indices sorted by score, best first (the tests' scores have no ties except +inf)."""
    return sorted(idx, key=lambda i: -s[i])


def ref_critical_scores(scores, pos, n, vnorm, eps, ratio):
    """CriticalKVPress.score per row and head: the top max(1, int(ratio * n)) kept (inf), the rest
    (score + eps) * vnorm; fp32 as the engine. Invalid candidates (pos -1) are left NaN (not compared)."""
    first = max(1, int(ratio * n)) if ratio > 0 else 0
    out = np.full(scores.shape, np.nan, np.float32)
    for b, k in np.ndindex(scores.shape[:2]):
        s = scores[b, k]
        valid = [c for c in range(s.shape[0]) if pos[b, k, c] >= 0]
        stage1 = set(_order(s, valid)[:first]) | {c for c in valid if s[c] == np.inf}
        for c in valid:
            out[b, k, c] = np.inf if c in stage1 else (s[c] + np.float32(eps)) * vnorm[b, k, c]
    return out


def _safeguarded(scores, pos, m):
    """Scores with each head's top m valid candidates set to +inf, invalid ones dropped (NaN)."""
    s = np.where(pos >= 0, scores, np.nan).astype(np.float32)
    for b, k in np.ndindex(scores.shape[:2]):
        valid = [c for c in range(s.shape[-1]) if pos[b, k, c] >= 0]
        for c in _order(s[b, k], valid)[:m]:
            s[b, k, c] = np.inf
    return s


def ref_adakv_keep(scores, pos, n, alpha):
    """AdaKVPress.compress per row: each head's top n_safe protected, then the best K * n of the row across
    heads kept (the protected ones first)."""
    b_, k_, c_ = scores.shape
    s = _safeguarded(scores, pos, ref_safeguard(n, alpha))
    keep = np.zeros(scores.shape, bool)
    for b in range(b_):
        cands = [(k, c) for k in range(k_) for c in range(c_) if pos[b, k, c] >= 0]
        for k, c in sorted(cands, key=lambda kc: -s[b][kc])[: k_ * n]:
            keep[b, k, c] = True
    return keep


def ref_criticaladakv_keep(scores, pos, n, vnorm, alpha, eps, ratio):
    """CriticalAdaKVPress.compress per row: head budgets = each head's share of the row's top K * n of the
    safeguarded scores; in each head its top int(budget * ratio) by those scores kept, then the rest of its
    budget by (score + eps) * vnorm (fp32)."""
    b_, k_, c_ = scores.shape
    s = _safeguarded(scores, pos, ref_safeguard(n, alpha))
    keep = np.zeros(scores.shape, bool)
    for b in range(b_):
        cands = [(k, c) for k in range(k_) for c in range(c_) if pos[b, k, c] >= 0]
        top = sorted(cands, key=lambda kc: -s[b][kc])[: k_ * n]
        budgets = [sum(1 for kk, _ in top if kk == k) for k in range(k_)]
        for k in range(k_):
            valid = [c for c in range(c_) if pos[b, k, c] >= 0]
            stage1 = set(_order(s[b, k], valid)[: int(budgets[k] * ratio)])
            stage1 |= {c for c in valid if s[b, k, c] == np.inf}
            s2 = {c: np.inf if c in stage1 else (s[b, k, c] + np.float32(eps)) * vnorm[b, k, c]
                  for c in valid}
            for c in sorted(valid, key=lambda c: -s2[c])[: budgets[k]]:
                keep[b, k, c] = True
    return keep


def _candidates(seed: int, protected: bool = True, b_=4, k_=4, c_=20):
    """Random fp32 scores [B, K, C] (no ties), positions c in every head with ~30 % invalid (-1); row 1's
    head 2 all invalid, row 2 has only 6 valid candidates in all, row 3 two +inf (protected) candidates
    (`protected`; else finite)."""
    rng = np.random.RandomState(seed)
    scores = rng.randn(b_, k_, c_).astype(np.float32)
    pos = np.broadcast_to(np.arange(c_, dtype=np.int32), (b_, k_, c_)).copy()
    pos[rng.rand(b_, k_, c_) < 0.3] = -1
    pos[1, 2] = -1
    pos[2] = -1
    pos[2, 0, [1, 5]] = [1, 5]
    pos[2, 3, [0, 2, 7, 9]] = [0, 2, 7, 9]
    pos[3, 1, 4] = 4
    pos[3, 2, 11] = 11
    if protected:
        scores[3, 1, 4] = scores[3, 2, 11] = np.inf
    vnorm = (rng.rand(b_, k_, c_) + 0.1).astype(np.float32)
    return scores, pos, vnorm


# ---- 1. the pure rules -----------------------------------------------------------------------------------
def test_safeguard_equals_kvpress():
    for n, alpha, want in [(6, 0.2, 1), (10, 0.2, 2), (10, 0.3, 3), (10, 0.7, 7), (100, 0.29, 28),
                           (5, 0.0, 0), (0, 0.5, 0), (7, 1.0, 7), (3, 0.01, 1), (1, 0.2, 1)]:
        assert adaptive.safeguard(n, alpha) == want == ref_safeguard(n, alpha), (n, alpha)
    for n in range(0, 40):
        for alpha in (0.0, 0.05, 0.1, 0.2, 0.25, 0.3, 0.33, 0.5, 0.7, 0.9, 1.0):
            assert adaptive.safeguard(n, alpha) == ref_safeguard(n, alpha), (n, alpha)


@pytest.mark.parametrize("num_layers,n,t,beta,ws,want", [
    (4, 256, 1024, 4, 16, (448, 320, 192, 64)),  # active: 2n - n/beta down to n/beta
    (3, 2048, 4096, 20, 64, (3994, 2048, 102)),  # kvpress defaults, active (n >= beta * ws = 1280)
    (2, 1280, 4096, 20, 64, (2496, 64)),  # the boundary min_num == window_size
    (4, 192, 256, 4, 16, (240, 208, 176, 144)),  # max_num capped at t - ws, min_num = 2n - max_num
    (3, 240, 256, 4, 16, (240, 240, 240)),  # capped to a flat pyramid
    (3, 248, 256, 4, 16, (248, 248, 248)),  # capped below min_num: fallback round(n)
    (3, 1024, 4096, 20, 64, (1024, 1024, 1024)),  # defaults, n < 1280: fallback
    (2, 2.5, 1024, 20, 64, (2, 2)),  # fallback, Python's round (half to even)
    (3, 0.25, 1024, 20, 64, (1, 1, 1)),  # fallback floored at 1
    (1, 256, 1024, 4, 16, (448,)),  # one layer: max_num
])
def test_pyramid_budgets_values(num_layers, n, t, beta, ws, want):
    got = adaptive.pyramid_budgets(num_layers, n, t, beta, ws)
    assert got == want
    assert got == tuple(ref_layer_budget(i, t, 1 - n / t, ws, beta, num_layers) for i in range(num_layers))


def test_pyramid_budgets_equal_kvpress_on_a_grid():
    """Every (L, T, n/T, beta, window) of a grid (n/T dyadic, so kvpress's T * (1 - ratio) is exactly n);
    an active pyramid is linear, falling, and sums to L * n up to rounding."""
    active = 0
    for num_layers in (1, 2, 3, 5, 8):
        for t in (256, 1024, 4096):
            for frac in (1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 15 / 16, 31 / 32):
                n = t * frac
                for beta in (1, 2, 4, 20):
                    for ws in (1, 8, 64):
                        got = adaptive.pyramid_budgets(num_layers, n, t, beta, ws)
                        want = tuple(ref_layer_budget(i, t, 1 - frac, ws, beta, num_layers)
                                     for i in range(num_layers))
                        assert got == want, (num_layers, t, n, beta, ws)
                        if len(set(got)) > 1:
                            active += 1
                            assert abs(sum(got) - num_layers * n) <= num_layers / 2
                            steps = np.diff(got)
                            assert np.all(steps <= 0) and np.ptp(steps) <= 1, got
                            assert got[0] <= t - ws and got[-1] >= ws
    assert active > 50


def test_pyramid_budgets_refuse_beta_below_one():
    with pytest.raises(ValueError, match="beta"):
        adaptive.pyramid_budgets(3, 100, 1000, 0.5, 8)


def test_wo_l1_norm_equals_reference():
    rng = np.random.RandomState(0)
    v = rng.randn(2, 2, 5, 8).astype(np.float32)  # [B, K, C, D]
    wo = rng.randn(6, 8, 12).astype(np.float32)  # [Nq = 6 (G = 3), D, H]
    got = np.asarray(adaptive.wo_l1_norm(jnp.asarray(v), jnp.asarray(wo)))
    assert got.shape == (2, 2, 5) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref_wo_l1(v, wo), rtol=1e-5)


@pytest.mark.parametrize("n,ratio", [(5, 0.5), (3, 0.0), (1, 0.5), (7, 1.0), (4, 0.3)])
def test_critical_scores_equal_reference(n, ratio):
    scores, pos, vnorm = _candidates(1, protected=False)
    got = np.asarray(adaptive.critical_scores(jnp.asarray(scores), jnp.asarray(pos), n, jnp.asarray(vnorm),
                                              1e-4, ratio))
    want = ref_critical_scores(scores, pos, n, vnorm, 1e-4, ratio)
    valid = pos >= 0
    np.testing.assert_array_equal(np.isposinf(got[valid]), np.isposinf(want[valid]))
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-6)
    # the top n of a head under the combined score: stage 1, then stage 2 by (score + eps) * vnorm
    kept = np.asarray(keep_mask(jnp.asarray(got), jnp.asarray(pos), n))
    for b, k in np.ndindex(pos.shape[:2]):
        idx = [c for c in range(pos.shape[-1]) if valid[b, k, c]]
        assert set(np.flatnonzero(kept[b, k])) == set(_order(want[b, k], idx)[:n])


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_critical_scores_keep_protected_candidates(ratio):
    """A candidate the base protects (+inf, e.g. a sink or h2o's recent window) stays +inf under CriticalKV
    (the "+inf = protected" convention of every score; critical_scores' `| (s == inf)`), whether or not it
    is among the first stage's top max(1, int(ratio * n)): with ratio 0, or with more protected candidates
    than the first stage holds. Otherwise it is ranked by (float32 max + eps) * vnorm like any other, and a
    zero vnorm (an all-zero value) gives it score 0."""
    scores, pos, vnorm = _candidates(1)
    scores[0, 0, pos[0, 0] >= 0] = np.inf  # head (0, 0): every valid candidate protected, more than n
    vnorm[3, 1, 4] = 0.0
    got = np.asarray(adaptive.critical_scores(jnp.asarray(scores), jnp.asarray(pos), 3, jnp.asarray(vnorm),
                                              1e-4, ratio))
    want = ref_critical_scores(scores, pos, 3, vnorm, 1e-4, ratio)
    prot = (scores == np.inf) & (pos >= 0)
    assert np.all(np.isposinf(want[prot]))
    assert np.all(np.isposinf(got[prot])), got[prot]


@pytest.mark.parametrize("n", [1, 3, 5, 7])
@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_adakv_keep_equals_reference(n, alpha):
    for seed in (2, 3):
        scores, pos, _ = _candidates(seed)
        got = np.asarray(adaptive.adakv_keep(jnp.asarray(scores), jnp.asarray(pos), n, alpha))
        want = ref_adakv_keep(scores, pos, n, alpha)
        np.testing.assert_array_equal(got, want)
        k_ = pos.shape[1]
        valid = (pos >= 0).sum(axis=(1, 2))
        assert np.all(got.sum(axis=(1, 2)) == np.minimum(k_ * n, valid))  # the row's pool filled
        assert not np.any(got & (pos < 0))
        m = ref_safeguard(n, alpha)  # each head keeps at least its safeguard
        assert np.all(got.sum(-1) >= np.minimum(m, (pos >= 0).sum(-1)))
        if alpha == 1.0:  # safeguard = n: the uniform per-head top n where every head has n candidates
            uniform = np.asarray(keep_mask(jnp.asarray(scores), jnp.asarray(pos), n))
            full = np.all((pos >= 0).sum(-1) >= n, axis=-1)  # [B]
            assert full.any()
            np.testing.assert_array_equal(got[full], uniform[full])


@pytest.mark.parametrize("n", [1, 3, 5])
@pytest.mark.parametrize("alpha,ratio", [(0.2, 0.5), (0.0, 0.5), (0.5, 0.0), (0.2, 1.0), (1.0, 0.3)])
def test_criticaladakv_keep_equals_reference(n, alpha, ratio):
    for seed in (4, 5):
        scores, pos, vnorm = _candidates(seed)
        got = np.asarray(adaptive.criticaladakv_keep(jnp.asarray(scores), jnp.asarray(pos), n,
                                                     jnp.asarray(vnorm), alpha, 1e-4, ratio))
        want = ref_criticaladakv_keep(scores, pos, n, vnorm, alpha, 1e-4, ratio)
        np.testing.assert_array_equal(got, want)
        # the head budgets are AdaKV's: the same count per head as adakv_keep
        ada = ref_adakv_keep(scores, pos, n, alpha)
        np.testing.assert_array_equal(got.sum(-1), ada.sum(-1))


# ---- the engine on a tiny random model ------------------------------------------------------------------
LAYERS, HEADS, KV = 3, 8, 4
def test_standardize_compares_heads_on_one_scale():
    """adakv(standardize=True): each head's scores z-scored (over its valid candidates) before the heads
    compete. In one shot (block_size >= T) layer 0 keeps AdaKV's selection over the z-scores; a head scaled
    up no longer takes the pool (the unstandardised choice differs)."""
    cfg = tiny_config(num_layers=1, vocab_size=256, num_heads=HEADS, num_kv_heads=KV)
    params = random_params(cfg, seed=3)
    ids = np.random.RandomState(9).permutation(256)[:150].astype(np.int32).tolist()
    n = 7
    cache, _ = vdjax.prefill(params, ids, "adakv:valuediff_norm", budget=n, block_size=256, standardize=True)
    plain, _ = vdjax.prefill(params, ids, "adakv:valuediff_norm", budget=n, block_size=256)
    _, v = layer0_kv(params, np.asarray(ids))
    score = np.linalg.norm(v, axis=-1).astype(np.float64)  # [K, T]
    z = (score - score.mean(1, keepdims=True)) / np.sqrt(score.var(1, keepdims=True) + 1e-12)
    pos = np.broadcast_to(np.arange(len(ids), dtype=np.int32), z.shape)[None]
    want = ref_adakv_keep(z[None].astype(np.float32), pos, n, 0.2)[0]
    got = vdjax.kept_positions(cache)[0][0]
    assert [h.tolist() for h in got] == [np.flatnonzero(w).tolist() for w in want]
    assert [h.tolist() for h in got] != [h.tolist() for h in vdjax.kept_positions(plain)[0][0]]
    with pytest.raises(ValueError, match="standardize"):
        vdjax.prefill(params, ids, "adakv:valuediff_norm", budget=n, standardize="yes")


LENGTHS = (37, 33, 14, 3)  # ragged; 37 and 33 share one length bucket alone (6 blocks of 8)
N, BLOCK, NEW = 6, 8, 5
PYR = {"beta": 2, "window_size": 2}  # T = 37, N = 6: an active pyramid 9, 6, 3
PYR_BUDGETS = (9, 6, 3)
# policy -> (keywords, pooled, safeguard, layer scan); adakv:valuediff with alpha 0.5 has a safeguard of 3
# per head. Uniform budgets run some policies under the layer scan (a stacked pool; also faster to compile on
# XLA:CPU), the pyramids unrolled (their layers differ in size)
CASES = {
    "adakv:valuediff": ({"alpha_safeguard": 0.5}, True, 3, False),
    "criticaladakv:keydiff": ({}, True, 1, True),
    "adakv:h2o": ({}, True, 1, True),
    "criticalkv:valuediff": ({}, False, 0, True),
    "pyramidkv:valuediff": (PYR, False, 0, False),
    "pyramidkv": (PYR, False, 0, False),
}


def _model():
    cfg = tiny_config(num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV)
    return random_params(cfg, seed=1)


def _rows(vocab: int) -> list[list[int]]:
    rows = [random_ids(n, vocab, seed=300 + n).tolist() for n in LENGTHS]
    assert all(r[0] != r[1] for r in rows)  # no exact tie between positions 0 and 1 (see test_sharding)
    return rows


def _kept(cache) -> list:
    """Kept positions [layer][row][head] as lists."""
    return [[[h.tolist() for h in row] for row in layer] for layer in vdjax.kept_positions(cache)]


def _mesh_child() -> dict:
    """Run in a child with 4 host devices: the pooled policies on a data 2 x model 2 mesh."""
    assert jax.device_count() == 4, jax.devices()
    params = _model()
    rows = _rows(params.config.vocab_size)
    mesh = vdjax.make_mesh(data=2, model=2)
    out = {}
    for name in ("adakv:valuediff", "criticaladakv:keydiff"):
        g = vdjax.run(params, rows, name, budget=N, block_size=BLOCK, max_new_tokens=NEW, mesh=mesh,
                      layer_scan=CASES[name][3], **CASES[name][0])
        out[name] = {"tokens": g.tokens.tolist(), "kept": _kept(g.cache)}
    return out


@pytest.fixture(scope="module")
def mesh_child():
    """The mesh runs in a child process (JAX fixes its device count at start), started with the engine
    fixtures so it runs while this process computes the single-device results."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    code = f"import sys, json; sys.path.insert(0, {str(TESTS)!r}); import test_adaptive as t; " \
           "print(json.dumps(t._mesh_child()))"
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    yield child
    if child.poll() is None:
        child.kill()
        child.communicate()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def rows(model):
    return _rows(model.config.vocab_size)


@pytest.fixture(scope="module")
def results(model, rows, mesh_child):
    """policy -> (prefill cache, Generation) on the ragged batch, computed on first use."""
    done = {}

    def get(name):
        if name not in done:
            kw = dict(CASES[name][0], layer_scan=CASES[name][3])
            cache, _ = vdjax.prefill(model, rows, name, budget=N, block_size=BLOCK, **kw)
            gen = vdjax.run(model, rows, name, budget=N, block_size=BLOCK, max_new_tokens=NEW, **kw)
            done[name] = cache, gen
        return done[name]

    return get


def _check_cache(cache, seen, per_head: tuple[int, ...], pooled: bool, safe: int):
    """Every layer's kept positions against the invariants (see the module docstring)."""
    kept = vdjax.kept_positions(cache)
    assert len(kept) == LAYERS
    for layer, n in enumerate(per_head):
        lc = cache[layer]
        assert lc.pooled == pooled
        assert lc.pos.shape[1:] == ((1, KV * n) if pooled else (KV, n)), (layer, lc.pos.shape)
        for b, heads in enumerate(kept[layer]):
            assert len(heads) == KV
            counts = [len(h) for h in heads]
            for h in heads:
                assert len(set(h.tolist())) == len(h), (layer, b, h)
                assert len(h) == 0 or (h.min() >= 0 and h.max() < seen[b]), (layer, b, h, seen[b])
            if pooled:
                assert sum(counts) == min(KV * n, KV * seen[b]), (layer, b, counts, seen[b])
                assert min(counts) >= min(safe, seen[b]), (layer, b, counts, safe)
            else:
                assert counts == [min(n, seen[b])] * KV, (layer, b, counts, seen[b])
        np.testing.assert_array_equal(np.asarray(lc.head_counts()),
                                      [[len(h) for h in row] for row in kept[layer]])


@pytest.mark.parametrize("name", list(CASES))
def test_engine_invariants(results, name):
    """After a 5-block prefill and after 4 decode steps (each evicting), every layer of every row."""
    _, pooled, safe, _ = CASES[name]
    per_head = PYR_BUDGETS if name.startswith("pyramidkv") else (N,) * LAYERS
    cache, gen = results(name)
    lengths = np.array(LENGTHS)
    _check_cache(cache, lengths, per_head, pooled, safe)
    _check_cache(gen.cache, lengths + NEW - 1, per_head, pooled, safe)
    assert gen.tokens.shape == (len(LENGTHS), NEW)
    if pooled:  # the heads really share: some layer and row holds unequal counts per head
        counts = np.asarray(gen.cache.valid_counts())  # [La, B, K]
        assert np.any(counts.max(-1) != counts.min(-1)), counts


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_layer0_pool_is_the_one_shot_adakv_selection(alpha):
    """Layer 0 sees the whole prompt's k, v under block processing; with a token-local score (||v||) the
    pool kept after a 10-block prefill is AdaKV's selection over all prompt tokens at once (the reference),
    each row on its own. Distinct tokens: a repeated token's values tie exactly."""
    cfg = tiny_config(num_layers=1, vocab_size=256, num_heads=HEADS, num_kv_heads=KV)
    params = random_params(cfg, seed=3)
    perm = np.random.RandomState(9).permutation(256).astype(np.int32)
    ids = [perm[:150].tolist(), perm[100:190].tolist()]
    n = 7
    cache, _ = vdjax.prefill(params, ids, "adakv:valuediff_norm", budget=n, block_size=16,
                             alpha_safeguard=alpha)
    kept = vdjax.kept_positions(cache)[0]
    for r, row in enumerate(ids):
        _, v = layer0_kv(params, np.asarray(row))  # [K, T, D]
        score = np.linalg.norm(v, axis=-1)[None].astype(np.float32)  # [1, K, T]
        pos = np.broadcast_to(np.arange(len(row), dtype=np.int32), score.shape)
        want = ref_adakv_keep(score, pos, n, alpha)[0]
        assert [h.tolist() for h in kept[r]] == [np.flatnonzero(w).tolist() for w in want], r
        if alpha == 0.0:
            assert len({len(h) for h in kept[r]}) > 1  # no safeguard: the heads' shares differ


def test_generation_fields(results):
    """Generation.slots (a pool's K * N), layer_budgets (the per-head budget evicted to) and hyper."""
    gen = results("adakv:valuediff")[1]
    assert gen.policy == "adakv:valuediff" and gen.budget == N
    assert gen.slots == (KV * N,) * LAYERS and gen.layer_budgets == (N,) * LAYERS
    assert dict(gen.hyper) == {"alpha_safeguard": 0.5, "standardize": False}
    gen = results("criticaladakv:keydiff")[1]
    assert gen.slots == (KV * N,) * LAYERS and gen.layer_budgets == (N,) * LAYERS
    # CriticalKV's epsilon is the policy keyword critical_epsilon (a base may have an epsilon of its own)
    assert dict(gen.hyper) == {"alpha_safeguard": 0.2, "critical_epsilon": 1e-4, "first_stage_ratio": 0.5,
                               "standardize": False}
    gen = results("criticalkv:valuediff")[1]
    assert gen.slots == (N,) * LAYERS and gen.layer_budgets == (N,) * LAYERS
    assert dict(gen.hyper) == {"critical_epsilon": 1e-4, "first_stage_ratio": 0.5}
    for name in ("pyramidkv:valuediff", "pyramidkv"):
        gen = results(name)[1]
        want = adaptive.pyramid_budgets(LAYERS, N, max(LENGTHS), **PYR)
        assert want == PYR_BUDGETS == tuple(ref_layer_budget(i, 37, 1 - N / 37, 2, 2, LAYERS)
                                            for i in range(LAYERS))
        assert gen.layer_budgets == want and gen.slots == want and gen.budget == N
        assert sum(want) == LAYERS * N
        hyper = dict(gen.hyper)
        assert hyper["beta"] == 2 and hyper["window_size"] == 2
        assert (name == "pyramidkv") == ("kernel" in hyper)


@pytest.mark.parametrize("name", ["adakv:valuediff", "criticaladakv:keydiff"])
def test_rows_decide_alone(model, rows, results, name):
    """A row run alone: the same tokens and kept positions (every layer and head) as inside the batch."""
    gen = results(name)[1]
    batch = _kept(gen.cache)
    for r in (0, 1):  # 37 and 33 tokens: one length bucket alone
        alone = vdjax.run(model, [rows[r]], name, budget=N, block_size=BLOCK, max_new_tokens=NEW,
                          layer_scan=CASES[name][3], **CASES[name][0])
        np.testing.assert_array_equal(alone.tokens[0], gen.tokens[r])
        kept = _kept(alone.cache)
        for layer in range(LAYERS):
            assert kept[layer][0] == batch[layer][r], (layer, r)


def test_mesh_equals_single_device(results, mesh_child):
    """The pooled policies on a data 2 x model 2 mesh (4 host devices, a child process): the single-device
    tokens, and the kept positions (at least 75 % of the (layer, row, head) sets identical: a sharded
    product may swap two near-tied scores, see test_sharding._same_kept)."""
    stdout, stderr = mesh_child.communicate(timeout=900)
    assert mesh_child.returncode == 0, stderr[-3000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    for name, have in got.items():
        gen = results(name)[1]
        assert have["tokens"] == gen.tokens.tolist(), name
        want = _kept(gen.cache)
        sets = [(h, w) for hl, wl in zip(have["kept"], want, strict=True)
                for hr, wr in zip(hl, wl, strict=True) for h, w in zip(hr, wr, strict=True)]
        assert np.mean([h == w for h, w in sets]) >= 0.75, name


def test_pool_memory_equals_uniform(model, rows, results):
    """The pooled cache holds the uniform cache's k, v, pos and acc bytes at the same budget; its only
    extra is the head index of each slot (int32 [B, 1, K * N] a layer)."""
    pooled = results("adakv:valuediff")[0]
    uniform, _ = vdjax.prefill(model, rows, "valuediff", budget=N, block_size=BLOCK)
    b = len(LENGTHS)
    head_bytes = 0
    for layer in range(LAYERS):
        p, u = pooled[layer], uniform[layer]
        for field in ("k", "v", "pos", "acc"):
            assert getattr(p, field).nbytes == getattr(u, field).nbytes, (layer, field)
        assert u.head is None and p.head.shape == (b, 1, KV * N) and p.head.dtype == jnp.int32
        head_bytes += p.head.nbytes
    assert pooled.nbytes() == uniform.nbytes() + head_bytes


def test_dense_nbytes_of_a_pool(model, rows, results):
    """`KVCache.dense_nbytes(tokens)` (the dense cache a run is compared with, `vdjax generate`'s memory
    line) is the model's, whatever the policy's layout: rows x K heads x tokens x (k + v) per layer."""
    pooled = results("adakv:valuediff")[0]
    uniform = results("criticalkv:valuediff")[0]  # uniform slots, same budget and model
    want = len(LENGTHS) * LAYERS * KV * 100 * 2 * model.config.head_dim * model.dtype.itemsize
    assert uniform.dense_nbytes(100) == want
    assert pooled.dense_nbytes(100) == want


@pytest.mark.parametrize("name", ["adakv:valuediff", "criticaladakv:valuediff", "criticalkv:valuediff",
                                  "pyramidkv:valuediff", "pyramidkv"])
def test_full_budget_is_dense(model, rows, name):
    """N >= T + new: nothing is ever evicted, the greedy tokens are dense's (pyramidkv falls back to N, so
    its layers are uniform and the layer scan runs)."""
    full = max(LENGTHS) + NEW
    dense = vdjax.generate(model, rows, "dense", block_size=64, max_new_tokens=NEW, layer_scan=True)
    gen = vdjax.run(model, rows, name, budget=full, block_size=BLOCK, max_new_tokens=NEW, layer_scan=True)
    np.testing.assert_array_equal(gen.tokens, dense)
    assert gen.layer_budgets == (full,) * LAYERS
    for layer in vdjax.kept_positions(gen.cache):
        for r, heads in enumerate(layer):
            for h in heads:
                assert h.tolist() == list(range(LENGTHS[r] + NEW - 1))


def test_sinks_inside_adakv(model, rows):
    """adakv:valuediff+sinks4: positions 0..3 in every head of every layer and row, after the prefill and
    after decoding; the pool's invariants hold."""
    name = "adakv:valuediff+sinks4"
    policy = vdjax.get_policy(name)
    assert policy.name == name and policy.heads == "adakv"
    cache, _ = vdjax.prefill(model, rows, name, budget=N, block_size=BLOCK, layer_scan=True)
    gen = vdjax.run(model, rows, name, budget=N, block_size=BLOCK, max_new_tokens=NEW, layer_scan=True)
    lengths = np.array(LENGTHS)
    for c, seen in ((cache, lengths), (gen.cache, lengths + NEW - 1)):
        _check_cache(c, seen, (N,) * LAYERS, True, 1)
        for layer in vdjax.kept_positions(c):
            for r, heads in enumerate(layer):
                for h in heads:
                    assert set(range(min(4, seen[r]))) <= set(h.tolist()), (r, h)


def test_sliding_window_layers():
    """A sliding / full model (W = 5) under adakv:valuediff at N = 6: the sliding layer's pool has K * (W - 1)
    slots and holds exactly the live tokens, the last min(seen, W - 1) positions of every head; the full
    layer is a pool of K * N with the pool's invariants."""
    cfg = tiny_config(num_layers=2, num_heads=HEADS, num_kv_heads=KV, sliding_window=5,
                      layer_types=("sliding_attention", "full_attention"))
    params = random_params(cfg, seed=2)
    ids = _rows(cfg.vocab_size)
    gen = vdjax.run(params, ids, "adakv:valuediff", budget=N, block_size=BLOCK, max_new_tokens=NEW)
    assert gen.layer_budgets == (4, N) and gen.slots == (KV * 4, KV * N)
    seen = np.array(LENGTHS) + NEW - 1
    kept = vdjax.kept_positions(gen.cache)
    for r, heads in enumerate(kept[0]):
        for h in heads:
            assert h.tolist() == list(range(max(0, seen[r] - 4), seen[r])), r
    for r, heads in enumerate(kept[1]):
        counts = [len(h) for h in heads]
        assert sum(counts) == min(KV * N, KV * seen[r]) and min(counts) >= min(1, seen[r])
        assert all(len(set(h.tolist())) == len(h) and (len(h) == 0 or h.max() < seen[r]) for h in heads)


# ---- composition and errors (no compile) ----------------------------------------------------------------
def test_composition_refused():
    """combine refuses parts that set budgets; a head rule cannot wrap a head rule, nor a layer rule a layer
    rule; criticalkv twice clashes on its keywords."""
    for part in (vdjax.adakv("valuediff"), vdjax.criticaladakv("keydiff"), "pyramidkv", "adakv:valuediff",
                 vdjax.pyramidkv("valuediff")):
        with pytest.raises(ValueError, match="combine"):
            vdjax.combine({part: 1.0, "keydiff": 1.0})
    for outer in (vdjax.adakv, vdjax.criticaladakv):
        for inner in ("adakv:valuediff", "criticaladakv:valuediff"):
            with pytest.raises(ValueError, match="already shares"):
                outer(inner)
    with pytest.raises(ValueError, match="already shares"):
        vdjax.get_policy("adakv:adakv:valuediff")
    for inner in ("pyramidkv", "pyramidkv:valuediff"):
        with pytest.raises(ValueError, match="layer budgets"):
            vdjax.pyramidkv(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        vdjax.criticalkv("criticalkv:valuediff")
    for wrapper in (vdjax.adakv, vdjax.criticaladakv, vdjax.criticalkv, vdjax.pyramidkv):
        with pytest.raises(ValueError, match="evicting"):
            wrapper("dense")


def test_unknown_names_give_the_registry_error(model, rows):
    for name, unknown in [("adakv:nosuch", "nosuch"), ("fookv:valuediff", "fookv:valuediff"),
                          ("adakv:", "adakv:"), ("criticalkv:valuediff:x", "valuediff:x")]:
        with pytest.raises(ValueError, match=f"unknown policy '{unknown}'; registered"):
            vdjax.get_policy(name)
    with pytest.raises(ValueError, match="unknown policy 'nosuch'"):
        vdjax.generate(model, rows, "pyramidkv:nosuch", budget=N)


@pytest.mark.parametrize("make,keyword", [
    (lambda: vdjax.adakv("valuediff", alpha_safeguard=1.5), "alpha_safeguard"),
    (lambda: vdjax.adakv("valuediff", alpha_safeguard=-0.1), "alpha_safeguard"),
    (lambda: vdjax.adakv("valuediff", alpha_safeguard=True), "alpha_safeguard"),
    (lambda: vdjax.criticaladakv("valuediff", alpha_safeguard=2), "alpha_safeguard"),
    (lambda: vdjax.criticaladakv("valuediff", first_stage_ratio=1.5), "first_stage_ratio"),
    (lambda: vdjax.criticalkv("valuediff", epsilon=-1.0), "epsilon"),
    (lambda: vdjax.criticalkv("valuediff", first_stage_ratio=float("nan")), "first_stage_ratio"),
    (lambda: vdjax.pyramidkv("valuediff", beta=0.5), "beta"),
    (lambda: vdjax.pyramidkv("valuediff", window_size=0), "window_size"),
])
def test_bad_wrapper_keywords(make, keyword):
    with pytest.raises(ValueError, match=keyword):
        make()


@pytest.mark.parametrize("name,kw,keyword", [
    ("adakv:valuediff", {"alpha_safeguard": 1.5}, "alpha_safeguard"),
    ("criticaladakv:valuediff", {"first_stage_ratio": -0.5}, "first_stage_ratio"),
    ("criticalkv:valuediff", {"critical_epsilon": -1.0}, "epsilon"),
    ("pyramidkv:valuediff", {"beta": 0.5}, "beta"),
    ("pyramidkv", {"window_size": 0}, "window_size"),
])
def test_bad_keywords_at_the_call(model, rows, name, kw, keyword):
    """The same keywords given to the call (`vdjax.prefill(..., alpha_safeguard=1.5)`) are refused there."""
    with pytest.raises(ValueError, match=keyword):
        inputs.plan(model, rows, name, N, BLOCK, **kw)


def test_unknown_keyword_at_the_call(model, rows):
    with pytest.raises(TypeError, match="alpha"):
        vdjax.prefill(model, rows, "criticalkv:valuediff", budget=N, alpha_safeguard=0.3)


def test_budget_sequence_checked(model, rows):
    for budget, match in [([6, 6], "budget has 2 entries"), ([6, 6, 6, 6], "budget has 4"),
                          ([6, 0, 6], r"budget\[1\]"), ([6, -2, 6], r"budget\[1\]"),
                          ([6, 6.5, 6], r"budget\[1\]")]:
        with pytest.raises(ValueError, match=match):
            vdjax.prefill(model, rows, "valuediff", budget=budget, block_size=BLOCK)
    with pytest.raises(ValueError, match="budget"):  # pyramidkv sets its own layer budgets
        vdjax.prefill(model, rows, "pyramidkv:valuediff", budget=[9, 6, 3], block_size=BLOCK, **PYR)
    p = inputs.plan(model, rows, "adakv:valuediff", [9, 6, 3], BLOCK)
    assert p.bound.budget == (9, 6, 3) and p.bound.layer_budgets == (9, 6, 3) and p.slots == 9


def test_layer_scan_with_layer_budgets(model, rows, monkeypatch):
    """layer_scan=True with budgets that differ by layer is refused; None falls back to the unrolled layers
    (even where the backend's default is the scan); uniform budgets scan."""
    for name, budget, kw in [("valuediff", [9, 6, 3], {}), ("pyramidkv:valuediff", N, PYR),
                             ("adakv:valuediff", [6, 6, 5], {})]:
        with pytest.raises(ValueError, match="layer_scan"):
            inputs.plan(model, rows, name, budget, BLOCK, layer_scan=True, **kw)
    monkeypatch.setattr(inputs, "default_layer_scan", lambda: True)
    assert not inputs.plan(model, rows, "valuediff", [9, 6, 3], BLOCK).scan
    assert not inputs.plan(model, rows, "pyramidkv", N, BLOCK, **PYR).scan
    assert inputs.plan(model, rows, "adakv:valuediff", [6, 6, 6], BLOCK).scan
    assert inputs.plan(model, rows, "adakv:valuediff", N, BLOCK).scan
    assert inputs.plan(model, rows, "pyramidkv", 30, BLOCK).scan  # fallback: uniform


# ---- bases that carry their own per-token feature (compactor's tile attention, kvzip's replay scores) ------
KVZIP_IDS = {"repeat_ids": (1, 2, 3), "continue_ids": (4, 5), "suffix_ids": (6,)}  # helpers.policy_kwargs'
COMPACTOR = {"chunk_size": 8, "sink_size_start": 2, "sink_size_end": 1}  # N = 6: room beyond the protected
# policy -> (keywords, pooled, layer scan, positions every head keeps: the base's sinks)
CARRIERS = {
    "criticalkv:compactor": (COMPACTOR, False, True, 2),
    "criticaladakv:compactor": (COMPACTOR, True, True, 2),
    "criticalkv:kvzip": (KVZIP_IDS, False, True, 4),
    "adakv:kvzip": (KVZIP_IDS, True, True, 4),
    "chunkkv:kvzip": ({**KVZIP_IDS, "chunk_length": 2}, False, True, 4),
    "pyramidkv:compactor": ({**COMPACTOR, **PYR}, False, False, 2),
    "compactor+sinks4": (COMPACTOR, False, True, 4),
}


@pytest.mark.parametrize("name", list(CARRIERS))
def test_wrapped_feature_carriers_keep_the_budget(model, rows, name):
    """criticalkv / criticaladakv / adakv / chunkkv / pyramidkv / +sinks around compactor and kvzip (each
    carrying its own per-token feature) through vdjax.prefill and vdjax.run: after the 5-block prefill and
    after 4 decode steps every layer holds the budget (a pool K * N, at least the safeguard a head; a pyramid
    its layer's N_l), no duplicates, positions seen, and each head the base's sinks."""
    kw, pooled, scan, sinks = CARRIERS[name]
    cache, logits = vdjax.prefill(model, rows, name, budget=N, block_size=BLOCK, layer_scan=scan, **kw)
    gen = vdjax.run(model, rows, name, budget=N, block_size=BLOCK, max_new_tokens=NEW, layer_scan=scan, **kw)
    assert np.isfinite(np.asarray(logits)).all() and gen.tokens.shape == (len(LENGTHS), NEW)
    per_head = PYR_BUDGETS if name.startswith("pyramidkv") else (N,) * LAYERS
    assert gen.layer_budgets == per_head
    lengths = np.array(LENGTHS)
    for c, seen in ((cache, lengths), (gen.cache, lengths + NEW - 1)):
        _check_cache(c, seen, per_head, pooled, 1)
        for layer, n in zip(vdjax.kept_positions(c), per_head, strict=True):
            for r, heads in enumerate(layer):
                for h in heads:
                    assert set(range(min(sinks, n, seen[r]))) <= set(h.tolist()), (name, r, h)


def _carrier_candidates(seed, b_=2, k_=2, g_=2, n=14, s=6, d=8, hidden=12):
    """Candidates of a GQA layer (n shuffled cache slots, 3 empty, then a block of s at 40 .., row 1's ending
    2 early), a carried feature (positive, garbage in the empty slots) and the layer's W_o [Nq, D, H]."""
    rng = np.random.RandomState(seed)
    c = n + s
    k = rng.randn(b_, k_, c, d).astype(np.float32)
    v = rng.randn(b_, k_, c, d).astype(np.float32)
    pos = np.full((b_, k_, c), -1, np.int32)
    for b, h in np.ndindex(b_, k_):
        others = rng.choice(np.arange(4, 40), n - 7, replace=False)
        pos[b, h, :n] = rng.permutation(np.r_[0, 1, 2, 3, others, -1, -1, -1])
    q_pos = np.array([np.arange(40, 40 + s), np.r_[40:40 + s - 2, -1, -1]], np.int32)
    pos[:, :, n:] = q_pos[:, None]
    feature = (rng.rand(b_, k_, c) + 0.05).astype(np.float32)
    feature[pos < 0] = 1e3
    wo = rng.randn(k_ * g_, d, hidden).astype(np.float32)
    return k, v, pos, q_pos, feature, wo


@pytest.mark.parametrize("base,kw", [("compactor", {**COMPACTOR, "sketch_dimension": 3}),
                                     ("kvzip", {"n_sink": 2})])
def test_criticalkv_recomputes_the_value_norm_around_a_carrying_base(base, kw):
    """criticalkv around compactor or kvzip: the base's score (which reads the carried feature) through
    CriticalKV's two stages with ||W_o v||_1 of every candidate recomputed from v and the layer's W_o
    (`adaptive.wo_l1_norm`, the NumPy `ref_wo_l1`), not the carried feature; the cache carries the base's
    feature."""
    k, v, pos, q_pos, feature, wo = _carrier_candidates(3)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32)
    attn = vdjax.AttnInfo(None, jnp.asarray(q_pos), None, weights={"wo": jnp.asarray(wo)},
                          feature=jnp.asarray(feature), inv_freq=jnp.asarray(inv_freq))
    pol = vdjax.get_policy(f"criticalkv:{base}")
    assert pol.token_feature is vdjax.get_policy(base).token_feature
    n = 8
    args = (jnp.asarray(k), jnp.asarray(v), attn, jnp.asarray(pos))
    got = np.asarray(pol(*args, slots=n, **kw))
    scores = np.asarray(vdjax.get_policy(base)(*args, slots=n, **kw))
    valid = pos >= 0
    vnorm = np.asarray(adaptive.wo_l1_norm(jnp.asarray(v), jnp.asarray(wo)))
    np.testing.assert_allclose(vnorm[valid], ref_wo_l1(v, wo)[valid], rtol=1e-5)
    want = np.asarray(adaptive.critical_scores(jnp.asarray(scores), jnp.asarray(pos), n, jnp.asarray(vnorm),
                                               1e-4, 0.5))
    np.testing.assert_array_equal(got[valid], want[valid])
    ref = ref_critical_scores(scores, pos, n, ref_wo_l1(v, wo), 1e-4, 0.5)
    np.testing.assert_array_equal(np.isposinf(got[valid]), np.isposinf(ref[valid]))
    np.testing.assert_allclose(got[valid], ref[valid], rtol=1e-5)
    assert np.isfinite(got[valid]).sum() >= 10  # the second stage ranks most candidates
    carried = np.asarray(adaptive.critical_scores(jnp.asarray(scores), jnp.asarray(pos), n,
                                                  jnp.asarray(feature), 1e-4, 0.5))
    fin = valid & np.isfinite(got)
    assert not np.allclose(got[fin], carried[fin], rtol=1e-2)  # the feature as the norm scores otherwise


def test_criticaladakv_pool_recomputes_the_value_norm_around_compactor():
    """A one-layer model's prefill of one block (nothing cached before it) under criticaladakv:compactor: the
    pool keeps CriticalAdaKV's selection (`ref_criticaladakv_keep`) of the block from compactor's scores with
    ||W_o v||_1 of the block's values (`ref_wo_l1`) as the norm, not the carried tile attention."""
    from models import transformer as tf
    from vdjax.engine.scores import compactor_tiles

    cfg = tiny_config(num_layers=1, num_heads=HEADS, num_kv_heads=KV)
    params = random_params(cfg, seed=6)
    ids = random_ids(40, cfg.vocab_size, seed=6)
    n, kw = 6, {**COMPACTOR, "sketch_dimension": 3}
    cache, _ = vdjax.prefill(params, [ids], "criticaladakv:compactor", budget=n, block_size=64, **kw)
    lw = params.weights["layers"][0]
    x = tf.embed(params, jnp.asarray(ids)[None])
    h = tf.rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    q_pos = jnp.arange(40, dtype=jnp.int32)[None]
    inv_freq = jnp.asarray(tf.rope_inv_freq(cfg))
    _, k, v, _, q = tf.project_qkv(lw, h, q_pos, cfg, inv_freq, with_queries=True)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [1, K, T, D]
    feature = compactor_tiles(v, lw, k=k, q_pos=q_pos, rope=(q, inv_freq, cfg.rope_attention_factor, None),
                              hyper=COMPACTOR)
    pos = np.broadcast_to(np.arange(40, dtype=np.int32), (1, KV, 40))
    attn = vdjax.AttnInfo(None, q_pos, None, feature=feature, inv_freq=inv_freq,
                          rope_scale=cfg.rope_attention_factor)
    scores = np.asarray(vdjax.get_policy("compactor")(k, v, attn, jnp.asarray(pos), slots=n, **kw))
    v = np.asarray(v)
    want = ref_criticaladakv_keep(scores, pos, n, ref_wo_l1(v, np.asarray(lw["wo"])), 0.2, 1e-4, 0.5)[0]
    kept = [hd.tolist() for hd in vdjax.kept_positions(cache)[0][0]]
    assert kept == [np.flatnonzero(w).tolist() for w in want]
    assert sum(map(len, kept)) == KV * n and len({len(hd) for hd in kept}) > 1  # the heads' shares differ
    other = ref_criticaladakv_keep(scores, pos, n, np.asarray(feature), 0.2, 1e-4, 0.5)[0]
    assert not np.array_equal(other, want)  # the carried feature as the norm keeps another set


def test_combine_refuses_two_carried_features():
    """A cache carries one per-token feature: combine refuses parts carrying different ones, naming them;
    parts sharing CriticalKV's ||W_o v||_1 combine."""
    from vdjax.engine.policies import output_norm

    for parts, names in [({"compactor": .5, "criticalkv:valuediff": .5},
                          "'compactor', 'criticalkv:valuediff'"),
                         ({"kvzip": .5, "compactor": .5}, "'compactor', 'kvzip'")]:
        with pytest.raises(ValueError, match=rf"combine: the parts \[{names}\] carry different per-token "
                                             r"features; a cache carries one"):
            vdjax.combine(parts)
    mix = vdjax.combine({"criticalkv:valuediff": .5, "criticalkv:keydiff": .5})
    assert mix.token_feature is output_norm
    assert vdjax.combine({"kvzip": .5, "valuediff": .5}).replay


@pytest.mark.parametrize("policy", ["criticalkv:valuediff", "criticaladakv:valuediff"])
def test_critical_feature_carried_through_the_fill(policy):
    """A block prefill whose first blocks run as one causal pass (the fill: budget 20, blocks of 8, so 16
    tokens) carries ||W_o v||_1 of every cached token in every layer, fill tokens included, as the blocks
    after it do: the carried feature equals `adaptive.wo_l1_norm` of the cached values (per head, or the
    pool's)."""
    from vdjax.engine.evict import cache_rule, fill_tokens

    cfg = tiny_config()
    params = random_params(cfg, seed=8)
    ids = [random_ids(n, cfg.vocab_size, seed=n) for n in (37, 30)]
    bound = P.bind(policy, params, 20)
    assert fill_tokens(cfg, bound, cache_rule(bound).head_budgets(cfg, 20), 8, 40) == 16
    cache, _ = vdjax.prefill(params, ids, policy, 20, block_size=8, layer_scan=False)
    for i, lc in enumerate(cache.layers):
        view = lc.view()
        wo = params.weights["layers"][i]["wo"]
        want = np.asarray(adaptive.wo_l1_norm(view.v, wo))  # [B, K, N]
        feat, valid = np.asarray(view.feat), np.asarray(view.pos) >= 0
        assert (np.asarray(view.pos)[valid] < 16).any()  # fill tokens are still cached
        np.testing.assert_allclose(feat[valid], want[valid], rtol=1e-5, atol=1e-6)

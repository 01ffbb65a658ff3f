"""The query-agnostic scorers that read more than k, v and the block's attention (expected_attention, cur,
random, lagkv, leverage, qfilter, compactor, kvzip) against plain NumPy references written from kvpress
0.5.5's presses (ExpectedAttentionPress, CURPress, RandomPress, LagKVPress, LeverageScorePress, QFilterPress,
CompactorPress with its NonCausalAttnPress tiles, KVzipPress's replay attention) and vdjax's docstrings of
their block mode, not from vdjax's code; the ChunkKV wrapper's chunk scores likewise; `scores.unrotate`
against the models' RoPE and `scores.rotate`; KVzip's replay stream and prompt ids (`engine.replay`); a tiny
model's compactor and kvzip prefills against NumPy ones at layer 0; `cache.QueryStats` (the
running query statistics expected_attention reads) against a NumPy mean and covariance, in a unit test and as
a tiny model's cache carries them over a ragged multi-block prefill.

tests/test_policies.py's `test_score_matches_numpy` covers every other registered policy and checks that
each registered policy has a reference in one of the two files (`REFERENCED` here)."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vdjax
from vdjax.engine import policies as P
from vdjax.engine.cache import QueryStats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import random_ids, random_params, tiny_config  # noqa: E402

# the registered policies whose references live here (test_policies.py checks every policy has one)
REFERENCED = ("expected_attention", "cur", "random", "lagkv", "leverage", "qfilter", "compactor",
              "kvzip")

B, K, G, S, N, D = 2, 3, 2, 5, 11, 8
C, NQ = N + S, K * G
PAST = 40  # queries at positions 0 .. PAST - 1 came in earlier blocks (their statistics carried)


def _inputs(seed=0, empty=3):
    """Candidates [B, K, C] (N cache slots, some empty, then the block's S tokens; row 1's block ends early),
    the block's pre-RoPE queries [B, S, Nq, D] and the earlier ones [B, PAST, Nq, D]."""
    rng = np.random.RandomState(seed)
    k = rng.randn(B, K, C, D).astype(np.float32)
    v = rng.randn(B, K, C, D).astype(np.float32)
    pos = np.empty((B, K, C), np.int32)
    for b in range(B):
        for h in range(K):
            pos[b, h, :N] = rng.permutation(PAST)[:N]
            pos[b, h, rng.choice(N, empty, replace=False)] = -1
    q_pos = np.array([[40, 41, 42, 43, 44], [40, 41, 42, -1, -1]], np.int32)
    pos[:, :, N:] = q_pos[:, None, :]
    # a mean away from 0, so the mean term matters next to the covariance's
    queries = (0.7 * rng.randn(B, S, NQ, D) + rng.randn(1, 1, NQ, D)).astype(np.float32)
    past = (0.7 * rng.randn(B, PAST, NQ, D) + rng.randn(1, 1, NQ, D)).astype(np.float32)
    return k, v, pos, q_pos, queries, past


# ---- QueryStats -------------------------------------------------------------------------------------------
def ref_stats(q, use):
    """NumPy count, mean and covariance (divided by the count) over the used queries: q [B, S, Nq, D]."""
    n, mean, cov = [], [], []
    for b in range(q.shape[0]):
        x = q[b][use[b]].astype(np.float64)  # [n, Nq, D]
        n.append(len(x))
        mu = x.mean(0) if len(x) else np.zeros(q.shape[2:])
        c = x - mu
        mean.append(mu)
        cov.append(np.einsum("sni,snj->nij", c, c) / max(len(x), 1))
    return np.array(n), np.array(mean), np.array(cov)


def _assert_stats(st, q, use, rtol=2e-5, atol=2e-6):
    n, mean, cov = ref_stats(q, use)
    np.testing.assert_array_equal(np.asarray(st.n), n)
    np.testing.assert_allclose(np.asarray(st.mean), mean, rtol=rtol, atol=atol)
    np.testing.assert_allclose(np.asarray(st.cov), cov, rtol=rtol, atol=atol)
    np.testing.assert_allclose(np.asarray(st.m2), cov * np.maximum(n, 1)[:, None, None, None], rtol=rtol,
                               atol=atol * max(1, n.max()))


def test_query_stats_of_is_the_numpy_mean_and_covariance():
    rng = np.random.RandomState(0)
    q = (rng.randn(3, 9, 2, 4) + 2.0).astype(np.float32)
    use = rng.rand(3, 9) < 0.6
    use[2] = False  # a row with no query: n 0, mean and covariance 0 (no NaN)
    st = QueryStats.of(jnp.asarray(q), jnp.asarray(use))
    _assert_stats(st, q, use)
    assert np.all(np.asarray(st.mean)[2] == 0) and np.all(np.asarray(st.m2)[2] == 0)


@pytest.mark.parametrize("split", [1, 4, 8])
def test_query_stats_merge_of_two_halves_is_the_stats_of_the_whole(split):
    """Chan's pairwise merge of the first `split` queries' statistics with the rest's equals the statistics of
    all of them (and of the NumPy reference); merging an empty side changes nothing."""
    rng = np.random.RandomState(split)
    q = (rng.randn(3, 9, 2, 4) * 1.5 + 3.0).astype(np.float32)
    use = rng.rand(3, 9) < 0.7
    use[1, :split] = False  # row 1: its first part holds no query
    use[2] = False  # row 2: nothing at all
    first = QueryStats.of(jnp.asarray(q[:, :split]), jnp.asarray(use[:, :split]))
    rest = QueryStats.of(jnp.asarray(q[:, split:]), jnp.asarray(use[:, split:]))
    whole = QueryStats.of(jnp.asarray(q), jnp.asarray(use))
    merged = first.merge(rest)
    _assert_stats(merged, q, use)
    for a, b in ((merged.n, whole.n), (merged.mean, whole.mean), (merged.m2, whole.m2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    empty = QueryStats.empty(3, 2, 4)
    for st in (empty.merge(whole), whole.merge(empty)):
        for a, b in ((st.n, whole.n), (st.mean, whole.mean), (st.m2, whole.m2)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_query_stats_merge_block_by_block():
    """Blocks merged one after another (the engine's running statistics) give the stats of them all."""
    rng = np.random.RandomState(5)
    q = (rng.randn(2, 24, 3, 4) + 1.0).astype(np.float32)
    use = rng.rand(2, 24) < 0.8
    st = QueryStats.empty(2, 3, 4)
    for lo in range(0, 24, 5):
        st = st.merge(QueryStats.of(jnp.asarray(q[:, lo:lo + 5]), jnp.asarray(use[:, lo:lo + 5])))
    _assert_stats(st, q, use)


def test_engine_carries_the_query_stats_of_every_prompt_query(tmp_path):
    """After a ragged multi-block prefill under expected_attention, each row's layer-0 statistics in the cache
    are the NumPy mean and covariance of its layer-0 pre-RoPE queries at positions n_sink .. length - 1
    (padding and the sinks left out)."""
    from models import transformer as tf

    cfg = tiny_config()
    params = random_params(cfg, seed=1)
    lengths = (13, 9)
    ids = [random_ids(n, cfg.vocab_size, seed=n) for n in lengths]
    n_sink = 3
    cache, _ = vdjax.prefill(params, ids, "expected_attention", 4, block_size=4, n_sink=n_sink,
                             layer_scan=False)
    st = cache.layers[0].stats
    lw = params.weights["layers"][0]
    t = max(lengths)
    tokens = np.stack([np.pad(r, (0, t - len(r))) for r in ids])
    h = tf.rms_norm(tf.embed(params, jnp.asarray(tokens)), lw["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    positions = jnp.broadcast_to(jnp.arange(t)[None], (len(ids), t))
    q = np.asarray(tf.project_qkv(lw, h, positions, cfg, jnp.asarray(tf.rope_inv_freq(cfg)),
                                  with_queries=True)[-1])  # [B, T, Nq, D] before RoPE
    use = (np.arange(t)[None] >= n_sink) & (np.arange(t)[None] < np.array(lengths)[:, None])
    _assert_stats(st, q, use, rtol=1e-4, atol=1e-5)


# ---- expected_attention ------------------------------------------------------------------------------------
def ref_avg_rope(inv_freq, d, first, count, scale):
    """kvpress's `apply_avg_rope` matrix R [d, d]: the mean over positions first .. first + count - 1 of
    cos * I + sin * P (HF's rotate_half layout, cos and sin times the RoPE scale); identity on the dims past
    the rotated ones."""
    r = 2 * len(inv_freq)
    half = np.eye(r // 2)
    p_mat = np.zeros((r, r))
    p_mat[r // 2:, :r // 2], p_mat[:r // 2, r // 2:] = half, -half
    rot = np.zeros((r, r))
    for p in range(first, first + count):
        ang = p * inv_freq.astype(np.float64)
        cos, sin = np.tile(np.cos(ang), 2) * scale, np.tile(np.sin(ang), 2) * scale
        rot += cos[None, :] * np.eye(r) + sin[None, :] * p_mat
    out = np.eye(d)
    out[:r, :r] = rot / count
    return out


def ref_expected_attention(k, v, pos, q_pos, queries, past, inv_freq, scale, *, n_future_positions=512,
                           n_sink=4, use_covariance=True, use_vnorm=True, epsilon=0.0, stats="all"):
    """kvpress's ExpectedAttentionPress.score, row by row and KV head by KV head: mean and covariance of the
    pre-RoPE queries at positions >= n_sink ("all": the earlier ones at 0 .. PAST - 1 and the block's;
    "block": the block's), rotated by the average RoPE of the next positions, the softmax over the non-sink
    candidates of k.mu/sqrt(d) + k^T cov k/(2d), mean over the GQA group, (+ epsilon) times ||v||."""
    out = np.zeros(pos.shape)
    d = k.shape[-1]
    for b in range(pos.shape[0]):
        block = queries[b][q_pos[b] >= n_sink]
        if stats == "all" or len(q_pos[b]) == 1:
            block = np.concatenate([past[b][np.arange(past.shape[1]) >= n_sink], block])
        x = block.astype(np.float64)  # [n, Nq, D]
        mu = x.mean(0)
        cov = np.einsum("sni,snj->nij", x - mu, x - mu) / len(x)
        rot = ref_avg_rope(inv_freq, d, q_pos[b].max() + 1, n_future_positions, scale)
        mu, cov = mu @ rot.T, rot @ cov @ rot.T
        for h in range(k.shape[1]):
            kk = k[b, h].astype(np.float64)
            scored = pos[b, h] >= n_sink
            probs = []
            for g in range(G):
                qh = h * G + g  # repeat_kv: query head qh reads KV head qh // G
                logit = kk @ mu[qh] / np.sqrt(d)
                if use_covariance:
                    logit = logit + np.einsum("ci,ij,cj->c", kk, cov[qh], kk) / d / 2
                e = np.where(scored, np.exp(logit - logit[scored].max()), 0.0)
                probs.append(e / e.sum())
            s = np.mean(probs, axis=0)
            if use_vnorm:
                s = (s + epsilon) * np.linalg.norm(v[b, h].astype(np.float64), axis=-1)
            out[b, h] = np.where(pos[b, h] < n_sink, np.inf, s)
    return out


def _attn(q_pos, queries, past, inv_freq, scale, n_sink, layer=0):
    """The AttnInfo the engine gives a queries-reading policy: the block's queries, the running statistics
    (the earlier blocks' merged with this one's, positions < n_sink left out), the RoPE frequencies."""
    past_pos = np.broadcast_to(np.arange(past.shape[1]), past.shape[:2])
    stats = QueryStats.of(jnp.asarray(past), jnp.asarray(past_pos >= n_sink)).merge(
        QueryStats.of(jnp.asarray(queries), jnp.asarray(q_pos >= n_sink)))
    return P.AttnInfo(None, jnp.asarray(q_pos), None, layer=layer, queries=jnp.asarray(queries), stats=stats,
                      inv_freq=jnp.asarray(inv_freq), rope_scale=scale)


ROPE = {"full": (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32),
        "partial": (1.0 / 500 ** (np.arange(0, D // 2, 2) / (D // 2))).astype(np.float32)}  # first D / 2 dims


@pytest.mark.parametrize("stats", ["all", "block"])
@pytest.mark.parametrize("use_covariance", [True, False])
def test_expected_attention_matches_numpy(stats, use_covariance):
    k, v, pos, q_pos, queries, past = _inputs()
    inv_freq = ROPE["full"]
    attn = _attn(q_pos, queries, past, inv_freq, 1.0, 4)
    kw = dict(stats=stats, use_covariance=use_covariance)
    got = np.asarray(vdjax.get_policy("expected_attention")(k, v, attn, jnp.asarray(pos), slots=N, **kw))
    ref = ref_expected_attention(k, v, pos, q_pos, queries, past, inv_freq, 1.0, **kw)
    valid = pos >= 0
    np.testing.assert_array_equal(np.isposinf(got[valid]), np.isposinf(ref[valid]))
    assert np.isposinf(ref[valid]).any() and np.isfinite(ref[valid]).sum() > 20  # sinks and scored ones
    np.testing.assert_allclose(got[valid], ref[valid], rtol=2e-4, atol=1e-7)
    # the two modes and the covariance term really change the scores
    other = dict(stats="block" if stats == "all" else "all", use_covariance=not use_covariance)
    for key, value in other.items():
        alt = ref_expected_attention(k, v, pos, q_pos, queries, past, inv_freq, 1.0, **{**kw, key: value})
        fin = valid & np.isfinite(ref)
        assert not np.allclose(alt[fin], ref[fin], rtol=1e-2), key


@pytest.mark.parametrize("case", [dict(use_vnorm=False), dict(epsilon=0.05, n_sink=2, n_future_positions=7),
                                  dict(rope="partial", scale=1.3, n_future_positions=33),
                                  dict(stats="block", n_sink=0)])
def test_expected_attention_options_match_numpy(case):
    """use_vnorm off, epsilon, another n_sink and horizon, partial RoPE with a RoPE scale (Qwen3.5, YaRN)."""
    case = dict(case)
    inv_freq, scale = ROPE[case.pop("rope", "full")], case.pop("scale", 1.0)
    k, v, pos, q_pos, queries, past = _inputs(seed=3)
    attn = _attn(q_pos, queries, past, inv_freq, scale, case.get("n_sink", 4))
    got = np.asarray(vdjax.get_policy("expected_attention")(k, v, attn, jnp.asarray(pos), slots=N, **case))
    ref = ref_expected_attention(k, v, pos, q_pos, queries, past, inv_freq, scale, **case)
    valid = pos >= 0
    np.testing.assert_allclose(got[valid], ref[valid], rtol=2e-4, atol=1e-7)


def test_expected_attention_decode_step_reads_the_running_stats():
    """A decode step (one query): "block" reads the running statistics, as "all" does."""
    k, v, pos, q_pos, queries, past = _inputs(seed=4)
    q1, pos1 = q_pos[:, :1], np.concatenate([pos[..., :N], pos[..., N:N + 1]], axis=-1)
    k1, v1 = (np.concatenate([x[..., :N, :], x[..., N:N + 1, :]], axis=-2) for x in (k, v))
    attn = _attn(q1, queries[:, :1], past, ROPE["full"], 1.0, 4)
    pol = vdjax.get_policy("expected_attention")
    ref = ref_expected_attention(k1, v1, pos1, q1, queries[:, :1], past, ROPE["full"], 1.0, stats="all")
    valid = pos1 >= 0
    for mode in ("all", "block"):
        got = np.asarray(pol(k1, v1, attn, jnp.asarray(pos1), slots=N, stats=mode))
        np.testing.assert_allclose(got[valid], ref[valid], rtol=2e-4, atol=1e-7)
    with pytest.raises(ValueError, match="stats must be 'all' or 'block', got 'some'"):
        pol(k1, v1, attn, jnp.asarray(pos1), slots=N, stats="some")


# ---- cur ------------------------------------------------------------------------------------------------
def ref_cur(k, v, pos, *, num_sinks=4, leverage_type="kv_product", local_window_size=16):
    """kvpress's CURPress.score with use_local_approximation, on the candidates laid out by position (a
    position no candidate holds contributes 0): squared norms padded to a multiple of the window, each
    divided by its window's sum, combined, divided by the total; the sinks kept (+inf for kvpress's 1.0)."""
    out = np.zeros(pos.shape)
    w = local_window_size
    for idx in np.ndindex(pos.shape[:-1]):
        p, val = pos[idx], pos[idx] >= 0
        t = -(-(p.max() + 1) // w) * w
        k2, v2 = np.zeros(t), np.zeros(t)
        k2[p[val]] = (k[idx][val].astype(np.float64) ** 2).sum(-1)
        v2[p[val]] = (v[idx][val].astype(np.float64) ** 2).sum(-1)
        with np.errstate(invalid="ignore"):  # a window without any candidate: 0 / 0, never read
            k2 = (k2.reshape(-1, w) / k2.reshape(-1, w).sum(-1, keepdims=True)).reshape(-1)
            v2 = (v2.reshape(-1, w) / v2.reshape(-1, w).sum(-1, keepdims=True)).reshape(-1)
        s = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[leverage_type]
        s = np.nan_to_num(s) / np.nansum(s)
        s[:num_sinks] = np.inf
        out[idx] = np.where(val, s[np.maximum(p, 0)], 0.0)
    return out


def _cur_inputs(seed):
    """Candidates spread over 3 to 4 windows of 8 positions, some empty, so windows hold 1 to 8 of them."""
    k, v, pos, *_ = _inputs(seed)
    rng = np.random.RandomState(seed + 10)
    for b in range(B):
        for h in range(K):
            pos[b, h] = rng.permutation(30)[:C]
    pos[rng.rand(*pos.shape) < 0.2] = -1
    return k, v, pos


@pytest.mark.parametrize("leverage_type", ["kv_product", "kv_avg", "key", "value"])
def test_cur_matches_numpy(leverage_type):
    k, v, pos = _cur_inputs(0)
    kw = dict(leverage_type=leverage_type, local_window_size=8, num_sinks=3)
    got = np.asarray(vdjax.get_policy("cur")(k, v, None, jnp.asarray(pos), slots=N, **kw))
    ref = ref_cur(k, v, pos, **kw)
    valid = pos >= 0
    np.testing.assert_array_equal(np.isposinf(got[valid]), np.isposinf(ref[valid]))
    np.testing.assert_allclose(got[valid], ref[valid], rtol=2e-5, atol=1e-7)
    assert np.isposinf(ref[valid]).any()
    fin = valid & np.isfinite(ref)
    if leverage_type == "kv_product":  # defaults: windows of 16, 4 sinks
        got = np.asarray(vdjax.get_policy("cur")(k, v, None, jnp.asarray(pos), slots=N))
        np.testing.assert_allclose(got[valid], ref_cur(k, v, pos)[valid], rtol=2e-5, atol=1e-7)
        alt = ref_cur(k, v, pos, leverage_type="kv_avg", local_window_size=8, num_sinks=3)
        assert not np.allclose(alt[fin], ref[fin])
    with pytest.raises(ValueError, match="leverage_type must be one of"):
        vdjax.get_policy("cur")(k, v, None, jnp.asarray(pos), slots=N, leverage_type="both")


def test_cur_random_leverage_projects_on_the_layer_sketch():
    """use_random_leverage: the same shares of k G and v G, G [D, 20] the layer's Gaussian sketch / sqrt(20)
    drawn from (seed, layer); another layer or seed draws another sketch."""
    k, v, pos = _cur_inputs(1)
    pol = vdjax.get_policy("cur")
    attn = P.AttnInfo(None, None, None, layer=3)
    got = np.asarray(pol(k, v, attn, jnp.asarray(pos), slots=N, use_random_leverage=True, seed=7))
    key = jax.random.fold_in(jax.random.PRNGKey(7), 3)
    sketch = np.asarray(jax.random.normal(key, (D, 20))) / np.sqrt(20)
    ref = ref_cur(k @ sketch, v @ sketch, pos)
    valid = pos >= 0
    np.testing.assert_allclose(got[valid], ref[valid], rtol=1e-4, atol=1e-7)
    fin = valid & np.isfinite(ref)
    for other in (P.AttnInfo(None, None, None, layer=4), attn):
        seed = 7 if other is not attn else 8
        alt = np.asarray(pol(k, v, other, jnp.asarray(pos), slots=N, use_random_leverage=True, seed=seed))
        assert not np.allclose(alt[fin], got[fin])


# ---- random ---------------------------------------------------------------------------------------------
def _random(q_pos, layer, seed=0, c=C):
    """random's scores of c candidates per KV head for rows whose block's query positions are q_pos."""
    pos = np.broadcast_to(np.arange(c, dtype=np.int32), (q_pos.shape[0], K, c))
    attn = P.AttnInfo(None, jnp.asarray(q_pos), None, layer=layer)
    return np.asarray(vdjax.get_policy("random")(None, None, attn, jnp.asarray(pos), slots=N, seed=seed))


def test_random_scores_are_uniform_and_reproducible():
    q_pos = np.array([[40, 41, 42, 43, 44], [40, 41, 42, -1, -1], [60, 61, 62, 63, 64]], np.int32)
    s = _random(q_pos, 0)
    assert s.shape == (3, K, C) and s.dtype == np.float32
    assert np.all((s >= 0) & (s < 1))
    big = _random(q_pos, 0, c=4096)
    assert abs(big.mean() - 0.5) < 0.01 and abs(big.var() - 1 / 12) < 0.005  # uniform's moments
    assert len(np.unique(big)) > 0.99 * big.size
    np.testing.assert_array_equal(_random(q_pos, 0), s)  # the same (seed, layer, last position): same draw
    # a row alone equals the row inside the batch
    for r in range(3):
        np.testing.assert_array_equal(_random(q_pos[[r]], 0)[0], s[r])
    # layer, step (last position) and seed each change the draw
    assert not np.allclose(_random(q_pos, 1), s)
    assert not np.allclose(_random(q_pos + 1, 0), s)
    assert not np.allclose(_random(q_pos, 0, seed=1), s)
    assert not np.allclose(s[0], s[1]) and not np.allclose(s[0], s[2])  # rows at other positions
    # the draw depends on the row's last position only: row 1 (last 42) padded or as a 3-token block
    np.testing.assert_array_equal(_random(np.array([[40, 41, 42]], np.int32), 0)[0], s[1])
    # and on the layer as the engine's layer scan gives it (a traced int32)
    traced = jax.jit(lambda layer: vdjax.get_policy("random")(
        None, None, P.AttnInfo(None, jnp.asarray(q_pos), None, layer=layer),
        jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (3, K, C)), slots=N))(jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(traced), _random(q_pos, 1))


# ---- lagkv ----------------------------------------------------------------------------------------------
def ref_lagkv(k, v, pos, q_pos, *, n_sink=4, lag_size=128, cross_scoring=False):
    """LagKV in block mode, from its docstring (kvpress's LagKVPress on the candidates still cached): `seen` =
    the row's last query position + 1; below n_sink + 2 * lag_size seen, sinks 1 and the rest (pos - n_sink)
    / (seen - n_sink); else positions after the sinks fall in partitions of lag_size, and each complete one
    whose successor is complete too is scored against the successor's cached members: per channel normalised
    by their min and max, the std over channels (unbiased), softmax over the partition's cached members, keys
    and values averaged, then (cross_scoring False) the rank inside the partition / lag_size (ties: the
    earlier position lower); sinks, the newest complete partition and the incomplete rest 1. A partition
    whose successor has no cached member left scores 0 (vdjax's rule, nothing to compare against)."""
    out = np.zeros(pos.shape)
    for b in range(pos.shape[0]):
        seen = q_pos[b].max() + 1
        for h in range(pos.shape[1]):
            p = pos[b, h]
            kk, vv = k[b, h].astype(np.float64), v[b, h].astype(np.float64)
            if seen < n_sink + 2 * lag_size:
                out[b, h] = np.where(p < n_sink, 1.0, (p - n_sink) / max(seen - n_sink, 1))
                continue
            s = np.ones(len(p))
            part = np.where(p >= n_sink, (p - n_sink) // lag_size, -1)
            for q in range((seen - n_sink) // lag_size - 1):  # complete partitions with a complete successor
                members = [j for j in np.flatnonzero((p >= 0) & (part == q))]
                ref = np.flatnonzero((p >= 0) & (part == q + 1))
                if not members:
                    continue
                if not len(ref):
                    s[members] = 0.0
                    continue

                def share(x, members=members, ref=ref):
                    lo, hi = x[ref].min(0), x[ref].max(0)
                    std = ((x[members] - lo) / (hi - lo)).std(axis=1, ddof=1)
                    e = np.exp(std - std.max())
                    return e / e.sum()

                sc = (share(kk) + share(vv)) / 2
                if not cross_scoring:
                    order = sorted(range(len(members)), key=lambda i, sc=sc, members=members: (sc[i],
                                                                                             p[members[i]]))
                    sc = np.empty(len(members))
                    sc[order] = np.arange(len(members)) / lag_size
                s[members] = sc
            out[b, h] = s
    return out


def _lag_inputs(seed, n_sink=3, lag=5, seen=(31, 27), drop=0.3):
    """Two rows whose blocks end at seen - 1 (row 1 earlier): each head's cached positions are 0 .. seen - 1
    with some evicted (every partition keeps at least 2, or loses all in head 2 of row 0), in random slot
    order, the other slots empty."""
    rng = np.random.RandomState(seed)
    c = max(seen) + 2
    k = rng.randn(B, K, c, D).astype(np.float32)
    v = rng.randn(B, K, c, D).astype(np.float32)
    pos = np.full((B, K, c), -1, np.int32)
    for b in range(B):
        for h in range(K):
            kept = list(range(n_sink))
            for lo in range(n_sink, seen[b], lag):
                members = list(range(lo, min(lo + lag, seen[b])))
                if b == 0 and h == 2 and lo == n_sink + 2 * lag:
                    continue  # partition 2 evicted whole: partition 1 has nothing to compare against
                keep = [m for m in members if rng.rand() > drop]
                kept += keep if len(keep) >= 2 else members[:2]
            kept = [x for x in kept if x >= n_sink or rng.rand() > drop]  # a sink evicted here and there
            pos[b, h, rng.permutation(c)[:len(kept)]] = kept
    q_pos = np.full((B, S), -1, np.int32)
    for b in range(B):
        q_pos[b, :3] = np.arange(seen[b] - 3, seen[b])
    return k, v, pos, q_pos


@pytest.mark.parametrize("cross_scoring", [False, True])
def test_lagkv_matches_numpy(cross_scoring):
    """Partitions of absolute positions with evicted holes (one successor evicted whole), rows at different
    lengths (row 0: 5 complete partitions, 4 scored against their successor; row 1: 4 and 3)."""
    k, v, pos, q_pos = _lag_inputs(0)
    kw = dict(n_sink=3, lag_size=5, cross_scoring=cross_scoring)
    attn = P.AttnInfo(None, jnp.asarray(q_pos), None)
    got = np.asarray(vdjax.get_policy("lagkv")(k, v, attn, jnp.asarray(pos), slots=N, **kw))
    ref = ref_lagkv(k, v, pos, q_pos, **kw)
    valid = pos >= 0
    np.testing.assert_allclose(got[valid], ref[valid], rtol=2e-5, atol=1e-7)
    scored = valid & (ref < 1)
    assert scored.sum() > 60
    orphaned = (pos[0, 2] >= 8) & (pos[0, 2] < 13)  # row 0, head 2: partition 1, its successor evicted whole
    assert orphaned.sum() >= 2 and np.all(got[0, 2][orphaned] == 0)
    if not cross_scoring:  # ranks are exact multiples of 1 / lag_size
        np.testing.assert_array_equal(got[valid] * 5, np.round(ref[valid] * 5))
    else:
        alt = ref_lagkv(k, v, pos, q_pos, n_sink=3, lag_size=5)
        assert not np.allclose(alt[scored], ref[scored])


def test_lagkv_short_prompt_keeps_the_most_recent():
    """Below n_sink + 2 * lag_size seen tokens: sinks 1, then (pos - n_sink) / (seen - n_sink), and the
    defaults (4 sinks, lag 128) see every prompt of _inputs as short."""
    k, v, pos, q_pos = _lag_inputs(1, seen=(12, 12))
    attn = P.AttnInfo(None, jnp.asarray(q_pos), None)
    got = np.asarray(vdjax.get_policy("lagkv")(k, v, attn, jnp.asarray(pos), slots=N, n_sink=3, lag_size=5))
    valid = pos >= 0
    ref = ref_lagkv(k, v, pos, q_pos, n_sink=3, lag_size=5)
    np.testing.assert_allclose(got[valid], ref[valid], rtol=1e-6)
    np.testing.assert_allclose(got[valid & (pos >= 3)], ((pos - 3) / 9)[valid & (pos >= 3)], rtol=1e-6)
    k, v, pos, q_pos, *_ = _inputs(2)
    attn = P.AttnInfo(None, jnp.asarray(q_pos), None)
    got = np.asarray(vdjax.get_policy("lagkv")(k, v, attn, jnp.asarray(pos), slots=N))
    np.testing.assert_allclose(got[pos >= 0], ref_lagkv(k, v, pos, q_pos)[pos >= 0], rtol=1e-6)


# ---- leverage -------------------------------------------------------------------------------------------
def ref_rope(x, pos, inv_freq, scale=1.0):
    """x [..., D] rotated at positions pos [...] (HF rotate_half over the first 2 len(inv_freq) dims, cos and
    sin times `scale`), fp64."""
    r = 2 * len(inv_freq)
    ang = pos[..., None].astype(np.float64) * inv_freq.astype(np.float64)
    cos, sin = np.tile(np.cos(ang), 2) * scale, np.tile(np.sin(ang), 2) * scale
    xr = x[..., :r].astype(np.float64)
    half = np.concatenate([-xr[..., r // 2:], xr[..., :r // 2]], axis=-1)
    return np.concatenate([xr * cos + half * sin, x[..., r:]], axis=-1)


def ref_leverage(x, pos, layer, *, sketch_dimension=48, ridge=1e-2, seed=0):
    """kvpress's LeverageScorePress.score on pre-RoPE keys x [B, K, C, D], head by head over the valid
    candidates: centred, times the sketch (vdjax's draw for (seed, layer): normal [K, D, m] / sqrt(m)),
    x_i (X^T X + ridge I)^-1 x_i^T clamped at 0, z-scored over the row (unbiased std floored at 1e-6)."""
    m = sketch_dimension
    key = jax.random.fold_in(jax.random.PRNGKey(seed), layer)
    phi = np.asarray(jax.random.normal(key, (x.shape[1], x.shape[-1], m)), np.float64) / np.sqrt(m)
    out = np.zeros(pos.shape)
    for b in range(pos.shape[0]):
        lev = np.zeros(pos.shape[1:])
        for h in range(pos.shape[1]):
            val = pos[b, h] >= 0
            xc = x[b, h][val].astype(np.float64)
            proj = (xc - xc.mean(0)) @ phi[h]
            gram = proj.T @ proj + ridge * np.eye(m)
            lev[h][val] = np.maximum(np.einsum("cm,cm->c", proj, np.linalg.solve(gram, proj.T).T), 0)
        val = pos[b] >= 0
        out[b] = (lev - lev[val].mean()) / max(lev[val].std(ddof=1), 1e-6)
    return out




@pytest.mark.parametrize("rope, scale", [("full", 1.0), ("full", 1.3), ("partial", 1.0),
                                         ("partial", 1.3)])
def test_unrotate_inverts_the_models_rope(rope, scale):
    """scores.unrotate(models.transformer.apply_rope(x)) == x, full and partial RoPE, with a scale or not; and
    the NumPy rotation the references use is apply_rope's."""
    from models import transformer as tf
    from vdjax.engine.scores import rope_table, unrotate

    rng = np.random.RandomState(0)
    x = rng.randn(B, C, K, D).astype(np.float32)  # [B, S, heads, D] as apply_rope takes it
    p = np.stack([rng.permutation(600)[:C] for _ in range(B)]).astype(np.int32)
    inv_freq = ROPE[rope]
    rot = np.asarray(tf.apply_rope(jnp.asarray(x), jnp.asarray(p), jnp.asarray(inv_freq), scale))
    np.testing.assert_allclose(rot, ref_rope(x, p[..., None], inv_freq, scale), rtol=1e-4, atol=1e-4)
    attn = P.AttnInfo(None, None, None, inv_freq=jnp.asarray(inv_freq), rope_scale=scale)
    pos = np.broadcast_to(p[:, None], (B, K, C))
    back = np.asarray(unrotate(jnp.asarray(rot.transpose(0, 2, 1, 3)), jnp.asarray(pos), attn))
    np.testing.assert_allclose(back, x.transpose(0, 2, 1, 3), rtol=1e-4, atol=1e-4)
    assert not np.allclose(rot, x, atol=1e-2)
    # a prefill's table of every position's cos and sin gives the same values, jitted as the engine runs it
    table = rope_table(jnp.asarray(inv_freq), 600)
    assert table.shape == (2, 600, len(inv_freq))
    with_table = attn.replace(rope_table=table)
    k_rot, k_pos = jnp.asarray(rot.transpose(0, 2, 1, 3)), jnp.asarray(pos)
    fast = jax.jit(lambda k, p: unrotate(k, p, with_table))(k_rot, k_pos)
    slow = jax.jit(lambda k, p: unrotate(k, p, attn))(k_rot, k_pos)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(slow))


@pytest.mark.parametrize("name, scan", [("leverage", False), ("leverage", True), ("compactor", False)])
def test_rope_tables_change_nothing(name, scan):
    """The RoPE tables the programs build for `unrotate` (prefill, decode and the question block) give the
    same tokens and the same kept positions as computing cos and sin per call (the policy without the
    flag)."""
    cfg = tiny_config()
    params = random_params(cfg, seed=3)
    ids = [random_ids(n, cfg.vocab_size, seed=n) for n in (45, 38)]
    policy = P.get_policy(name)
    assert policy.rope_table
    plain = dataclasses.replace(policy, name=f"{name}-no-table", rope_table=False)
    hyper = dict(chunk_size=16) if name == "compactor" else {}
    runs = [vdjax.run(params, ids, pol, 20, block_size=8, max_new_tokens=6, min_new_tokens=6,
                      question=[3, 4, 5], layer_scan=scan, **hyper) for pol in (policy, plain)]
    np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
    for layer in range(cfg.num_layers):
        got, want = (r.cache.layers[layer].head_positions() for r in runs)
        assert [[h.tolist() for h in row] for row in got] == [[h.tolist() for h in row] for row in want]
    assert runs[0].tokens.shape[1] == 6


@pytest.mark.parametrize("case", [{}, dict(sketch_dimension=5, ridge=0.1, seed=3, layer=2),
                                  dict(rope="partial", sketch_dimension=6),
                                  dict(scale=1.3, sketch_dimension=6),
                                  dict(rope="partial", scale=1.3, sketch_dimension=6)])
def test_leverage_matches_numpy(case):
    """The cached keys (post-RoPE at their positions) unrotated, as kvpress reads the pre-RoPE keys."""
    case = dict(case)
    inv_freq, scale, layer = ROPE[case.pop("rope", "full")], case.pop("scale", 1.0), case.pop("layer", 0)
    _, _, pos, *_ = _inputs(5)
    rng = np.random.RandomState(5)
    x = (rng.randn(B, K, C, D) + rng.randn(1, K, 1, D)).astype(np.float32)  # pre-RoPE keys, off-centre
    k = ref_rope(x, pos, inv_freq, scale).astype(np.float32)
    attn = P.AttnInfo(None, None, None, layer=layer, inv_freq=jnp.asarray(inv_freq), rope_scale=scale)
    got = np.asarray(vdjax.get_policy("leverage")(k, None, attn, jnp.asarray(pos), slots=N, **case))
    ref = ref_leverage(x, pos, layer, **case)
    valid = pos >= 0
    np.testing.assert_allclose(got[valid], ref[valid], rtol=1e-3, atol=1e-3)
    assert np.ptp(ref[valid]) > 1  # z-scores spread
    # the post-RoPE keys as they are score otherwise; so does another layer's sketch of fewer than D columns
    # (one of D or more spans the keys' space: nearly the exact leverage whatever its draw)
    alts = [ref_leverage(k, pos, layer, **case)]
    if case.get("sketch_dimension", 48) < D:
        alts.append(ref_leverage(x, pos, layer + 1, **case))
    for alt in alts:
        assert not np.allclose(alt[valid], ref[valid], atol=0.05)


# ---- qfilter --------------------------------------------------------------------------------------------
def ref_qfilter(k, filters, layer):
    """kvpress's QFilterPress.score: -<f, k> with the layer's filter of each KV head, filters [L, K, D]."""
    return -np.einsum("bkcd,kd->bkc", k.astype(np.float64), np.asarray(filters, np.float64)[layer])


def test_qfilter_matches_numpy_and_finds_its_filters(tmp_path):
    """The score per layer (a traced layer index too), and the filters bound from a checkpoint folder, a JSON
    path or numbers; without any, the clear error naming `vdjax analyze --qfilters`."""
    from vdjax.engine.policies import default_policies
    from vdjax.engine.qfilters import save_qfilters

    k, v, pos, *_ = _inputs(6)
    filters = np.random.RandomState(6).randn(3, K, D).astype(np.float32)
    pol = vdjax.get_policy("qfilter")
    valid = pos >= 0
    for layer in (0, 2):
        got = np.asarray(pol(k, v, P.AttnInfo(None, None, None, layer=layer), jnp.asarray(pos), slots=N,
                             filters=filters.tolist()))
        np.testing.assert_allclose(got[valid], ref_qfilter(k, filters, layer)[valid], rtol=1e-5, atol=1e-5)
    traced = jax.jit(lambda layer: pol(k, v, P.AttnInfo(None, None, None, layer=layer), jnp.asarray(pos),
                                       slots=N, filters=filters.tolist()))(jnp.int32(2))
    np.testing.assert_allclose(np.asarray(traced)[valid], ref_qfilter(k, filters, 2)[valid], rtol=1e-5,
                               atol=1e-5)

    cfg = tiny_config(num_layers=3, num_kv_heads=K, num_heads=K * G, head_dim=D)
    params = random_params(cfg)
    with pytest.raises(ValueError, match="no Q-filters in its checkpoint folder; run `vdjax analyze "
                                         "--model M --qfilters` first"):
        vdjax.bind("qfilter", params, 8)
    folder = tmp_path / "model"
    folder.mkdir()
    sourced = dataclasses.replace(params, source=str(folder))
    with pytest.raises(ValueError, match=f"no Q-filters in {folder}/vdjax-qfilters/; run `vdjax analyze"):
        vdjax.bind("qfilter", sourced, 8)
    assert "qfilter" not in default_policies(sourced)
    path = save_qfilters(folder, filters, model="tiny")
    assert path == folder / "vdjax-qfilters" / "qfilters.json" and "qfilter" in default_policies(sourced)
    want = np.asarray(filters, np.float64)
    for bound in (vdjax.bind("qfilter", sourced, 8), vdjax.bind("qfilter", params, 8, filters=str(path)),
                  vdjax.bind("qfilter", params, 8, filters=filters.tolist())):
        np.testing.assert_array_equal(np.asarray(dict(bound.hyper)["filters"]), want)
    with pytest.raises(ValueError, match=r"filters must be finite numbers of shape \[layers=3\]\[kv_heads=3\]"
                                         r"\[head_dim=8\], got shape \(2, 3, 8\)"):
        vdjax.bind("qfilter", params, 8, filters=filters[:2].tolist())


# ---- chunkkv (a budget wrapper: tests/test_policies.py's registry check does not list it) ----------------
def ref_chunk_scores(scores, pos, length):
    """ChunkKV's chunk score of every candidate (kvpress's ChunkKVPress: the scores summed over the KV heads,
    then the mean over the chunk's positions): per chunk of `length` absolute positions, the sum over the
    heads holding some of its positions of the mean of their scores; +inf when any is protected (+inf)."""
    out = np.zeros(pos.shape)
    for b in range(pos.shape[0]):
        chunk = np.where(pos[b] >= 0, pos[b] // length, -1)
        for c in set(chunk[chunk >= 0].tolist()):
            inside = chunk == c
            if np.isposinf(scores[b][inside]).any():
                total = np.inf
            else:
                total = sum(scores[b, h][inside[h]].astype(np.float64).mean() for h in range(pos.shape[1])
                            if inside[h].any())
            out[b][inside] = total
    return out


@pytest.mark.parametrize("length", [4, 20])
def test_chunkkv_matches_numpy(length):
    """chunkkv:keydiff+sinks3 (the sinks' chunk protected whole) over candidates whose heads hold different
    positions; the cache keeps whole chunks, the same in every head holding them, the last one cut to its
    earliest positions."""
    from vdjax.engine import cache as vc

    k, v, pos, q_pos, *_ = _inputs(7)
    pol = vdjax.get_policy("chunkkv:keydiff+sinks3")
    assert dict(pol.defaults)["chunk_length"] == 20
    got = np.asarray(pol(k, v, None, jnp.asarray(pos), slots=N, chunk_length=length))
    base = np.asarray(vdjax.get_policy("keydiff+sinks3")(k, v, None, jnp.asarray(pos), slots=N))
    valid = pos >= 0
    ref = ref_chunk_scores(np.where(valid, base, 0), pos, length)
    np.testing.assert_allclose(got[valid], ref[valid], rtol=2e-5, atol=1e-6)
    if length == 4:
        assert np.isposinf(ref[valid & (pos < 4)]).all() and np.isfinite(ref[valid & (pos >= 4)]).all()
        kd = np.zeros(pos.shape)  # KeyDiff in NumPy: -cos(k, mean of the unit keys), the sinks +inf
        for b, h in np.ndindex(B, K):
            kk = k[b, h].astype(np.float64)
            anchor = (kk / np.linalg.norm(kk, axis=1, keepdims=True))[valid[b, h]].mean(0)
            kd[b, h] = -(kk @ anchor) / (np.linalg.norm(kk, axis=1) * np.linalg.norm(anchor))
        kd[valid & (pos < 3)] = np.inf
        np.testing.assert_allclose(ref_chunk_scores(kd, pos, 4)[valid], ref[valid], rtol=1e-5, atol=1e-6)
    # full rows, all heads holding the same positions: every head keeps the same whole chunks
    same = np.broadcast_to(np.concatenate([np.arange(C - S), q_pos[0]])[None, None], (B, K, C)).copy()
    got = np.asarray(pol(k, v, None, jnp.asarray(same), slots=N, chunk_length=length))
    keep = np.asarray(vc.keep_mask(jnp.asarray(got), jnp.asarray(same), 8))
    for b in range(B):
        sets = [set(same[b, h][keep[b, h]].tolist()) for h in range(K)]
        assert all(s == sets[0] for s in sets) and len(sets[0]) == 8
        chunks = sorted({p // length for p in sets[0]})
        ranked = sorted(chunks, key=lambda c: -got[b, 0][same[b, 0] // length == c][0])
        cut = ranked[-1]  # the lowest-scored kept chunk: the one cut, to its earliest positions
        for c in ranked[:-1]:
            assert {p for p in same[b, 0].tolist() if p // length == c} <= sets[0]
        part = sorted(p for p in sets[0] if p // length == cut)
        members = sorted(p for p in same[b, 0].tolist() if p // length == cut)
        assert part == members[:len(part)]


def test_lagkv_one_member_successor_is_finite():
    """After evictions a successor partition can hold one cached member (no range per channel): the partition
    before it still gets finite scores (the channel normalised by 1), not NaN (which would evict it first)."""
    rng = np.random.RandomState(0)
    pos = np.array([[[0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13]]], np.int32)
    k = rng.randn(1, 1, pos.shape[-1], 4).astype(np.float32)
    v = rng.randn(1, 1, pos.shape[-1], 4).astype(np.float32)
    probs = np.zeros((1, 1, 1, 1, pos.shape[-1]), np.float32)
    attn = P.AttnInfo(jnp.asarray(probs), jnp.asarray([[13]], jnp.int32), jnp.zeros(pos.shape, jnp.float32))
    for cross in (True, False):
        s = np.asarray(vdjax.get_policy("lagkv")(k, v, attn, jnp.asarray(pos), slots=8, n_sink=2, lag_size=3,
                                                 cross_scoring=cross))
        assert np.isfinite(s).all(), (cross, s)
        assert len(set(s[0, 0, 2:5].tolist())) > 1  # partition 0 (positions 2-4) ranked, not all tied


# ---- compactor ------------------------------------------------------------------------------------------
def ref_tile_attention(q, k, member, chunk):
    """kvpress's NonCausalAttnPress.non_causal_chunked_attn on each row's members (contiguous indices): tiles
    of `chunk` members from the row's first member, each member query's softmax over its tile's member keys
    of the unscaled q.k (no 1/sqrt(d)), each key's column sum over its tile's queries, mean over the GQA group
    (query head qh reads KV head qh // G). q [B, S, Nq, D] post-RoPE, k [B, K, S, D] -> [B, K, S] fp64, 0 for
    non-members."""
    rows, s, nq, _ = q.shape
    kh = k.shape[1]
    g = nq // kh
    out = np.zeros((rows, kh, s))
    for b in range(rows):
        idx = np.flatnonzero(member[b])
        assert np.all(np.diff(idx) == 1), "members must be contiguous"
        for lo in range(0, len(idx), chunk):
            tile = idx[lo:lo + chunk]
            for qh in range(nq):
                logits = q[b, tile, qh].astype(np.float64) @ k[b, qh // g, tile].astype(np.float64).T
                e = np.exp(logits - logits.max(axis=1, keepdims=True))
                out[b, qh // g, tile] += (e / e.sum(axis=1, keepdims=True)).sum(axis=0) / g
    return out


@pytest.mark.parametrize("s, chunk, g", [(11, 4, 2), (11, 3, 1), (12, 4, 2), (11, 11, 2), (11, 16, 2),
                                         (9, 2, 3)])
def test_tile_attention_matches_numpy(s, chunk, g):
    """Tiles shorter than the block with a partial last tile, one tile of the whole block (chunk >= S), rows
    whose members start later (sinks first) or end early (padding last), GQA groups of 1 to 3."""
    from vdjax.engine.scores import tile_attention

    rng = np.random.RandomState(100 * s + 10 * chunk + g)
    kh = 2
    member = np.zeros((5, s), bool)
    member[0] = True  # the whole block
    member[1, 3:] = True  # members from index 3 (the first positions are sinks)
    member[2, :s - 4] = True  # the row's block ends early (q_pos -1 at the end)
    member[3, 2:s - 3] = True  # both
    member[4, 5:6] = True  # a single member
    q = (0.7 * rng.randn(5, s, kh * g, D)).astype(np.float32)
    k = (0.7 * rng.randn(5, kh, s, D)).astype(np.float32)
    # with a subset mask beside it (each row's last member dropped: the tiling of the first mask, shared)
    sub = member.copy()
    sub[np.arange(5), s - 1 - np.argmax(member[:, ::-1], axis=1)] = False
    got, got_sub = (np.asarray(a) for a in tile_attention(jnp.asarray(q), jnp.asarray(k),
                                                           (jnp.asarray(member), jnp.asarray(sub)), chunk))
    ref = ref_tile_attention(q, k, member, chunk)
    np.testing.assert_allclose(got_sub[:4], ref_tile_attention(q, k, sub, chunk)[:4], rtol=1e-5, atol=1e-6)
    assert np.all(got_sub[4] == 0) and not sub[4].any()
    assert got.shape == (5, kh, s) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert np.all(got[:, :, ~member.any(0)] == 0) and np.all(got[2][:, s - 4:] == 0)
    # a tile's queries hand out one unit each: per KV head the members' sum is their count
    np.testing.assert_allclose(got.sum(-1), np.broadcast_to(member.sum(1)[:, None], (5, kh)), rtol=1e-5)
    np.testing.assert_allclose(got[4, :, 5], 1.0, rtol=1e-6)
    if chunk < s:  # the tiles really cut: one tile of every member scores otherwise
        assert not np.allclose(ref_tile_attention(q, k, member, s)[:4], ref[:4], atol=1e-3)


@pytest.mark.parametrize("rope, scale", [("full", 1.0), ("full", 1.3), ("partial", 1.0), ("partial", 1.3)])
def test_rotate_is_the_rope_that_unrotate_inverts(rope, scale):
    """scores.rotate (Compactor's queries) is the NumPy RoPE at the query positions (padding at position 0),
    and scores.unrotate takes it back."""
    from vdjax.engine.scores import rope_table, rotate, unrotate

    rng = np.random.RandomState(1)
    q = rng.randn(B, S, NQ, D).astype(np.float32)
    q_pos = np.array([[3, 97, 250, 251, 599], [40, 41, 42, -1, -1]], np.int32)
    inv_freq = ROPE[rope]
    got = np.asarray(rotate(jnp.asarray(q), jnp.asarray(q_pos), jnp.asarray(inv_freq), scale))
    assert got.dtype == np.float32
    table = rope_table(jnp.asarray(inv_freq), 600)  # the programs' table: the same values, jitted
    args = (jnp.asarray(q), jnp.asarray(q_pos), jnp.asarray(inv_freq), scale)
    jitted = jax.jit(rotate, static_argnums=3)
    np.testing.assert_array_equal(np.asarray(jitted(*args, table)), np.asarray(jitted(*args)))
    np.testing.assert_allclose(got, ref_rope(q, np.maximum(q_pos, 0)[..., None], inv_freq, scale), rtol=1e-4,
                               atol=1e-4)
    attn = P.AttnInfo(None, None, None, inv_freq=jnp.asarray(inv_freq), rope_scale=scale)
    pos = np.broadcast_to(q_pos[:, None], (B, NQ, S))
    back = np.asarray(unrotate(jnp.asarray(got.transpose(0, 2, 1, 3)), jnp.asarray(pos), attn))
    np.testing.assert_allclose(back, q.transpose(0, 2, 1, 3), rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, q, atol=1e-2)


def ref_compactor_tiles(queries, k, q_pos, inv_freq, scale=1.0, *, sink_size_start=8, sink_size_end=4,
                        chunk_size=256):
    """Compactor's per-token feature of a block: its pre-RoPE queries [B, S, Nq, D] rotated at their
    positions, its keys k [B, K, S, D] (after RoPE); members are the valid tokens at positions >=
    sink_size_start; the core ones (up to the block's last position - sink_size_end) get the tile attention
    (`ref_tile_attention`) of the core alone, the newest sink_size_end members the tile attention of every
    member; 0 elsewhere. -> [B, K, S] fp64."""
    q = ref_rope(queries, np.maximum(q_pos, 0)[..., None], inv_freq, scale)
    out = np.zeros(k.shape[:3])
    for b in range(q_pos.shape[0]):
        every = (q_pos[b] >= 0) & (q_pos[b] >= sink_size_start)
        core = every & (q_pos[b] <= q_pos[b].max() - sink_size_end)
        a_core = ref_tile_attention(q[b:b + 1], k[b:b + 1], core[None], chunk_size)[0]
        a_every = ref_tile_attention(q[b:b + 1], k[b:b + 1], every[None], chunk_size)[0]
        out[b] = np.where(core, a_core, np.where(every, a_every, 0.0))
    return out


@pytest.mark.parametrize("case", [dict(sink_size_start=4, sink_size_end=3, chunk_size=4),
                                  dict(sink_size_start=2, sink_size_end=1, chunk_size=3, rope="partial",
                                       scale=1.3),
                                  dict(sink_size_start=8, sink_size_end=4, chunk_size=256)])
def test_compactor_tiles_match_numpy(case):
    """The feature of a first block (sinks at its start), a later one, and one ending early (padding)."""
    from vdjax.engine.scores import compactor_tiles

    case = dict(case)
    inv_freq, scale = ROPE[case.pop("rope", "full")], case.pop("scale", 1.0)
    s = 13
    q_pos = np.stack([np.arange(s), np.arange(30, 30 + s), np.r_[np.arange(30, 39), [-1] * 4]])
    q_pos = q_pos.astype(np.int32)
    rng = np.random.RandomState(case["chunk_size"])
    queries = (0.7 * rng.randn(3, s, NQ, D)).astype(np.float32)
    x = (0.7 * rng.randn(3, K, s, D)).astype(np.float32)
    k = ref_rope(x, np.broadcast_to(q_pos[:, None], (3, K, s)), inv_freq, scale).astype(np.float32)
    v = rng.randn(3, K, s, D).astype(np.float32)
    assert vdjax.get_policy("compactor").token_feature is compactor_tiles
    got = np.asarray(compactor_tiles(jnp.asarray(v), None, k=jnp.asarray(k), q_pos=jnp.asarray(q_pos),
                                     rope=(jnp.asarray(queries), jnp.asarray(inv_freq), scale, None),
                                     hyper=case))
    ref = ref_compactor_tiles(queries, k, q_pos, inv_freq, scale, **case)
    assert got.shape == (3, K, s)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    start, end = case["sink_size_start"], case["sink_size_end"]
    assert np.all(got[0][:, :start] == 0) and np.all(got[2][:, 9:] == 0)
    newest = (q_pos > q_pos.max(1, keepdims=True) - end) & (q_pos >= 0)
    assert np.all(got.transpose(0, 2, 1)[newest] > 0)  # the protected newest get their share too
    # the core's tiles leave the newest out: with them in, the core scores otherwise
    core = (q_pos >= start) & ~newest
    alt = ref_compactor_tiles(queries, k, q_pos, inv_freq, scale, **{**case, "sink_size_end": 0})
    assert not np.allclose(alt.transpose(0, 2, 1)[core], ref.transpose(0, 2, 1)[core], atol=1e-3)


def ref_compactor(k, v, pos, feature, last_pos, inv_freq, slots, scale=1.0, *, blending=None,
                  sink_size_start=8, sink_size_end=4, sketch_dimension=48, ridge=1e-2, seed=0, layer=0):
    """kvpress's CompactorPress.score in block mode, from vdjax's docstring: the candidates at positions <
    sink_size_start or among the row's newest sink_size_end (> last_pos - sink_size_end) protected (+inf for
    kvpress's max padding); over the other (free) ones, blending * leverage (`ref_leverage` on the pre-RoPE
    keys, the free candidates only) + the z-score over the row (unbiased std floored at 1e-6) of feature *
    ||v|| average-pooled over 3 (zero padding counted, torch's avg_pool1d(3, padding=1)) along each head's
    free candidates sorted by position; blending None: 1 - slots / (last_pos + 1) floored at 0.
    k [B, K, C, D] post-RoPE, pos [B, K, C] (-1 invalid), feature [B, K, C], last_pos [B]."""
    valid = pos >= 0
    last = last_pos[:, None, None]
    protected = valid & ((pos < sink_size_start) | (pos > last - sink_size_end))
    free = valid & ~protected
    x = ref_rope(k, -pos, inv_freq, 1.0 / scale)  # the inverse rotation: the pre-RoPE keys
    lev = ref_leverage(x, np.where(free, pos, -1), layer, sketch_dimension=sketch_dimension, ridge=ridge,
                       seed=seed)
    att = feature.astype(np.float64) * np.linalg.norm(v.astype(np.float64), axis=-1)
    pooled = np.zeros(pos.shape)
    for b, h in np.ndindex(pos.shape[:2]):
        order = sorted(np.flatnonzero(free[b, h]), key=lambda j, b=b, h=h: pos[b, h, j])
        padded = np.concatenate([[0.0], att[b, h, order], [0.0]])
        for r, j in enumerate(order):
            pooled[b, h, j] = padded[r:r + 3].sum() / 3
    out = np.zeros(pos.shape)
    for b in range(pos.shape[0]):
        f = free[b]
        z = (pooled[b] - pooled[b][f].mean()) / max(pooled[b][f].std(ddof=1), 1e-6)
        blend = max(1.0 - slots / (last_pos[b] + 1), 0.0) if blending is None else blending
        out[b] = blend * lev[b] + z
    return np.where(protected, np.inf, out)


def _compactor_inputs(seed, n=30, s=6, past=60, empty=4):
    """Pre-RoPE keys (off-centre), values and features of n cache slots (positions < past in shuffled slot
    order, `empty` of them empty) and a block of s tokens at past .. (row 1's ends 3 tokens early)."""
    rng = np.random.RandomState(seed)
    c = n + s
    x = (rng.randn(B, K, c, D) + rng.randn(1, K, 1, D)).astype(np.float32)
    v = rng.randn(B, K, c, D).astype(np.float32)
    feature = (rng.rand(B, K, c) + 0.1).astype(np.float32)
    pos = np.empty((B, K, c), np.int32)
    for b, h in np.ndindex(B, K):
        pos[b, h, :n] = rng.permutation(past)[:n]
        pos[b, h, rng.choice(n, empty, replace=False)] = -1
    q_pos = np.stack([np.arange(past, past + s), np.r_[np.arange(past, past + s - 3), [-1] * 3]])
    q_pos = q_pos.astype(np.int32)
    pos[:, :, n:] = q_pos[:, None]
    return x, v, feature, pos, q_pos


@pytest.mark.parametrize("case", [{}, dict(blending=0.3), dict(sink_size_start=3, sink_size_end=1),
                                  dict(sink_size_start=20, sink_size_end=9, blending=1.5),
                                  dict(sketch_dimension=5, ridge=0.1, seed=3, layer=2),
                                  dict(rope="partial", scale=1.3, sketch_dimension=6),
                                  dict(slots=80)])
def test_compactor_matches_numpy(case):
    """Cache slots in shuffled order with empty ones (holding garbage), a block ending early in row 1; the
    default blending (the compression ratio so far: 1 - 30 / 66 and 1 - 30 / 63, 0 when slots exceed the
    tokens seen), a given one, other sink sizes, sketches and RoPE."""
    case = dict(case)
    inv_freq, scale = ROPE[case.pop("rope", "full")], case.pop("scale", 1.0)
    layer, slots = case.pop("layer", 0), case.pop("slots", 30)
    x, v, feature, pos, q_pos = _compactor_inputs(7)
    k = ref_rope(x, pos, inv_freq, scale).astype(np.float32)
    empty = pos < 0
    k[empty], v[empty], feature[empty] = 30.0, -50.0, 1e3  # garbage in the empty slots
    attn = P.AttnInfo(None, jnp.asarray(q_pos), None, layer=layer, feature=jnp.asarray(feature),
                      inv_freq=jnp.asarray(inv_freq), rope_scale=scale)
    pol = vdjax.get_policy("compactor")
    got = np.asarray(pol(jnp.asarray(k), jnp.asarray(v), attn, jnp.asarray(pos), slots=slots, **case))
    ref = ref_compactor(k, v, pos, feature, q_pos.max(1), inv_freq, slots, scale, layer=layer, **case)
    valid = ~empty
    start, end = case.get("sink_size_start", 8), case.get("sink_size_end", 4)
    protected = valid & ((pos < start) | (pos > q_pos.max(1)[:, None, None] - end))
    np.testing.assert_array_equal(np.isposinf(got[valid]), protected[valid])
    np.testing.assert_array_equal(np.isposinf(ref[valid]), protected[valid])
    fin = valid & ~protected
    assert protected.sum() >= 6 * K and fin.sum() >= 2 * K * 15
    assert np.isfinite(got[fin]).all()
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-4, atol=1e-4)
    # the leverage term counts unless the blend is 0 (slots=80 > 66 tokens seen: z-scored attention alone)
    z_only = ref_compactor(k, v, pos, feature, q_pos.max(1), inv_freq, slots, scale, layer=layer,
                           **{**case, "blending": 0.0})
    if slots == 80:
        np.testing.assert_allclose(ref[fin], z_only[fin], rtol=1e-12)
        for b in range(B):  # the pooled attention's z-scores over the row's free candidates
            assert abs(z_only[b][fin[b]].mean()) < 1e-9 and abs(z_only[b][fin[b]].std(ddof=1) - 1) < 1e-9
    else:
        assert not np.allclose(ref[fin], z_only[fin], atol=0.05)


def test_compactor_needs_its_feature():
    x, v, feature, pos, q_pos = _compactor_inputs(8)
    attn = P.AttnInfo(None, jnp.asarray(q_pos), None, inv_freq=jnp.asarray(ROPE["full"]))
    with pytest.raises(ValueError, match="compactor reads its tile attention from attn.feature"):
        vdjax.get_policy("compactor")(jnp.asarray(x), jnp.asarray(v), attn, jnp.asarray(pos), slots=30)


def _layer0_qkv(params, ids, positions=None):
    """Layer 0's pre-RoPE queries [T, Nq, D], keys after RoPE and values [K, T, D] of one prompt (they do not
    depend on what the cache keeps), at positions 0 .. T - 1 or the given ones [T] (KVzip's replay)."""
    from models import transformer as tf

    cfg = params.config
    lw = params.weights["layers"][0]
    x = tf.embed(params, jnp.asarray(ids)[None])
    h = tf.rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    positions = jnp.arange(len(ids))[None] if positions is None else jnp.asarray(positions, jnp.int32)[None]
    inv_freq = jnp.asarray(tf.rope_inv_freq(cfg))
    _, k, v, _, q = tf.project_qkv(lw, h, positions, cfg, inv_freq, with_queries=True)
    return np.asarray(q[0]), np.asarray(k[0].transpose(1, 0, 2)), np.asarray(v[0].transpose(1, 0, 2))


def _assert_holds_budget(cache, seen, heads, budget, must_keep):
    """Every layer holds exactly `budget` distinct positions in each of its `heads` KV heads, each below its
    row's `seen` tokens, and the positions `must_keep(n)` (the protected ones) among them."""
    for lc in cache.layers:
        pos = np.asarray(lc.pos)
        assert pos.shape == (len(seen), heads, budget)
        for b, n in enumerate(seen):
            for h in range(heads):
                kept = pos[b, h][pos[b, h] >= 0]
                assert len(kept) == budget and len(set(kept.tolist())) == budget
                assert kept.min() >= 0 and kept.max() < n and must_keep(n) <= set(kept.tolist())


def ref_compactor_prefill(q, k, v, budget, block, inv_freq, scale, chunk_size=256, **hyper):
    """Layer 0 of one row's block prefill under compactor, in NumPy: each block's tokens get their feature
    (`ref_compactor_tiles` over the block) as they enter; the kept tokens and the block's are scored
    (`ref_compactor`, slots = budget) and each head keeps its `budget` best (ties: the earlier position; all
    of them while they fit).
    q [T, Nq, D] pre-RoPE, k, v [K, T, D] -> (kept positions per KV head, every token's feature [K, T])."""
    kh, t = k.shape[:2]
    tiles = {key: hyper[key] for key in ("sink_size_start", "sink_size_end") if key in hyper}
    feat = np.zeros((kh, t))
    kept = [[] for _ in range(kh)]
    for lo in range(0, t, block):
        q_pos = np.arange(lo, min(lo + block, t))
        feat[:, q_pos] = ref_compactor_tiles(q[None, q_pos], k[None][:, :, q_pos], q_pos[None], inv_freq,
                                             scale, chunk_size=chunk_size, **tiles)[0]
        cands = [kept[h] + q_pos.tolist() for h in range(kh)]
        if max(map(len, cands)) <= budget:  # every candidate fits: kept whatever its score
            kept = cands
            continue
        pos = np.full((1, kh, max(map(len, cands))), -1, np.int32)
        for h in range(kh):
            pos[0, h, :len(cands[h])] = cands[h]
        heads, at = np.arange(kh)[:, None], np.maximum(pos[0], 0)
        scores = ref_compactor(k[heads, at][None], v[heads, at][None], pos, feat[heads, at][None],
                               q_pos.max()[None], inv_freq, budget, scale, **hyper)[0]
        for h in range(kh):
            ranked = sorted(range(len(cands[h])), key=lambda j, h=h: (-scores[h, j], cands[h][j]))
            kept[h] = sorted(cands[h][j] for j in ranked[:budget])
    return kept, feat


@pytest.mark.parametrize("mode", ["full", "blocks"])
def test_compactor_engine_keeps_the_numpy_prefills_tokens(mode):
    """A tiny GQA model's prefill under compactor (tiles of 16, so several of them): one block of the whole
    prompt (kvpress's full-prefill CompactorPress) and blocks of 8 over a ragged batch. Every layer's cache
    holds `budget` distinct positions of its row (the sinks and the newest tokens among them); layer 0 (whose
    keys, values and queries do not depend on the cache) keeps the positions of the NumPy prefill and carries
    the NumPy feature of each kept token."""
    from models import transformer as tf

    cfg = tiny_config()
    params = random_params(cfg, seed=3)
    lengths, budget = ((40,), 20) if mode == "full" else ((40, 29), 18)
    block = 64 if mode == "full" else 8
    ids = [random_ids(n, cfg.vocab_size, seed=n + 1) for n in lengths]
    hyper = dict(chunk_size=16, sink_size_start=5, sink_size_end=3)
    cache, logits = vdjax.prefill(params, ids, "compactor", budget, block_size=block, layer_scan=False,
                                  **hyper)
    assert np.isfinite(np.asarray(logits)).all()
    _assert_holds_budget(cache, lengths, cfg.num_kv_heads, budget,
                         lambda n: set(range(5)) | set(range(n - 3, n)))
    inv_freq, scale = tf.rope_inv_freq(cfg), cfg.rope_attention_factor
    pos0, feat0 = np.asarray(cache.layers[0].pos), np.asarray(cache.layers[0].feat)
    for b, row in enumerate(ids):
        q, k, v = _layer0_qkv(params, row)
        kept, feat = ref_compactor_prefill(q, k, v, budget, min(block, len(row)), inv_freq, scale, **hyper)
        for h in range(cfg.num_kv_heads):
            slots = pos0[b, h] >= 0
            assert sorted(pos0[b, h][slots].tolist()) == kept[h], (b, h)
            np.testing.assert_allclose(feat0[b, h][slots], feat[h, pos0[b, h][slots]], rtol=1e-4, atol=1e-5)
        assert (feat[:, 5:] > 0).all()


# ---- kvzip ----------------------------------------------------------------------------------------------
KVZIP_IDS = {"repeat_ids": (1, 2, 3), "continue_ids": (4, 5), "suffix_ids": (6,)}  # helpers.policy_kwargs'


def ref_replay_attention(q_r, r_pos, k_r, cand_k, cand_pos, q_pos, *, n_sink=4, window=None, h_norm=None,
                         wov=None):
    """kvpress's KVzipPress._compute_cross_attention and score_kvzip in block mode, loop by loop in fp64: each
    valid replay query (r_pos >= 0) of each query head attends, logits q.k / sqrt(D), to the sinks (candidates
    at 0 <= pos < n_sink before the block's first position), the block's valid tokens (the last S candidates)
    and the replay's own keys at positions <= its own, all within `window` positions when given; softmax over
    those keys; KVzip+ (`h_norm` [B, R], `wov` [B, K, G, C + R]): the weights / ||h|| of the query, times
    ||W_o v|| of the key for that query head. A block token's score is its largest weight over the valid
    replay queries and the G query heads of its KV head (0 where nothing attends to it).
    q_r [B, R, Nq, D] post-RoPE, k_r [B, K, R, D], cand_k [B, K, C, D], cand_pos [B, K, C], q_pos [B, S]
    -> [B, K, S] fp64."""
    rows, r, nq, d = q_r.shape
    kh, c = cand_k.shape[1], cand_k.shape[2]
    s = q_pos.shape[1]
    g = nq // kh
    out = np.zeros((rows, kh, s))
    for b in range(rows):
        if not (q_pos[b] >= 0).any():
            continue
        first = q_pos[b][q_pos[b] >= 0].min()
        for h in range(kh):
            p = cand_pos[b, h]
            cand = [j for j in range(c) if 0 <= p[j] < n_sink and p[j] < first]  # the sinks
            cand += [j for j in range(c - s, c) if p[j] >= 0]  # the block
            keys = np.concatenate([cand_k[b, h], k_r[b, h]]).astype(np.float64)  # [C + R, D]
            kpos = np.concatenate([p, r_pos[b]])
            for i in range(r):
                if r_pos[b, i] < 0:
                    continue
                cols = cand + [c + j for j in range(r) if 0 <= r_pos[b, j] <= r_pos[b, i]]
                if window is not None:
                    cols = [j for j in cols if r_pos[b, i] - kpos[j] < window]
                cols = np.array(cols)
                for gg in range(g):
                    logits = keys[cols] @ q_r[b, i, h * g + gg].astype(np.float64) / np.sqrt(d)
                    w = np.exp(logits - logits.max())
                    w /= w.sum()
                    if h_norm is not None:
                        w = w / h_norm[b, i] * wov[b, h, gg, cols]
                    for j, wj in zip(cols, w, strict=True):
                        if j >= c - s and j < c:
                            out[b, h, j - (c - s)] = max(out[b, h, j - (c - s)], wj)
    return out


RS, RH = 6, 5  # the replayed block's length and the replay's prompt length (as repeat + suffix)


def _replay_inputs(seed, n=9):
    """Four rows: a later block (positions 30 .. 35) with the 4 sinks among n shuffled cache slots (2 empty);
    the same block ending 3 tokens early (padding last) with position 2 evicted; a first block (positions
    0 .. 5, an empty cache); a row without tokens. The replay: RH prompt tokens (row 1's first 2 padding, as
    `replay_stream` front-pads the shorter prompt) and the block's tokens again, at the positions after the
    block. Garbage in the empty slots and the padding. -> (q_r, r_pos, k_r, cand_k, cand_pos, q_pos, h_norm,
    wov)."""
    rng = np.random.RandomState(seed)
    b, c, r = 4, n + RS, RH + RS
    cand_pos = np.full((b, K, c), -1, np.int32)
    for h in range(K):
        for row, sinks in ((0, [0, 1, 2, 3]), (1, [0, 1, 3]), (3, [0, 1, 2, 3])):
            others = rng.choice(np.arange(4, 30), n - len(sinks) - 2, replace=False)
            cand_pos[row, h, :n] = rng.permutation(np.r_[sinks, others, -1, -1])
    q_pos = np.array([np.arange(30, 36), np.r_[30:33, [-1] * 3], np.arange(6), [-1] * 6], np.int32)
    cand_pos[:, :, n:] = q_pos[:, None]
    valid = np.concatenate([np.ones((b, RH), bool), q_pos >= 0], axis=1)
    valid[1, :2] = False
    valid[3] = False
    r_pos = np.where(valid, q_pos.max(1, keepdims=True) + np.cumsum(valid, axis=1), -1).astype(np.int32)
    q_r = rng.randn(b, r, NQ, D).astype(np.float32)
    k_r = rng.randn(b, K, r, D).astype(np.float32)
    cand_k = rng.randn(b, K, c, D).astype(np.float32)
    cand_k[cand_pos < 0] = 30.0
    q_r[~valid] = 30.0
    k_r.transpose(0, 2, 1, 3)[~valid] = -30.0
    h_norm = (0.5 + 2.5 * rng.rand(b, r)).astype(np.float32)
    wov = (0.2 + 2 * rng.rand(b, K, G, c + r)).astype(np.float32)
    return q_r, r_pos, k_r, cand_k, cand_pos, q_pos, h_norm, wov


@pytest.mark.parametrize("case", [{}, dict(n_sink=0), dict(n_sink=2), dict(n_sink=50), dict(window=7),
                                  dict(plus=True), dict(plus=True, n_sink=2, window=9)])
def test_replay_attention_matches_numpy(case):
    """Shuffled cache slots with empty ones, a ragged row, a first block, a row without tokens, GQA G = 2;
    the sinks (none, some, every cached token below the block), a window, KVzip+."""
    from vdjax.engine.scores import replay_attention

    case = dict(case)
    plus = case.pop("plus", False)
    q_r, r_pos, k_r, cand_k, cand_pos, q_pos, h_norm, wov = _replay_inputs(11)
    extra = dict(h_norm=h_norm, wov=wov) if plus else {}
    args = (q_r, r_pos, k_r, cand_k, cand_pos, q_pos)
    got = np.asarray(replay_attention(*map(jnp.asarray, args), **case,
                                      **{key: jnp.asarray(a) for key, a in extra.items()}))
    ref = ref_replay_attention(*args, **case, **extra)
    assert got.shape == (4, K, RS) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    live = np.broadcast_to((q_pos >= 0)[:, None], got.shape)
    assert np.all(got[~live] == 0) and np.all(ref[live] > 0)  # padding and the row without tokens score 0
    if not plus:
        assert ref.max() <= 1
    plain = ref_replay_attention(*args, **{**case, "n_sink": 0, "window": None}, **extra)
    if plus:  # the norms count
        assert not np.allclose(ref, ref_replay_attention(*args, **case), rtol=1e-3)
    elif "window" in case:  # the window drops the sinks and the oldest keys of the later replay queries
        assert not np.allclose(ref[:2], plain[:2], rtol=1e-3)
    elif case.get("n_sink", 4):  # the sinks only take weight from the block
        assert np.all(ref[:2][live[:2]] < plain[:2][live[:2]] + 1e-12)
        assert not np.allclose(ref[:2], plain[:2], rtol=1e-3)
    if "window" not in case:  # no sink before a first block: its positions 0 .. 3 are the block's
        np.testing.assert_allclose(ref[2], plain[2], rtol=1e-12)


@pytest.mark.parametrize("n_sink", [4, 0, 12])
def test_kvzip_matches_numpy(n_sink):
    """kvzip's score is the carried feature (the replay's attention), +inf at the positions below n_sink
    (positions 0, 3, 4 and 11 cached in every head, in shuffled slots, with empty ones)."""
    k, v, pos, q_pos, *_ = _inputs(3)
    rng = np.random.RandomState(3)
    for b, h in np.ndindex(B, K):
        others = rng.choice(np.arange(12, 40), N - 6, replace=False)
        pos[b, h, :N] = rng.permutation(np.r_[0, 3, 4, 11, others, -1, -1])
    feature = np.random.RandomState(3).rand(B, K, C).astype(np.float32)
    feature[pos < 0] = 1e3  # garbage in the empty slots
    attn = P.AttnInfo(None, jnp.asarray(q_pos), None, feature=jnp.asarray(feature))
    got = np.asarray(vdjax.get_policy("kvzip")(jnp.asarray(k), jnp.asarray(v), attn, jnp.asarray(pos),
                                               slots=N, n_sink=n_sink))
    sinks = (pos >= 0) & (pos < n_sink)
    ref = np.where(sinks, np.inf, feature)
    valid = pos >= 0
    np.testing.assert_array_equal(got[valid], ref[valid])
    assert (sinks.sum() > 0) == (n_sink > 0) and np.isposinf(got[valid]).sum() == sinks.sum()


def test_kvzip_needs_its_feature():
    """Called without the replay's scores (outside the engine) the score and its feature marker refuse."""
    from vdjax.engine.replay import replay_feature

    k, v, pos, q_pos, *_ = _inputs(4)
    attn = P.AttnInfo(None, jnp.asarray(q_pos), None)
    pol = vdjax.get_policy("kvzip")
    with pytest.raises(ValueError, match="kvzip reads its replay scores from attn.feature"):
        pol(jnp.asarray(k), jnp.asarray(v), attn, jnp.asarray(pos), slots=N)
    assert pol.replay and pol.token_feature is replay_feature
    with pytest.raises(ValueError, match="kvzip's per-token scores come from the replay"):
        replay_feature(jnp.asarray(v), None)


def ref_replay_stream(hyper, tok, q_pos, prev=None, first=True):
    """The replay of each row from engine/replay.py's docstring: the first prompt (repeat + suffix), or the
    continue prompt + the 8 tokens before the block + the suffix, then the block's valid tokens, at the
    positions right after the block's last one; the shorter of the two prompts front-padded (position -1) to
    the longer's length when both may be used (`prev` given); a row without tokens replays nothing (all -1).
    -> (ids [B, R] (-1 at padding), positions [B, R])."""
    head = list(hyper["repeat_ids"]) + list(hyper["suffix_ids"])
    width = len(head)
    rows_ids, rows_pos = [], []
    for b in range(tok.shape[0]):
        if prev is not None:
            cont = list(hyper["continue_ids"]) + list(prev[b]) + list(hyper["suffix_ids"])
            width = max(len(head), len(cont))
        chosen = head if prev is None or first else cont
        block = [int(t) if p >= 0 else -1 for t, p in zip(tok[b], q_pos[b], strict=True)]
        ids = [-1] * (width - len(chosen)) + chosen + block
        if (q_pos[b] < 0).all():
            ids = [-1] * len(ids)
        live = np.array(ids) >= 0
        rows_ids.append(ids)
        rows_pos.append(np.where(live, q_pos[b].max() + np.cumsum(live), -1))
    return np.array(rows_ids), np.array(rows_pos)


@pytest.mark.parametrize("case", ["first", "later", "first_beside_later", "long_repeat"])
def test_kvzip_replay_stream(case):
    """replay.replay_stream on three rows (a block of 8 at positions 16 .. 23, the same block ending 3 tokens
    early, a row without tokens): a first block's ids are repeat + suffix + the block; a later block's
    continue + the 8 tokens before + suffix + the block; the shorter prompt front-padded (4 vs 11 tokens, and
    13 vs 11 with a long repeat prompt); the embeddings are the model's of those ids."""
    from models import transformer as tf
    from vdjax.engine.replay import PREV_POSTFIX, replay_stream

    cfg = tiny_config()
    params = random_params(cfg, seed=5)
    hyper = dict(KVZIP_IDS)
    if case == "long_repeat":
        hyper["repeat_ids"] = tuple(range(10, 22))
    rng = np.random.RandomState(5)
    tok = rng.randint(7, cfg.vocab_size, size=(3, 8)).astype(np.int32)
    q_pos = np.array([np.arange(16, 24), np.r_[16:21, [-1] * 3], [-1] * 8], np.int32)
    prev = rng.randint(7, cfg.vocab_size, size=(3, PREV_POSTFIX)).astype(np.int32)
    prev = None if case == "first" else prev
    first = case in ("first", "first_beside_later")
    emb, r_pos = replay_stream(params, hyper, jnp.asarray(tok), jnp.asarray(q_pos),
                               None if prev is None else jnp.asarray(prev), jnp.asarray(first))
    want_ids, want_pos = ref_replay_stream(hyper, tok, q_pos, prev, first)
    width = {"first": 4, "later": 11, "first_beside_later": 11, "long_repeat": 13}[case]
    assert want_ids.shape == (3, width + 8)
    np.testing.assert_array_equal(np.asarray(r_pos), want_pos)
    live = want_pos >= 0
    want_emb = np.asarray(tf.embed(params, jnp.asarray(want_ids[live])))
    np.testing.assert_array_equal(np.asarray(emb)[live], want_emb)
    assert emb.shape == (3, width + 8, cfg.hidden_size)
    assert want_pos[0, live[0]].tolist() == list(range(24, 24 + live[0].sum()))  # right after the block
    assert want_pos[1, live[1]].min() == 21 and not live[2].any()
    pads = {"first": 0, "later": 0, "first_beside_later": 7, "long_repeat": 2}[case]  # the shorter prompt's
    assert (want_pos[0, :pads] == -1).all() and want_pos[0, pads] == 24


def test_kvzip_bind_errors():
    """No ids and no checkpoint folder to read a tokenizer from; ids that are not a non-empty sequence of
    ids in the vocabulary; given ids pass (as tuples)."""
    from vdjax.engine.replay import bind_kvzip

    params = random_params(tiny_config())
    assert params.source is None
    pol = vdjax.get_policy("kvzip")
    for given in ({}, {"repeat_ids": (1, 2)}, {**KVZIP_IDS, "suffix_ids": None}):
        with pytest.raises(ValueError, match="no checkpoint folder to read a tokenizer from; pass repeat"):
            bind_kvzip(params, pol.hyper(**given))
    with pytest.raises(ValueError, match="no checkpoint folder"):
        vdjax.bind("kvzip", params, 8)
    for name, bad in [("repeat_ids", (1, 61)), ("continue_ids", ()), ("suffix_ids", (-1,)),
                      ("repeat_ids", "abc"), ("suffix_ids", (1.0,)), ("suffix_ids", (True,))]:
        with pytest.raises(ValueError, match=rf"policy 'kvzip': {name} must be a non-empty sequence of token "
                                             rf"ids in \[0, 61\), got {re.escape(repr(bad))}"):
            bind_kvzip(params, pol.hyper(**{**KVZIP_IDS, name: bad}))
    bound = dict(bind_kvzip(params, pol.hyper(**{**KVZIP_IDS, "repeat_ids": [9, 60], "n_sink": 2})))
    assert bound == {**KVZIP_IDS, "repeat_ids": (9, 60), "n_sink": 2, "chunk_size": 2048,
                     "kvzip_plus_normalization": False}
    numpy_ids = dict(bind_kvzip(params, pol.hyper(**{**KVZIP_IDS, "repeat_ids": np.array([9, 60])})))
    assert numpy_ids["repeat_ids"] == (9, 60) and all(type(i) is int for i in numpy_ids["repeat_ids"])
    with pytest.raises(ValueError, match=r"chunk_size must be an integer >= 1, got 0"):
        bind_kvzip(params, pol.hyper(**KVZIP_IDS, chunk_size=0))


@pytest.mark.parametrize("chat", [True, False])
def test_kvzip_binds_its_ids_from_the_tokenizer(tmp_path, chat):
    """Without ids, `bind_kvzip` reads the checkpoint's tokenizer: kvpress's repeat and continue prompts, and
    the suffix "\\n" without a chat template, the template's text between a user message and the assistant's
    answer with one; ids given are kept."""
    from vdjax.engine.replay import CONTINUE, REPEAT, bind_kvzip, replay_ids_from_tokenizer

    from helpers import tiny_tokenizer

    tok = tiny_tokenizer(chat=chat)
    tok.save_pretrained(tmp_path)
    params = random_params(tiny_config(vocab_size=len(tok))).replace(source=str(tmp_path))
    suffix = "<|im_end|>\n<|im_start|>assistant\n" if chat else "\n"
    ids = replay_ids_from_tokenizer(tok)
    for name, text in (("repeat_ids", REPEAT), ("continue_ids", CONTINUE), ("suffix_ids", suffix)):
        assert ids[name] == tuple(tok.encode(text, add_special_tokens=False))
        assert tok.decode(ids[name]) == text
    assert REPEAT == "\n\nRepeat the previous context exactly."
    assert CONTINUE == "\n\nRepeat the part of the previous context exactly, starting with"
    pol = vdjax.get_policy("kvzip")
    bound = dict(bind_kvzip(params, pol.hyper()))
    assert {name: bound[name] for name in ids} == ids
    bound = dict(bind_kvzip(params, pol.hyper(suffix_ids=[7, 8])))
    assert bound["suffix_ids"] == (7, 8) and bound["repeat_ids"] == ids["repeat_ids"]
    assert dict(vdjax.bind("kvzip", params, 8).hyper)["continue_ids"] == ids["continue_ids"]


def ref_kvzip_prefill(params, ids, budget, block, hyper, fed=()):
    """Layer 0 of one row's kvzip prefill (blocks of `block`), then decode steps feeding `fed`, in NumPy: each
    block replays (a first block after repeat + suffix, a later one after continue + the 8 tokens before it +
    suffix, a decoded token after the first prompt) at the positions after it, the replay's layer-0 queries
    and keys those of its ids' embeddings; the block's feature is `ref_replay_attention` over the kept tokens
    (their sinks) and the block; the kept tokens and the block's are scored (+inf below n_sink, else the
    feature) and each head keeps its `budget` best (ties: the earlier position).
    -> (kept positions per KV head, every token's feature [K, T + len(fed)])."""
    from models import transformer as tf

    cfg = params.config
    lw = params.weights["layers"][0]
    inv_freq, scale = tf.rope_inv_freq(cfg), cfg.rope_attention_factor
    n_sink = hyper["n_sink"]
    tokens = [int(t) for t in ids] + [int(t) for t in fed]
    _, k, v = _layer0_qkv(params, np.asarray(tokens, np.int32))
    kh, t = k.shape[:2]
    g = cfg.num_heads // kh
    wo = np.asarray(lw["wo"], np.float64)  # [Nq, D, H]
    spans = [(lo, min(lo + block, len(ids)), lo == 0) for lo in range(0, len(ids), block)]
    spans += [(p, p + 1, True) for p in range(len(ids), t)]
    feat = np.zeros((kh, t))
    kept = [[] for _ in range(kh)]
    for lo, hi, first in spans:
        q_pos = np.arange(lo, hi)
        prompt = hyper["repeat_ids"] if first else hyper["continue_ids"] + tuple(tokens[lo - 8:lo])
        rids = np.asarray(list(prompt) + list(hyper["suffix_ids"]) + tokens[lo:hi], np.int32)
        r_pos = np.arange(hi, hi + len(rids))
        qr, kr, vr = _layer0_qkv(params, rids, r_pos)
        q_r = ref_rope(qr, r_pos[:, None], inv_freq, scale)
        n_old = max(map(len, kept))
        cand_pos = np.full((1, kh, n_old + len(q_pos)), -1, np.int32)
        for h in range(kh):
            cand_pos[0, h, :len(kept[h])] = kept[h]
        cand_pos[0, :, n_old:] = q_pos
        heads, at = np.arange(kh)[:, None], np.maximum(cand_pos[0], 0)
        cand_k, cand_v = k[heads, at][None], v[heads, at][None]
        extra = {}
        if hyper.get("kvzip_plus_normalization"):  # ||h|| of the normed replay, ||W_o v|| per query head
            x = tf.rms_norm(tf.embed(params, jnp.asarray(rids)[None]), lw["attn_norm"], cfg.rms_norm_eps,
                            cfg.norm_offset)
            vals = np.concatenate([cand_v[0], vr], axis=1).astype(np.float64)  # [K, C + R, D]
            wov = np.array([[np.linalg.norm(vals[h] @ wo[h * g + j], axis=-1) for j in range(g)]
                            for h in range(kh)])
            extra = dict(h_norm=np.linalg.norm(np.asarray(x, np.float64), axis=-1), wov=wov[None])
        feat[:, q_pos] = ref_replay_attention(q_r[None], r_pos[None], kr[None], cand_k, cand_pos, q_pos[None],
                                              n_sink=n_sink, **extra)[0]
        for h in range(kh):
            cand = kept[h] + q_pos.tolist()
            score = [np.inf if p < n_sink else feat[h, p] for p in cand]
            ranked = sorted(range(len(cand)), key=lambda j, score=score, cand=cand: (-score[j], cand[j]))
            kept[h] = sorted(cand[j] for j in ranked[:budget])
    return kept, feat


@pytest.mark.parametrize("mode", ["full", "blocks", "plus"])
def test_kvzip_engine_keeps_the_numpy_prefills_tokens(mode):
    """A tiny GQA model under kvzip: one block of the whole prompt (kvpress's full-prefill KVzipPress, a batch
    of one) and blocks of 8 over a ragged batch (rows of 40 and 29 tokens: row 1's last block padded), the
    latter with KVzip+ too. Every layer's cache holds `budget` distinct positions of its row, the 4 sinks
    among them; layer 0 (whose replay, keys and queries do not depend on the cache) keeps the NumPy prefill's
    positions and carries its feature. In block mode, decode steps (each replayed after the first prompt)
    keep `budget` tokens, layer 0 those of the NumPy reference fed the same tokens."""
    cfg = tiny_config()
    params = random_params(cfg, seed=4)
    lengths, budget = ((40,), 20) if mode == "full" else ((40, 29), 14)
    block = 64 if mode == "full" else 8
    ids = [random_ids(n, cfg.vocab_size, seed=n + 7) for n in lengths]
    hyper = dict(KVZIP_IDS, n_sink=4, kvzip_plus_normalization=mode == "plus")
    cache, logits = vdjax.prefill(params, ids, "kvzip", budget, block_size=block, layer_scan=False, **hyper)
    assert np.isfinite(np.asarray(logits)).all()
    runs = [(cache, np.array(lengths), [()] * len(ids))]
    if mode != "full":
        new = 4
        gen = vdjax.run(params, ids, "kvzip", budget, block_size=block, max_new_tokens=new, layer_scan=False,
                        **hyper)
        assert gen.tokens.shape == (len(ids), new)
        fed = [gen.tokens[b, :new - 1] for b in range(len(ids))]  # fed at positions T .. T + new - 2
        runs.append((gen.cache, np.array(lengths) + new - 1, fed))
    for c, seen, fed in runs:
        _assert_holds_budget(c, seen, cfg.num_kv_heads, budget, lambda n: set(range(4)))
        pos0, feat0 = np.asarray(c.layers[0].pos), np.asarray(c.layers[0].feat)
        for b, row in enumerate(ids):
            kept, feat = ref_kvzip_prefill(params, row, budget, min(block, len(row)), hyper, fed[b])
            for h in range(cfg.num_kv_heads):
                slots = pos0[b, h] >= 0
                assert sorted(pos0[b, h][slots].tolist()) == kept[h], (b, h, len(fed[b]))
                np.testing.assert_allclose(feat0[b, h][slots], feat[h, pos0[b, h][slots]], rtol=1e-4,
                                           atol=1e-6)
            assert np.ptp(feat[:, 4:]) > 0.05  # the feature ranks: not every token ties
            end = len(row) + len(fed[b])  # and the kept are not streaming's (the sinks and the newest)
            streaming = list(range(4)) + list(range(end - budget + 4, end))
            assert any(kept[h] != streaming for h in range(len(kept)))


def test_kvzip_block_larger_than_its_chunk_size_is_refused():
    """Each block replays as one of kvpress's chunks: a block longer than chunk_size is refused, naming it."""
    cfg = tiny_config()
    params = random_params(cfg, seed=4)
    ids = [random_ids(40, cfg.vocab_size, seed=1)]
    with pytest.raises(ValueError, match=r"chunk_size=8 tokens; block_size=16 makes blocks of 16 tokens: "
                                         r"use block_size <= 8"):
        vdjax.prefill(params, ids, "kvzip", 10, block_size=16, chunk_size=8, layer_scan=False, **KVZIP_IDS)


def test_kvzip_whole_prompt_within_its_chunk_size_runs():
    """block_size >= T with T <= chunk_size is kvpress's single chunk (engine/replay.py's docstring): a prompt
    of 40 tokens at chunk_size=40 runs and keeps the budget."""
    cfg = tiny_config()
    params = random_params(cfg, seed=4)
    ids = [random_ids(40, cfg.vocab_size, seed=1)]
    cache, _ = vdjax.prefill(params, ids, "kvzip", 10, block_size=64, chunk_size=40, layer_scan=False,
                             **KVZIP_IDS)
    assert [len(h) for h in vdjax.kept_positions(cache)[0][0]] == [10] * cfg.num_kv_heads

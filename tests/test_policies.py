"""Every score function equals a plain NumPy reference (here, or in tests/test_scorers.py for those that read
the queries' statistics, the layer, RoPE, filters, positions' windows and partitions, or a replay's
attention); eviction operators keep exactly the right sets."""

import dataclasses
import importlib
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vdjax
from vdjax.engine import cache as vc
from vdjax.engine import policies as P
from vdjax.engine.cache import QueryStats

TESTS = Path(__file__).resolve().parent
B, K, G, S, N, D = 2, 3, 2, 5, 11, 8
C = N + S


def _inputs(seed=0, empty=3):
    """Random candidates with some empty cache slots, a padded query, and normalised attention."""
    rng = np.random.RandomState(seed)
    k = rng.randn(B, K, C, D).astype(np.float32)
    v = rng.randn(B, K, C, D).astype(np.float32)
    pos = np.empty((B, K, C), np.int32)
    for b in range(B):
        for h in range(K):
            pos[b, h, :N] = rng.permutation(40)[:N]  # old tokens, arbitrary slot order
            pos[b, h, rng.choice(N, empty, replace=False)] = -1
    q_pos = np.array([[40, 41, 42, 43, 44], [40, 41, 42, -1, -1]], np.int32)  # row 1 ends early
    pos[:, :, N:] = q_pos[:, None, :]
    probs = rng.rand(B, K, G, S, C).astype(np.float32)
    probs *= (pos >= 0)[:, :, None, None, :]
    probs /= probs.sum(-1, keepdims=True)
    acc = rng.rand(B, K, C).astype(np.float32)
    return k, v, pos, probs, q_pos, acc


def _ref_scores(name, k, v, pos, probs, q_pos, acc, budget, **kw):
    """Plain NumPy, head by head, loops where it is clearer."""
    out = np.zeros((B, K, C), np.float64)
    for b in range(B):
        valid_q = np.flatnonzero(q_pos[b] >= 0)
        last_q, last_pos = valid_q[-1], q_pos[b].max()
        for h in range(K):
            val = pos[b, h] >= 0
            kk, vv = k[b, h].astype(np.float64), v[b, h].astype(np.float64)
            vbar, kbar = vv[val].mean(0), kk[val].mean(0)
            ku = kk / np.linalg.norm(kk, axis=1, keepdims=True)
            anchor = ku[val].mean(0)
            cos = lambda x, a: x @ a / (np.linalg.norm(x, axis=1) * np.linalg.norm(a))  # noqa: E731
            recent = lambda w, b=b, h=h, last_pos=last_pos: pos[b, h] > last_pos - w  # noqa: E731
            if name == "valuediff":
                s = np.linalg.norm(vv - vbar, axis=1)
            elif name == "valuediff_dir":
                s = 1 - cos(vv, vbar)
            elif name == "valuediff_norm":
                s = np.linalg.norm(vv, axis=1)
            elif name == "keydiff":
                s = -cos(kk, anchor)
            elif name == "keynorm":
                s = -np.linalg.norm(kk, axis=1)
            elif name == "manifoldkv":
                s = np.linalg.norm(kk - kbar, axis=1)
            elif name == "streaming":
                s = np.where(pos[b, h] < kw.get("n_sink", 4), np.inf, pos[b, h])
            elif name == "tova":
                s = probs[b, :, :, last_q].mean(axis=(0, 1))
            elif name == "fastcaote":
                a = probs[b, h, :, last_q].mean(0)
                s = a / (1 - a) * np.linalg.norm(vv - vbar, axis=1)
            elif name == "h2o":
                s = np.where(recent(budget // 2), np.inf, acc[b, h])
            elif name == "hybrid":  # per-head weights of layer 0: z-scored mix, exact scores at w = 1 / 0
                w = kw["mix"][0][h]
                vd, kd = np.linalg.norm(vv - vbar, axis=1), -cos(kk, anchor)
                z = lambda x, val=val: (x - x[val].mean()) / np.sqrt(x[val].var() + 1e-12)  # noqa: E731
                s = vd if w == 1 else kd if w == 0 else w * z(vd) + (1 - w) * z(kd)
            elif name == "snapkv":
                w = kw.get("window", 32)
                win = [i for i in valid_q if q_pos[b, i] > last_pos - w]
                votes = probs[b, h][:, win].sum(1).mean(0)
                order = sorted(np.flatnonzero(val), key=lambda j: pos[b, h, j])
                pooled = np.full(C, -np.inf)
                if kw.get("pooling", "max") == "max":
                    for r, j in enumerate(order):
                        pooled[j] = max(votes[order[i]] for i in range(max(0, r - 3), min(len(order), r + 4)))
                else:  # torch avg_pool1d(kernel 5, padding 2, count_include_pad): zeros beyond both ends
                    padded = np.concatenate([np.zeros(2), votes[order], np.zeros(2)])
                    for r, j in enumerate(order):
                        pooled[j] = padded[r:r + 5].sum() / 5
                s = np.where(recent(w), np.inf, pooled)
            elif name == "pyramidkv":  # kvpress's SnapKVPress.score: avg-pooled over the non-window keys only
                w = kw["window_size"]
                win = [i for i in valid_q if q_pos[b, i] > last_pos - w]
                votes = probs[b, h][:, win].sum(1).mean(0)
                outside = sorted((j for j in np.flatnonzero(val) if not recent(w)[j]),
                                 key=lambda j: pos[b, h, j])
                padded = np.concatenate([np.zeros(2), votes[outside], np.zeros(2)])
                pooled = np.zeros(C)
                for r, j in enumerate(outside):
                    pooled[j] = padded[r:r + 5].sum() / 5
                s = np.where(recent(w), np.inf, pooled)
            else:
                raise KeyError(f"no NumPy reference for {name!r}: add one here or in tests/test_scorers.py")
            out[b, h] = s
    return out


# the policies `_ref_scores` has a reference for, and those tests/test_scorers.py has (its REFERENCED)
REFERENCED = ("valuediff", "valuediff_dir", "valuediff_norm", "keydiff", "keynorm", "manifoldkv", "streaming",
              "tova", "fastcaote", "h2o", "hybrid", "snapkv", "pyramidkv")
ELSEWHERE = ("expected_attention", "cur", "random", "lagkv", "leverage", "qfilter", "compactor", "kvzip")
POLICY_NAMES = [n for n in vdjax.POLICIES if n != "dense"]


def _scorers_module():
    """tests/test_scorers.py (its REFERENCED: the registered policies it has NumPy references for)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return importlib.import_module("test_scorers")


def test_every_registered_policy_has_a_numpy_reference():
    """A policy registered without a reference fails here (and in test_score_matches_numpy, which runs every
    registered policy but those tests/test_scorers.py covers)."""
    elsewhere = _scorers_module().REFERENCED
    assert set(elsewhere) == set(ELSEWHERE) and not set(REFERENCED) & set(elsewhere)
    known = set(REFERENCED) | set(elsewhere)
    registered = set(POLICY_NAMES)
    assert registered == known, (f"without a reference: {sorted(registered - known)}; references of "
                                 f"unregistered policies: {sorted(known - registered)}")
    for name in elsewhere:  # tests/test_scorers.py has a test_<name>_... for each
        assert any(t.startswith(f"test_{name}_") for t in dir(_scorers_module())), name
HYBRID_W = ((0.3, 1.0, 0.0),)  # layer 0: a mix, pure ValueDiff, pure KeyDiff (K = 3 heads)


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n not in ELSEWHERE])
def test_score_matches_numpy(name):
    k, v, pos, probs, q_pos, acc = _inputs()
    kw = {"snapkv": {"window": 3}, "hybrid": {"mix": HYBRID_W}, "pyramidkv": {"window_size": 3}}.get(name, {})
    attn = P.AttnInfo(jnp.asarray(probs), jnp.asarray(q_pos), jnp.asarray(acc))
    got = np.asarray(vdjax.get_policy(name)(k, v, attn, jnp.asarray(pos), slots=N, **kw))
    ref = _ref_scores(name, k, v, pos, probs, q_pos, acc, N, **kw)
    valid = pos >= 0
    np.testing.assert_allclose(got[valid], ref[valid], rtol=2e-5, atol=1e-6)


def test_snapkv_avg_pooling_matches_numpy_and_binds_its_kernel():
    """pooling="avg" is SnapKV's / kvpress's avg_pool1d over 5; kernel=None resolves per pooling."""
    k, v, pos, probs, q_pos, acc = _inputs(seed=2)
    attn = P.AttnInfo(jnp.asarray(probs), jnp.asarray(q_pos), jnp.asarray(acc))
    pol = vdjax.get_policy("snapkv")
    got = np.asarray(pol(k, v, attn, jnp.asarray(pos), slots=N, window=3, pooling="avg"))
    ref = _ref_scores("snapkv", k, v, pos, probs, q_pos, acc, N, window=3, pooling="avg")
    valid = pos >= 0
    np.testing.assert_allclose(got[valid], ref[valid], rtol=2e-5, atol=1e-6)
    mx = np.asarray(pol(k, v, attn, jnp.asarray(pos), slots=N, window=3))
    assert not np.allclose(mx[valid & np.isfinite(mx)], got[valid & np.isfinite(mx)])
    assert dict(pol.bind_hyper(None, pol.hyper())) == {"kernel": 7, "pooling": "max", "window": 32}
    avg = {"kernel": 5, "pooling": "avg", "window": 32}
    assert dict(pol.bind_hyper(None, pol.hyper(pooling="avg"))) == avg
    assert dict(pol.bind_hyper(None, pol.hyper(pooling="avg", kernel=9)))["kernel"] == 9
    with pytest.raises(ValueError, match="pooling must be one of \\['avg', 'max'\\], got 'mean'"):
        pol.bind_hyper(None, pol.hyper(pooling="mean"))


@pytest.mark.parametrize("name", ["valuediff", "valuediff_dir", "keydiff", "manifoldkv", "fastcaote"])
def test_invalid_slots_do_not_change_means(name):
    """Garbage in empty slots must not move the scores of valid ones."""
    k, v, pos, probs, q_pos, acc = _inputs(seed=1)
    attn = P.AttnInfo(jnp.asarray(probs), jnp.asarray(q_pos), jnp.asarray(acc))
    k2, v2 = k.copy(), v.copy()
    k2[pos < 0] = 1e3
    v2[pos < 0] = -1e3
    pol = vdjax.get_policy(name)
    a = np.asarray(pol(k, v, attn, jnp.asarray(pos), slots=N))
    b = np.asarray(pol(k2, v2, attn, jnp.asarray(pos), slots=N))
    np.testing.assert_allclose(a[pos >= 0], b[pos >= 0], rtol=1e-6)


def _ref_keep(scores, pos, budget):
    """Keep the top `budget` valid candidates by (score desc, position asc)."""
    keep = np.zeros_like(pos, bool)
    for idx in np.ndindex(pos.shape[:-1]):
        cands = [j for j in range(pos.shape[-1]) if pos[idx][j] >= 0]
        cands.sort(key=lambda j: (-scores[idx][j], pos[idx][j]))
        keep[idx][cands[:budget]] = True
    return keep


def test_keep_mask_ties_keep_earlier_position():
    pos = np.array([[5, 2, 9, -1, 7, 3]], np.int32)
    scores = np.array([[1.0, 1.0, 1.0, 9.0, 1.0, 0.5]], np.float32)
    keep = np.asarray(vc.keep_mask(jnp.asarray(scores), jnp.asarray(pos), 3))
    assert keep.tolist() == [[True, True, False, False, True, False]]  # positions 2, 5, 7 of the 1.0 ties


@pytest.mark.parametrize("budget", [1, 4, 9, 13, 30])
def test_keep_mask_matches_reference(budget):
    rng = np.random.RandomState(budget)
    pos = np.stack([rng.permutation(60)[:C] for _ in range(B * K)]).reshape(B, K, C).astype(np.int32)
    pos[rng.rand(B, K, C) < 0.2] = -1
    scores = rng.randint(0, 4, size=(B, K, C)).astype(np.float32)  # many ties
    scores[0, 0, 0] = np.inf
    keep = np.asarray(vc.keep_mask(jnp.asarray(scores), jnp.asarray(pos), budget))
    np.testing.assert_array_equal(keep, _ref_keep(scores, pos, budget))


def test_single_destination_is_the_keep_mask_minimum():
    rng = np.random.RandomState(3)
    for trial in range(20):
        pos = rng.permutation(50)[: N + 1].astype(np.int32)[None, None]
        if trial % 3 == 0:
            pos[0, 0, rng.choice(N, 2, replace=False)] = -1
        scores = rng.randint(0, 3, size=(1, 1, N + 1)).astype(np.float32)
        victim = int(vc.single_destination(jnp.asarray(scores), jnp.asarray(pos), N)[0, 0])
        keep = _ref_keep(scores, pos, N)
        gone = np.flatnonzero(~keep[0, 0])
        assert victim in gone


def test_topk_gather_and_slot_replacement_agree():
    k, v, pos, probs, q_pos, acc = _inputs(seed=4)
    scores = np.asarray(vdjax.get_policy("valuediff")(k, v, None, jnp.asarray(pos), slots=N))
    gk, gv, gp = (np.asarray(x) for x in vc.topk_gather(k, v, jnp.asarray(pos), scores, N))
    keep = np.asarray(vc.keep_mask(jnp.asarray(scores), jnp.asarray(pos), N))
    old_pos, dest = (np.asarray(x) for x in vc.block_destinations(jnp.asarray(keep), jnp.asarray(pos), N))
    slot_pos = np.asarray(vc.scatter_slots(jnp.asarray(old_pos), jnp.asarray(dest),
                                           jnp.asarray(pos[..., N:])))
    slot_k = np.asarray(vc.scatter_slots(jnp.asarray(k[..., :N, :]), jnp.asarray(dest),
                                         jnp.asarray(k[..., N:, :])))
    for b in range(B):
        for h in range(K):
            assert sorted(gp[b, h][gp[b, h] >= 0]) == sorted(pos[b, h][keep[b, h]])
            assert sorted(slot_pos[b, h][slot_pos[b, h] >= 0]) == sorted(pos[b, h][keep[b, h]])
            for j in np.flatnonzero(slot_pos[b, h] >= 0):  # every slot holds the key of its position
                src = np.flatnonzero(pos[b, h] == slot_pos[b, h, j])[0]
                np.testing.assert_array_equal(slot_k[b, h, j], k[b, h, src])
            kept_old = keep[b, h, :N]  # kept cache slots never move
            np.testing.assert_array_equal(slot_pos[b, h][kept_old], pos[b, h, :N][kept_old])


def test_protect_and_combine():
    k, v, pos, probs, q_pos, acc = _inputs(seed=5)
    attn = P.AttnInfo(jnp.asarray(probs), jnp.asarray(q_pos), jnp.asarray(acc))
    jpos = jnp.asarray(pos)
    base = np.asarray(vdjax.get_policy("valuediff")(k, v, attn, jpos, slots=N))
    sinks = np.asarray(vdjax.get_policy("valuediff+sinks12")(k, v, attn, jpos, slots=N))
    assert np.all(np.isposinf(sinks[(pos >= 0) & (pos < 12)]))
    np.testing.assert_array_equal(sinks[pos >= 12], base[pos >= 12])
    recent = np.asarray(vdjax.protect_recent("keynorm", 3)(k, v, attn, jpos, slots=N))
    assert np.all(np.isposinf(recent[pos > q_pos.max(1)[:, None, None] - 3]))
    # a single standardised policy keeps the same set; weights mix z-scores
    one = vdjax.combine({"valuediff": 2.0})
    keep_a = np.asarray(vc.keep_mask(jnp.asarray(base), jpos, 6))
    keep_b = np.asarray(vc.keep_mask(one(k, v, attn, jpos, slots=N), jpos, 6))
    np.testing.assert_array_equal(keep_a, keep_b)
    mix = np.asarray(vdjax.combine({"valuediff": 0.5, "keydiff": 0.5})(k, v, attn, jpos, slots=N))
    kd = np.asarray(vdjax.get_policy("keydiff")(k, v, attn, jpos, slots=N))

    def z(s):
        out = np.zeros_like(s)
        for idx in np.ndindex(s.shape[:-1]):
            m = pos[idx] >= 0
            out[idx][m] = (s[idx][m] - s[idx][m].mean()) / s[idx][m].std()
        return out

    valid = pos >= 0
    np.testing.assert_allclose(mix[valid], (0.5 * z(base) + 0.5 * z(kd))[valid], rtol=1e-4, atol=1e-5)


def test_policy_lookup_errors():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        vdjax.get_policy("nope")
    with pytest.raises(TypeError, match="n_sink"):
        vdjax.get_policy("valuediff").hyper(n_sink=3)
    assert vdjax.get_policy("streaming").hyper(n_sink=2) == (("n_sink", 2),)
    with pytest.raises(TypeError, match="policy must be"):
        vdjax.get_policy(3)
    with pytest.raises(ValueError, match="protect_sinks needs an evicting policy, got 'dense'"):
        vdjax.get_policy("dense+sinks4")


def test_jit_equals_eager_scores():
    """Every registered policy, given all an AttnInfo holds (the queries and their statistics, a per-token
    feature (compactor's tile attention, kvzip's replay scores) too)."""
    k, v, pos, probs, q_pos, acc = _inputs(seed=6)
    queries = np.random.RandomState(6).randn(B, S, K * G, D).astype(np.float32)
    stats = QueryStats.of(jnp.asarray(queries), jnp.asarray(q_pos >= 0))
    inv_freq = jnp.asarray((1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32))
    feature = jnp.asarray(np.random.RandomState(16).rand(B, K, C).astype(np.float32))
    attn = P.AttnInfo(jnp.asarray(probs), jnp.asarray(q_pos), jnp.asarray(acc),
                      queries=jnp.asarray(queries), stats=stats, inv_freq=inv_freq, feature=feature)

    def jit_scores(pol, kw):
        return jax.jit(lambda a, b, c, d: pol(a, b, c, d, slots=N, **kw))

    # the keywords a policy cannot run without (a saved mix or filters in a checkpoint, none here)
    needed = {"hybrid": {"mix": HYBRID_W},
              "qfilter": {"filters": np.random.RandomState(7).randn(1, K, D).round(3).tolist()},
              # compactor's defaults (8 + 4 protected) leave 3 to 8 free candidates a head, fewer than D + 1:
              # their leverages all tie at 1 - 1/n but for the ridge, and the z-score blows fp32 rounding up
              # (jit and eager differ by 6e-5); fewer sinks and a sketch of 3 columns leave it well posed
              "compactor": {"sink_size_start": 2, "sink_size_end": 1, "sketch_dimension": 3},
              # the same for leverage's 3 to 12 candidates a head against 48 sketch columns
              "leverage": {"sketch_dimension": 3}}
    for name in POLICY_NAMES:
        pol = vdjax.get_policy(name)
        kw = needed.get(name, {})
        eager = pol(k, v, attn, jnp.asarray(pos), slots=N, **kw)
        jitted = jit_scores(pol, kw)(k, v, attn, jnp.asarray(pos))
        chex.assert_shape([eager, jitted], (B, K, C))
        chex.assert_trees_all_close(jitted, eager, rtol=1e-5, atol=1e-6, custom_message=name)


def test_register_refuses_to_replace_a_builtin_unless_asked():
    own = P.Policy("keynorm", lambda k, v, attn, pos, **_: -P._norm(k))
    with pytest.raises(ValueError, match="policy 'keynorm' is built in; pass replace=True"):
        vdjax.register(own)
    with pytest.raises(TypeError, match="register takes a vdjax Policy"):
        vdjax.register("keynorm")
    builtin = vdjax.POLICIES["keynorm"]
    try:
        assert vdjax.register(own, replace=True) is own and vdjax.get_policy("keynorm") is own
    finally:
        vdjax.register(builtin, replace=True)
    mine = vdjax.register(P.Policy("mine", lambda k, v, attn, pos, **_: -P._norm(k)))
    try:
        assert vdjax.register(dataclasses.replace(mine)) is not mine  # your own policy: replaced freely
    finally:
        del vdjax.POLICIES["mine"]

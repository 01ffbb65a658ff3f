"""Block prefill + decode eviction: no-op at full budget, the design invariants (exactly min(N, seen) valid
slots, unique positions), batching, compile reuse, errors."""

import threading

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vdjax
from vdjax.engine import api, compiler, evict, forms, inputs, placement, programs
from vdjax.engine.timing import count_compiles
from vdjax.models import transformer as tf

from helpers import layer0_kv, policy_kwargs, random_ids, random_params, tiny_config

POLICY_NAMES = [n for n in vdjax.POLICIES if n != "dense"]
T, NEW = 40, 8


@pytest.fixture(scope="module")
def model():
    return random_params(tiny_config(), seed=1)


@pytest.fixture(scope="module")
def prompts(model):
    """Two rows of different lengths (ragged), so the batch path and padding are always exercised."""
    return [random_ids(T, model.config.vocab_size, 1), random_ids(T - 9, model.config.vocab_size, 2)]


@pytest.fixture(scope="module")
def dense_tokens(model, prompts):
    return vdjax.generate(model, prompts, policy="dense", max_new_tokens=NEW)


def test_dense_prefill_equals_plain_forward(model, prompts):
    ids = prompts[0][None]
    full = np.asarray(tf.forward(model, jnp.asarray(ids)))
    for block in (1, 7, 64):
        _, last = vdjax.prefill(model, ids, policy="dense", block_size=block)
        np.testing.assert_allclose(np.asarray(last)[0], full[0, -1], rtol=1e-5, atol=1e-5)


def test_dense_greedy_equals_step_by_step_forward(model, prompts, dense_tokens):
    """The dense decode loop is exactly greedy decoding with a growing plain forward."""
    fwd = jax.jit(tf.forward)
    for row, ids in enumerate(prompts):
        seq = list(ids)
        for _ in range(NEW):  # right padding never changes earlier logits of a causal model: one compile
            padded = np.zeros((1, T + NEW), np.int32)
            padded[0, : len(seq)] = seq
            seq.append(int(np.argmax(np.asarray(fwd(model, jnp.asarray(padded)))[0, len(seq) - 1])))
        assert dense_tokens[row].tolist() == seq[len(ids):]


@pytest.mark.parametrize("block", [1, 7, 64])  # 64 >= T + NEW: the whole prompt in one block
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_full_budget_is_dense(model, prompts, dense_tokens, name, block):
    out = vdjax.generate(model, prompts, policy=name, budget=T + NEW, block_size=block, max_new_tokens=NEW,
                         **policy_kwargs(name, model))
    np.testing.assert_array_equal(out, dense_tokens)


def _check_slots(pos: np.ndarray, seen: np.ndarray, budget: int):
    """pos [L, B, K, N]: exactly min(N, seen[b]) valid unique positions per head, all < seen."""
    chex.assert_rank(pos, 4)
    chex.assert_axis_dimension(pos, 1, len(seen))
    for layer, b, h in np.ndindex(pos.shape[:3]):
        p = pos[layer, b, h]
        valid = p[p >= 0]
        assert len(valid) == min(budget, seen[b]), (layer, b, h, len(valid))
        assert len(set(valid.tolist())) == len(valid)
        assert valid.max() < seen[b]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_budget_after_every_block_and_step(model, name):
    """Rows of lengths 8, 16, ... show the cache after each block; generation then after each step."""
    budget, block = 12, 8
    rows = [random_ids(40, model.config.vocab_size, 3)[:n] for n in (5, 8, 16, 24, 32, 37)]
    cache, _ = vdjax.prefill(model, rows, policy=name, budget=budget, block_size=block,
                             **policy_kwargs(name, model))
    lengths = np.array([len(r) for r in rows])
    _check_slots(np.asarray(cache.pos), lengths, budget)
    for new in (2, 5):
        g = vdjax.run(model, rows, policy=name, budget=budget, block_size=block, max_new_tokens=new,
                      **policy_kwargs(name, model))
        _check_slots(np.asarray(g.cache.pos), lengths + new - 1, budget)


def test_rows_evict_independently(model):
    """Each row of a batch keeps exactly what it keeps alone (ragged lists and left-padded masks alike)."""
    rows = [random_ids(37, model.config.vocab_size, 5), random_ids(21, model.config.vocab_size, 6)]
    batch = vdjax.run(model, rows, policy="valuediff", budget=10, block_size=8, max_new_tokens=6)
    width = 37
    left = np.zeros((2, width), np.int32)
    mask = np.zeros((2, width), np.int32)
    for r, ids in enumerate(rows):
        left[r, width - len(ids):] = ids
        mask[r, width - len(ids):] = 1
    padded = vdjax.run(model, left, policy="valuediff", budget=10, block_size=8, max_new_tokens=6,
                       attention_mask=mask)
    np.testing.assert_array_equal(padded.tokens, batch.tokens)
    for r, ids in enumerate(rows):
        alone = vdjax.run(model, ids, policy="valuediff", budget=10, block_size=8, max_new_tokens=6)
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[r])
        for layer in range(model.config.num_layers):
            for h in range(model.config.num_kv_heads):
                together = np.asarray(batch.cache.pos)[layer, r, h]
                assert sorted(np.asarray(alone.cache.pos)[layer, 0, h]) == sorted(together)


@pytest.mark.parametrize("name,sign", [("keynorm", -1.0), ("valuediff_norm", 1.0)])
def test_layer0_keeps_global_topn_of_token_local_score(name, sign):
    """Layer 0 sees the full prompt's k/v under block processing: its kept set is the global top-N.

    Distinct tokens: a repeated token's keys differ only by RoPE, which keeps norms, so its norms tie exactly
    and rounding, not the score, would pick the survivor."""
    model = random_params(tiny_config(num_layers=1, vocab_size=256), seed=2)
    ids = np.random.RandomState(7).permutation(256)[:150].astype(np.int32)
    budget = 23
    cache, _ = vdjax.prefill(model, ids, policy=name, budget=budget, block_size=16)
    k, v = layer0_kv(model, ids)
    x = k if name == "keynorm" else v
    score = sign * np.linalg.norm(x, axis=-1)  # [K, T]
    for h in range(model.config.num_kv_heads):
        order = sorted(range(len(ids)), key=lambda j: (-score[h, j], j))
        assert sorted(np.asarray(cache.pos)[0, 0, h].tolist()) == sorted(order[:budget])


def test_jit_and_eager_agree(model, prompts):
    ids = prompts[1]
    for name in ("valuediff", "snapkv", "h2o"):
        jc, jl = vdjax.prefill(model, ids, name, 9, 8)
        with jax.disable_jit():
            ec, el = vdjax.prefill(model, ids, name, 9, 8)
        np.testing.assert_array_equal(np.asarray(jc.pos), np.asarray(ec.pos))
        np.testing.assert_allclose(np.asarray(jl), np.asarray(el), rtol=1e-4, atol=1e-5)


def test_same_bucket_compiles_nothing_new(model):
    vocab = model.config.vocab_size
    with count_compiles() as first:
        vdjax.prefill(model, random_ids(100, vocab, 1), policy="keydiff", budget=16,
                      block_size=16)  # 7 -> 8 blocks
    with count_compiles() as again:
        vdjax.prefill(model, random_ids(120, vocab, 2), policy="keydiff", budget=16,
                      block_size=16)  # 8 blocks
        vdjax.prefill(model, random_ids(113, vocab, 3), policy="keydiff", budget=16, block_size=16)
    assert first.value >= 1 and again.value == 0
    program = api.compile_prefill(model, random_ids(200, vocab, 4), "keydiff", 16, 16)  # 13 -> 16 blocks
    assert program.plan.tokens.shape[1] == 16 * 16
    with count_compiles() as after_warm:
        cache, logits = vdjax.prefill(model, random_ids(250, vocab, 5), policy="keydiff", budget=16,
                                      block_size=16)
    assert after_warm.value == 0  # compile_prefill warmed the 16-block program
    np.testing.assert_array_equal(np.asarray(program()[1]), np.asarray(
        vdjax.prefill(model, random_ids(200, vocab, 4), policy="keydiff", budget=16, block_size=16)[1]))
    assert [inputs.bucket(n) for n in (1, 2, 3, 4, 5, 7, 9, 13, 17, 25)] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


def _started(thread):
    thread.start()
    return thread


def test_compile_behind_compiles_once_for_the_later_call(model, prompts, monkeypatch):
    """The decode program compiled in a thread while the prefill runs is the one the call then uses: a run
    compiles as many programs with the thread as without it, and gives the same tokens."""
    f = jax.jit(lambda a, *, k: a * k, static_argnames="k")
    x = jnp.arange(3.0)
    behind = compiler.BackgroundCompiler()
    behind.submit(f, (x,), {"k": 2}).join()
    with count_compiles() as n:
        np.testing.assert_array_equal(np.asarray(f(x, k=2)), [0.0, 2.0, 4.0])
    assert n.value == 0 and len(behind.compiled) == 1
    behind.submit(f, (x,), {"k": 2})  # seen before: nothing to do
    behind.join()
    assert len(behind.compiled) == 1 and not any(t.is_alive() for t in behind.threads)
    behind.submit(f, ("not an array",), {"k": 2}).join()  # fails in the thread, silently
    assert len(behind.compiled) == 1
    with pytest.raises(TypeError):
        f("not an array", k=2)  # ... and the call itself raises

    def counted(budget):
        with count_compiles() as n:
            tokens = vdjax.generate(model, prompts, "keynorm", budget, 8, max_new_tokens=NEW)
        return n.value, tokens

    counted(17)  # the small programs every first run compiles (key, staging) out of the way
    with_thread = counted(19)
    monkeypatch.setattr(compiler.BACKGROUND, "submit", lambda *a: _started(threading.Thread()))
    without = counted(18)
    assert with_thread[0] == without[0] >= 2
    monkeypatch.undo()
    np.testing.assert_array_equal(counted(19)[1], with_thread[1])


def test_eos_stops_and_pads(model, prompts, dense_tokens):
    eos = int(dense_tokens[0, 2])
    out = vdjax.generate(model, prompts[0], policy="dense", max_new_tokens=NEW, eos_token_id=eos)
    first = dense_tokens[0].tolist().index(eos)
    assert out[0, : first + 1].tolist() == dense_tokens[0, : first + 1].tolist()
    assert out.shape[1] == first + 1  # nothing else to generate: the loop stopped


def test_sampling_is_keyed(model, prompts):
    kw = dict(policy="valuediff", budget=16, max_new_tokens=6, temperature=0.8)
    a = vdjax.generate(model, prompts[0], key=jax.random.key(1), **kw)
    b = vdjax.generate(model, prompts[0], key=jax.random.key(1), **kw)
    np.testing.assert_array_equal(a, b)
    greedy = vdjax.generate(model, prompts[0], policy="valuediff", budget=16, max_new_tokens=6)
    top1 = vdjax.generate(model, prompts[0], key=jax.random.key(2), top_k=1, **kw)
    np.testing.assert_array_equal(top1, greedy)
    nucleus = vdjax.generate(model, prompts[0], key=jax.random.key(2), top_p=1e-6, **kw)
    np.testing.assert_array_equal(nucleus, greedy)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(policy="bogus", budget=8), ValueError, "unknown policy 'bogus'"),
        (dict(policy="valuediff", budget=0), ValueError, "budget must be an integer >= 1, got 0"),
        (dict(policy="valuediff", budget=None), ValueError, "needs budget"),
        (dict(policy="valuediff", budget=8, block_size=0), ValueError,
         "block_size must be an integer >= 1, got 0"),
        (dict(policy="valuediff", budget=8, max_new_tokens=0), ValueError, "max_new_tokens must be"),
        (dict(policy="valuediff", budget=8, n_sink=2), TypeError, "unknown keyword"),
        (dict(policy="valuediff", budget=8, temperature=1.0), ValueError, "explicit key"),
        (dict(policy="valuediff", budget=8, top_p=0.0), ValueError, "top_p must be in"),
    ],
)
def test_bad_arguments(model, prompts, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        vdjax.generate(model, prompts[0], **kwargs)


def test_bad_ids(model):
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match="at least one token"):
        vdjax.generate(model, [], policy="valuediff", budget=8)
    with pytest.raises(ValueError, match=rf"out-of-vocabulary id\(s\) \[{vocab}\]; allowed 0..{vocab - 1}"):
        vdjax.generate(model, [1, 2, vocab], policy="valuediff", budget=8)
    with pytest.raises(ValueError, match="out-of-vocabulary"):
        vdjax.prefill(model, [[1, -3]], policy="valuediff", budget=8)
    with pytest.raises(TypeError, match="integers"):
        vdjax.generate(model, [1.5, 2.0], policy="valuediff", budget=8)
    with pytest.raises(ValueError, match="holes"):
        vdjax.generate(model, [[1, 2, 3]], attention_mask=[[1, 0, 1]], policy="valuediff", budget=8)
    with pytest.raises(TypeError, match="params must be"):
        vdjax.generate({"embed": 1}, [1, 2], policy="valuediff", budget=8)


def test_question_agnostic_protocol(model):
    """The question is appended after the context was cut to N: kept whole, never scored away; with room for
    everything it is the dense continuation of context + question."""
    ids, q = random_ids(70, model.config.vocab_size), random_ids(9, model.config.vocab_size, seed=1)
    dense = vdjax.generate(model, np.concatenate([ids, q]), "dense", max_new_tokens=6, eos_token_id=[])
    for name in ("dense", "valuediff", "snapkv"):
        out = vdjax.run(model, ids, name, budget=None if name == "dense" else 120, block_size=16,
                        max_new_tokens=6, eos_token_id=[], question=q)
        np.testing.assert_array_equal(out.tokens, dense, err_msg=name)
    out = vdjax.run(model, [ids, ids[:50]], "valuediff", budget=20, block_size=16, max_new_tokens=3,
                    eos_token_id=[], question=[q, q[::-1]])
    assert out.budget == 20 and set(out.slots) == {20 + inputs.QUESTION_PAD}
    for lc in out.cache.layers:
        pos = np.asarray(lc.pos)
        for row, t in ((0, 70), (1, 50)):
            for head in pos[row]:
                kept = set(head[head >= 0].tolist())
                assert set(range(t, t + 9 + 2)) <= kept  # question and decoded tokens all present
                assert len(kept - set(range(t, t + 11))) == 20  # the context holds exactly N


@pytest.mark.parametrize("question, match", [([[1, 2], [3]], "one length"), ([], "non-empty"),
                                             ([[1, 2]] * 3, "rows")])
def test_bad_question(model, question, match):
    with pytest.raises(ValueError, match=match):
        vdjax.run(model, [[1, 2, 3], [4, 5, 6]], "valuediff", budget=8, question=question)


def test_min_new_tokens_masks_eos(model, prompts, dense_tokens):
    """EOS = the dense first token: it stops at once, unless min_new_tokens
    forbids EOS for the first tokens."""
    first = int(dense_tokens[0, 0])
    out = vdjax.run(model, prompts[0], "valuediff", budget=T + NEW, max_new_tokens=NEW, eos_token_id=[first])
    assert out.tokens.tolist() == [[first]]
    out = vdjax.run(model, prompts[0], "valuediff", budget=T + NEW, max_new_tokens=NEW, eos_token_id=[first],
                    min_new_tokens=2)
    assert out.tokens[0, 0] != first and first not in out.tokens[0, :2].tolist()
    with pytest.raises(ValueError, match="min_new_tokens"):
        vdjax.run(model, prompts[0], "valuediff", budget=8, max_new_tokens=2, min_new_tokens=3)


def test_continuation_logprobs_dense_are_the_plain_forward(model, prompts):
    """Dense teacher forcing: log-softmax of a plain forward over prompt +
    continuation, position by position."""
    cont = random_ids(6, model.config.vocab_size, 7)
    ids = prompts[0][None]
    got = vdjax.continuation_logprobs(model, ids, list(cont), "dense", block_size=16)
    full = np.concatenate([ids[0], cont])[None]
    logits = np.asarray(tf.forward(model, jnp.asarray(full)), np.float64)[0, len(ids[0]) - 1 : -1]  # [C, V]
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                             keepdims=True)) - logits.max(-1,
                                                                                                          keepdims=True)
    np.testing.assert_allclose(got[0], ref[np.arange(6), cont], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["valuediff", "tova", "h2o"])
def test_continuation_logprobs_follow_decode_eviction(model, prompts, name):
    """Under eviction, teacher forcing the greedy output reproduces decode: at step j every vocabulary token,
    fed after the greedy prefix, gets a distribution summing to one whose argmax is the greedy token."""
    budget, j = 24, 3
    greedy = vdjax.generate(model, prompts[0][None], name, budget, block_size=8, max_new_tokens=NEW)[0]
    v = model.config.vocab_size
    conts = np.tile(greedy[: j + 1], (v, 1))
    conts[:, j] = np.arange(v)  # row t: the greedy prefix, then token t at step j
    lp = vdjax.continuation_logprobs(model, np.tile(prompts[0], (v, 1)), [list(r) for r in conts], name,
                                     budget,
                                     block_size=8)
    np.testing.assert_allclose(np.exp(lp[:, j].astype(np.float64)).sum(), 1.0, rtol=1e-4)
    assert int(np.argmax(lp[:, j])) == int(greedy[j])
    np.testing.assert_allclose(lp[:, :j], np.tile(lp[:1, :j], (v, 1)), rtol=1e-5, atol=1e-6)  # same prefix


@pytest.mark.parametrize("name", ["valuediff", "keydiff", "tova", "snapkv", "streaming", "h2o"])
@pytest.mark.parametrize("sliding", [False, True])
def test_causal_fill_before_the_first_eviction_equals_the_block_path(name, sliding, monkeypatch):
    """Evicting prefill runs the whole blocks before its first eviction as one causal pass: the same positions
    in the same slots, the same values and logits as block by block (ragged rows; a sliding layer shrinks the
    fill to its W - 1 slots); a policy that accumulates attention never takes it. Tokens do not repeat here:
    a repeated token's layer-0 value ties exactly, and at these tiny shapes XLA's one [2 x 64]-row projection
    and its [2 x 16]-row ones round differently (on SmolLM2's shapes they agree to
    the bit, so do the kept sets)."""
    cfg = tiny_config(num_layers=3, vocab_size=400, **(
        {"layer_types": ("sliding_attention", "full_attention", "sliding_attention"), "sliding_window": 60}
        if sliding else {}))
    params = random_params(cfg, seed=5)
    order = np.random.RandomState(1).permutation(cfg.vocab_size).astype(np.int32)
    ids = [order[:150], order[200:270]]
    policy = vdjax.bind(name, params, 64)
    per_layer = evict.cache_rule(policy).layer_slots(cfg, 64)
    fill = evict.fill_tokens(cfg, policy, per_layer, 16, 160)
    assert fill == (0 if name == "h2o" else 48 if sliding else 64)  # W - 1 = 59 slots: 3 whole blocks
    assert evict.fill_tokens(cfg, policy, per_layer, 16, 32) == (0 if name == "h2o" else 32)
    new = api.prefill(params, ids, name, budget=64, block_size=16, layer_scan=False)
    monkeypatch.setattr(programs, "fill_tokens", lambda *a: 0)
    programs.prefill_program.clear_cache()
    old = api.prefill(params, ids, name, budget=64, block_size=16, layer_scan=False)
    programs.prefill_program.clear_cache()
    for a, b in zip(new[0].layers, old[0].layers, strict=True):
        np.testing.assert_array_equal(a.pos, b.pos)
        np.testing.assert_allclose(a.k, b.k, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a.v, b.v, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new[1], old[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sinks,window,softcap", [(False, None, None), (True, 3, None), (False, None, 5.0)])
def test_one_token_attention_equals_numpy(sinks, window, softcap):
    """Decode's attention (one query token: P.V as multiply + reduce) equals a NumPy softmax over the cache
    slots + the new token: empty slots and future/out-of-window positions masked, learned sinks in the
    denominator, logit softcap; a 2-token block through the same function agrees on its first query."""
    cfg = tiny_config(attn_softcap=softcap)
    rng = np.random.RandomState(3)
    b, kh, nq, n, d = 2, cfg.num_kv_heads, cfg.num_heads, 6, cfg.head_dim
    g = nq // kh
    q = rng.randn(b, 1, nq, d).astype(np.float32)
    kc, vc = rng.randn(b, kh, n, d).astype(np.float32), rng.randn(b, kh, n, d).astype(np.float32)
    kn, vn = rng.randn(b, kh, 1, d).astype(np.float32), rng.randn(b, kh, 1, d).astype(np.float32)
    pos = np.array([[[0, 1, 2, -1, 4, 5], [3, -1, 1, 0, 5, 4]], [[2, 0, 1, 3, -1, -1], [0, 1, 2, 3, 4, 9]]],
                   np.int32)  # [B, K, N]; 9 is in row 1's future
    q_pos = np.array([[6], [5]], np.int32)
    sink = rng.randn(nq).astype(np.float32) if sinks else None
    out, probs = tf.attend(jnp.asarray(q), jnp.asarray(q_pos), jnp.asarray(kc), jnp.asarray(vc),
                           jnp.asarray(pos),
                           jnp.asarray(kn), jnp.asarray(vn), cfg, window,
                           None if sink is None else jnp.asarray(sink))
    kall, vall = np.concatenate([kc, kn], 2), np.concatenate([vc, vn], 2)  # [B, K, C, D]
    pall = np.concatenate([pos, np.broadcast_to(q_pos[:, None, :], (b, kh, 1))], 2)  # [B, K, C]
    want = np.zeros((b, 1, nq, d))
    for r in range(b):
        for h in range(nq):
            kv = h // g
            lg = kall[r, kv] @ q[r, 0, h] * cfg.attn_scale  # [C]
            if softcap:
                lg = np.tanh(lg / softcap) * softcap
            ok = (pall[r, kv] >= 0) & (pall[r, kv] <= q_pos[r, 0])
            if window is not None:
                ok &= q_pos[r, 0] - pall[r, kv] < window
            e = np.where(ok, np.exp(lg - lg[ok].max()), 0.0)
            den = e.sum() + (np.exp(sink[h] - lg[ok].max()) if sinks else 0.0)
            p = e / den
            np.testing.assert_allclose(np.asarray(probs)[r, kv, h % g, 0], p, rtol=1e-5, atol=1e-7)
            want[r, 0, h] = p @ vall[r, kv]
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    # the block path (S = 2, einsum) gives the first query the same output
    q2, qp2 = np.concatenate([q, q], 1), np.concatenate([q_pos, q_pos + 1], 1)
    out2, _ = tf.attend(jnp.asarray(q2), jnp.asarray(qp2), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(pos),
                        jnp.asarray(np.concatenate([kn, kn], 2)), jnp.asarray(np.concatenate([vn, vn], 2)),
                        cfg,
                        window, None if sink is None else jnp.asarray(sink))
    np.testing.assert_allclose(np.asarray(out2)[:, :1], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sinks,window,softcap,pre", [(False, None, None, 16.0), (True, None, None, 11.0),
                                                      (False, 7, None, 16.0), (False, None, 5.0, 16.0)])
def test_causal_attention_equals_numpy(sinks, window, softcap, pre):
    """Dense prefill's chunked causal attention equals a NumPy softmax per query over the keys it sees: rows
    left-padded across chunk boundaries (padding keys masked in the chunks below the diagonal too, padding
    queries 0), sliding window, learned sinks, softcap, and a scale that is (16^-0.5) or is not (11^-0.5) a
    power of two (the former is folded into q)."""
    cfg = tiny_config(attn_softcap=softcap, query_pre_attn_scalar=pre)
    scale = pre ** -0.5
    rng = np.random.RandomState(4)
    b, t, nq, kh, d, chunk = 3, 29, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 4
    g = nq // kh
    q = rng.randn(b, t, nq, d).astype(np.float32)
    k, v = rng.randn(b, t, kh, d).astype(np.float32), rng.randn(b, t, kh, d).astype(np.float32)
    pads = [0, 9, 14]  # row 1 and 2: padding spans whole chunks and ends inside one
    pos = np.stack([np.concatenate([-np.ones(p), np.arange(t - p)]) for p in pads]).astype(np.int32)
    sink = rng.randn(nq).astype(np.float32) if sinks else None
    out = np.asarray(tf.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos),
                                         cfg,
                                         window, chunk, None if sink is None else jnp.asarray(sink)))
    want = np.zeros((b, t, nq, d))
    for r in range(b):
        for i in range(t):
            if pos[r, i] < 0:
                continue  # padding query: 0
            for h in range(nq):
                lg = k[r, :, h // g] @ q[r, i, h] * scale  # [T]
                if softcap:
                    lg = np.tanh(lg / softcap) * softcap
                ok = (pos[r] >= 0) & (pos[r] <= pos[r, i])
                if window is not None:
                    ok &= pos[r, i] - pos[r] < window
                top = lg[ok].max() if not sinks else max(lg[ok].max(), sink[h])
                e = np.where(ok, np.exp(lg - top), 0.0)
                p = e / (e.sum() + (np.exp(sink[h] - top) if sinks else 0.0))
                want[r, i, h] = p @ v[r, :, h // g]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


PATTERNS = {  # layer types of one period
    "llama": (),
    "alternating": ("sliding_attention", "full_attention"),
    "gemma3": ("sliding_attention",) * 2 + ("full_attention",),  # Gemma3's 5 : 1 in small
}


@pytest.mark.parametrize("name,budget,pattern", [
    ("dense", None, "llama"), ("dense", None, "alternating"), ("dense", None, "gemma3"), ("valuediff", 64,
                                                                                          "llama"),
    ("snapkv", 64, "alternating"), ("h2o", 64, "alternating"), ("valuediff", 64, "gemma3"), ("h2o", 64,
                                                                                             "gemma3")])
def test_layer_scan_equals_unrolled_layers(name, budget, pattern):
    """`layer_scan=True` (the GPU/TPU default: the layers as a scan over groups of `layer_period` layers, in
    the causal pass, the block loop and decode) keeps the same positions and generates the same tokens as the
    unrolled layers, values and logits to rounding; with a sliding : full pattern the group is two layers,
    with Gemma3's (here 2 sliding : 1 full) three."""
    types = PATTERNS[pattern]
    cfg = tiny_config(num_layers=2 * max(1, len(types)), vocab_size=400,
                      **({"layer_types": types * 2, "sliding_window": 40} if types else {}))
    assert forms.layer_period(cfg) == max(1, len(types))
    params = random_params(cfg, seed=3)
    order = np.random.RandomState(2).permutation(cfg.vocab_size).astype(np.int32)
    ids = [order[:150], order[200:290]]  # ragged rows (150 and 90 tokens), both past N = 64
    runs = [vdjax.run(params, ids, name, budget, block_size=16, max_new_tokens=12, eos_token_id=[],
                      layer_scan=scan) for scan in (False, True)]
    np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
    for a, b in zip(runs[0].cache.layers, runs[1].cache.layers, strict=True):
        np.testing.assert_array_equal(a.pos, b.pos)
        np.testing.assert_allclose(a.k, b.k, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a.v, b.v, rtol=1e-5, atol=1e-5)
    pre = [api.prefill(params, ids, name, budget=budget, block_size=16, layer_scan=scan) for scan in (False,
                                                                                                      True)]
    np.testing.assert_allclose(pre[0][1], pre[1][1], rtol=1e-4, atol=1e-4)


def test_scan_form_stacks_once_and_is_what_scanned_programs_read(monkeypatch):
    """`forms.scan_form`: the layers stacked over groups of `layer_period` (leaf [L / p, ...] equal to layers
    j, j + p, ...), made once per params object (the same object back), read by the scanned programs (same
    tokens as unrolled plain params) and refused, with the argument named, by unrolled ones."""
    cfg = tiny_config(num_layers=4, vocab_size=400, layer_types=("sliding_attention", "full_attention") * 2,
                      sliding_window=40)
    params = random_params(cfg, seed=5)
    sf = forms.scan_form(params)
    assert forms.scan_form(params) is sf and "layers" not in sf.weights
    assert len(sf.weights["layer_groups"]) == 2
    for j in range(2):
        for name, leaf in sf.weights["layer_groups"][j].items():
            want = np.stack([np.asarray(params.weights["layers"][i][name]) for i in (j, j + 2)])
            np.testing.assert_array_equal(np.asarray(leaf), want)
    ids = np.random.RandomState(4).randint(0, cfg.vocab_size, 120).astype(np.int32)
    plain = vdjax.generate(params, ids, "valuediff", 48, 16, 8, eos_token_id=[], layer_scan=False)
    np.testing.assert_array_equal(vdjax.generate(sf, ids, "valuediff", 48, 16, 8, eos_token_id=[],
                                                 layer_scan=True),
                                  plain)
    with pytest.raises(ValueError, match="layer_scan=True"):
        vdjax.generate(sf, ids, "valuediff", 48, 16, 8, eos_token_id=[], layer_scan=False)
    monkeypatch.setattr(placement, "shard_params", None)  # refused before the mesh shards anything
    with pytest.raises(ValueError, match="layer_scan=True"):
        vdjax.generate(sf, ids, "valuediff", 48, 16, 8, eos_token_id=[], layer_scan=False,
                       mesh=vdjax.engine.sharding.make_mesh(data=1, model=1))


QWEN3_5_TINY = dict(family="qwen3_5", vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=8, norm_offset=1.0, qk_norm=True, attn_gate=True,
                    rotary_dim=4, layer_types=("linear_attention", "full_attention") * 2,
                    linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel=4,
                    eos_token_ids=(), max_position_embeddings=4096)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "qwen3_5_runs"])
def test_layer_scan_question_and_continuation(family):
    """The scanned programs pass the cache on stacked over layer groups (`forms.unstack` splits it at the
    end): the question-agnostic protocol (the stacked cache grown by the question's slots) and teacher-forced
    continuation log-probabilities equal the unrolled layers', on Llama and on Qwen3.5's Gated DeltaNet :
    gated-attention pattern (recurrent states in the stacked carry; also with 2 DeltaNet
    layers a period, as Qwen3.5's 3)."""
    from vdjax.models.config import ModelConfig

    runs = {"layer_types": (("linear_attention",) * 2 + ("full_attention",)) * 2, "num_layers": 6}
    cfg = (tiny_config(num_layers=4, vocab_size=400) if family == "llama" else
           ModelConfig(**(QWEN3_5_TINY | (runs if family == "qwen3_5_runs" else {}))))
    params = random_params(cfg, seed=5)
    order = np.random.RandomState(4).permutation(cfg.vocab_size).astype(np.int32)
    ids, question, cont = [order[:130], order[140:230]], order[300:311], order[320:330]
    runs = [vdjax.run(params, ids, "valuediff", 48, block_size=16, max_new_tokens=10, eos_token_id=[],
                      question=question, layer_scan=scan) for scan in (False, True)]
    np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
    assert len(runs[1].cache.layers) == cfg.num_layers and runs[0].budget == runs[1].budget == 48
    slots = tuple(48 + 32 if cfg.attends(i) else 0 for i in range(cfg.num_layers))
    assert runs[0].slots == runs[1].slots == slots
    for a, b in zip(runs[0].cache.layers, runs[1].cache.layers, strict=True):
        assert type(a) is type(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert x.shape == y.shape
            np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-4,
                                       atol=1e-4)
    lp = [api.continuation_logprobs(params, ids, cont, "keydiff", 48, 16, layer_scan=scan)
          for scan in (False, True)]
    np.testing.assert_allclose(lp[0], lp[1], rtol=1e-4, atol=1e-4)
    assert lp[0].shape == (2, len(cont)) and np.all(lp[0] < 0)

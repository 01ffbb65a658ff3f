"""`kv_quant`: a quantized cache (vdjax.engine.quant) composed with eviction in true block mode: what is
stored (codes and scales only, exact bytes), layer 0's codes against quantizing the unquantized keys and
values by hand, the invariants of DESIGN.md, every kind of policy, wrapper and family, and errors. (The
quantize / dequantize / packing arithmetic against NumPy: tests/test_quant.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vdjax  # noqa: E402
from vdjax.engine import quant  # noqa: E402
from vdjax.engine.cache import LayerCache  # noqa: E402

from helpers import layer0_kv, policy_kwargs, random_ids, random_params, tiny_config  # noqa: E402

CFG = tiny_config(num_heads=4, num_kv_heads=2, head_dim=16)
LENGTHS = (40, 25)
RUN = dict(block_size=8, max_new_tokens=6)


@pytest.fixture(scope="module")
def model():
    params = random_params(CFG, seed=1)
    ids = [random_ids(n, CFG.vocab_size, seed=n).tolist() for n in LENGTHS]
    return params, ids


@pytest.mark.parametrize("kv_quant,group", [("int8", None), ("int4", 8)])
def test_cache_holds_codes_and_scales_only(model, kv_quant, group):
    params, ids = model
    gen = vdjax.run(params, ids, "valuediff", budget=12, kv_quant=kv_quant, kv_group=group, **RUN)
    bits, g = (8, 16) if kv_quant == "int8" else (4, 8)
    for lc in gen.cache.layers:
        assert isinstance(lc.k, quant.QuantTensor) and isinstance(lc.v, quant.QuantTensor)
        for t in (lc.k, lc.v):
            assert t.data.dtype == jnp.uint8 and t.data.shape == (2, 2, 12, 16 * bits // 8)
            assert t.scale.shape == t.zero.shape == (2, 2, 12, 16 // g)
        # no full-precision copy of keys or values anywhere in the carry
        floats = [x for x in jax.tree.leaves(lc)
                  if x.ndim == 4 and x.shape[-1] == 16 and x.dtype != jnp.uint8]
        assert not floats
    per_token = quant.bytes_per_token(16, bits, g)  # one of k / v, one head
    assert gen.cache_bytes == CFG.num_layers * 2 * 2 * 12 * 2 * per_token
    # layers x rows x KV heads x (k, v) x D x fp32 bytes x tokens seen
    assert gen.dense_cache_bytes == CFG.num_layers * 2 * 2 * 2 * 16 * 4 * (max(LENGTHS) + gen.steps)
    assert gen.kv_quant == kv_quant


@pytest.mark.parametrize("kv_quant", ["int8", "int4"])
def test_layer0_codes_are_the_unquantized_keys_quantized(model, kv_quant):
    """Layer 0's keys and values do not depend on the cache: with room for every token, its stored codes and
    scales are exactly `quantize` of the unquantized layer-0 keys and values, slot = position."""
    params, ids = model
    row = ids[0]
    cache, _ = vdjax.prefill(params, row, "valuediff", budget=64, block_size=8, kv_quant=kv_quant)
    k_ref, v_ref = layer0_kv(params, np.asarray(row))  # [K, T, D]
    lc = cache.layers[0]
    pos = np.asarray(lc.pos)[0]  # [K, N]
    for got, ref in ((lc.k, k_ref), (lc.v, v_ref)):
        want = quant.quantize(jnp.asarray(ref)[None], got.bits, got.group, got.scale_dtype)
        for h in range(CFG.num_kv_heads):
            slots = np.argsort(np.where(pos[h] >= 0, pos[h], 1 << 30))[: len(row)]
            assert (pos[h][slots] == np.arange(len(row))).all()
            for name in ("data", "scale", "zero"):
                np.testing.assert_array_equal(np.asarray(getattr(got, name))[0, h][slots],
                                              np.asarray(getattr(want, name))[0, h])


def test_invariants_and_full_budget_close_to_dense(model):
    """N >= T + new: every token kept (kept positions = 0 .. T + new - 2), as dense; int8's last logits
    within 2 % of the unquantized cache's, int4's within 30 %."""
    params, ids = model
    ref_cache, ref_logits = vdjax.prefill(params, ids, "dense", block_size=8)
    for kv_quant, tol in (("int8", 0.02), ("int4", 0.3)):
        cache, logits = vdjax.prefill(params, ids, "valuediff", budget=64, block_size=8, kv_quant=kv_quant)
        kept = cache.kept_positions()
        for r, n in enumerate(LENGTHS):
            for h in range(CFG.num_kv_heads):
                np.testing.assert_array_equal(kept[0][r][h], np.arange(n))
        err = np.abs(np.asarray(logits) - np.asarray(ref_logits)).max() / np.abs(np.asarray(ref_logits)).max()
        assert err < tol, (kv_quant, err)
    # streaming scores positions only: the same kept positions whatever the storage
    a = vdjax.run(params, ids, "streaming", budget=12, **RUN).cache.kept_positions()
    b = vdjax.run(params, ids, "streaming", budget=12, kv_quant="int4", **RUN).cache.kept_positions()
    assert all(np.array_equal(x, y) for la, lb in zip(a, b, strict=True)
               for ra, rb in zip(la, lb, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.mark.parametrize("policy", ["dense", "snapkv", "h2o", "adakv:valuediff", "criticalkv:snapkv",
                                    "chunkkv:keydiff", "pyramidkv:snapkv", "kvzip", "expected_attention"])
def test_every_kind_of_policy_composes(model, policy):
    params, ids = model
    budget = None if policy == "dense" else 12
    gen = vdjax.run(params, ids, policy, budget=budget, kv_quant="int4", kv_group=8, **RUN,
                    **policy_kwargs(policy, params))
    assert gen.tokens.shape[0] == 2
    counts = np.asarray(gen.cache.valid_counts())
    if budget is not None:  # a head-adaptive pool shares K * N slots between its heads
        assert counts.sum(-1).max() <= 2 * 12 and counts.min() >= 1
        assert policy.startswith(("adakv", "criticalada")) or counts.max() <= 12
    assert all(isinstance(lc.k, quant.QuantTensor) for lc in gen.cache.layers)
    assert 0 < gen.cache_bytes < gen.dense_cache_bytes


def test_families_compose():
    """Gemma's sliding layers, Qwen3.5's attention layers beside Gated DeltaNet, GPT-OSS's sinks."""
    from test_sharding import _gpt_oss, _qwen3_5

    gemma = tiny_config(family="gemma3", num_layers=3,
                        layer_types=("sliding_attention",) * 2 + ("full_attention",), sliding_window=8,
                        norm_offset=1.0, qk_norm=True, post_norms=True, embed_scale=True, mlp_act="gelu_tanh")
    for params, ids in ((random_params(gemma, seed=2), _qwen3_5()[1]), _qwen3_5(), _gpt_oss()):
        gen = vdjax.run(params, ids, "valuediff", budget=12, kv_quant="int8", **RUN)
        quantized = [lc for lc in gen.cache.layers if isinstance(lc, LayerCache)]
        assert quantized and all(isinstance(lc.k, quant.QuantTensor) for lc in quantized)
        assert np.asarray(gen.cache.valid_counts()).max() <= 12


def test_layer_scan_equals_unrolled(model):
    params, ids = model
    a = vdjax.run(params, ids, "valuediff", budget=12, kv_quant="int8", layer_scan=False, **RUN)
    b = vdjax.run(params, ids, "valuediff", budget=12, kv_quant="int8", layer_scan=True, **RUN)
    assert (a.tokens == b.tokens).all()


def test_errors(model):
    params, ids = model
    with pytest.raises(ValueError, match="kv_quant must be one of None, 'int8', 'int4', 'int8-smooth', "
                                         "'int4-smooth', 'int8-smooth-rot', 'int4-smooth-rot'; got 'int3'"):
        vdjax.generate(params, ids, "valuediff", budget=12, kv_quant="int3")
    with pytest.raises(ValueError, match="kv_group must be a positive divisor of head_dim=16; got 5"):
        vdjax.generate(params, ids, "valuediff", budget=12, kv_quant="int8", kv_group=5)
    with pytest.raises(ValueError, match="kv_group=8 needs kv_quant"):
        vdjax.generate(params, ids, "valuediff", budget=12, kv_group=8)


@pytest.mark.parametrize("kv_quant", ["int8-smooth", "int4-smooth", "int4-smooth-rot"])
def test_smooth_keys_calibrate_on_the_first_block(model, kv_quant):
    """The smooth layout: layer 0's key centre and factor are `calibrate` of the first block's keys (the
    first tokens written), its key codes `quantize` of all the unquantized keys with them; values stay in
    the token layout (-smooth-rot: the rotate layout, codes `quantize(v, rotate=True)`); logits close to the
    unquantized cache's."""
    params, ids = model
    row = ids[0]
    cache, _ = vdjax.prefill(params, row, "valuediff", budget=64, block_size=8, kv_quant=kv_quant)
    k_ref, v_ref = layer0_kv(params, np.asarray(row))  # [K, T, D]
    k, v = cache.layers[0].k, cache.layers[0].v
    rot = kv_quant.endswith("-rot")
    assert k.layout == "smooth" and v.layout == ("rotate" if rot else "token") and v.centre is None
    c, f = quant.calibrate(jnp.asarray(k_ref)[None, :, :8], jnp.ones((1, CFG.num_kv_heads, 8), bool))
    np.testing.assert_array_equal(np.asarray(k.centre), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(k.factor), np.asarray(f))
    want = quant.quantize(jnp.asarray(k_ref)[None], k.bits, k.group, k.scale_dtype, c, f)
    want_v = quant.quantize(jnp.asarray(v_ref)[None], v.bits, v.group, v.scale_dtype, rotate=rot)
    pos = np.asarray(cache.layers[0].pos)[0]
    for h in range(CFG.num_kv_heads):
        slots = np.argsort(np.where(pos[h] >= 0, pos[h], 1 << 30))[: len(row)]
        for stored, ref_q in ((k, want), (v, want_v)):
            got = np.asarray(quant.codes_of(stored))[0, h][slots].astype(int)
            ref = np.asarray(quant.codes_of(ref_q))[0, h].astype(int)
            # in-program and eager fp32 rotations may differ in the last ulp: a code may move by one
            assert (got == ref).mean() > 0.99 and np.abs(got - ref).max() <= 1
    ref_cache, ref_logits = vdjax.prefill(params, ids, "dense", block_size=8)
    plain = vdjax.prefill(params, ids, "valuediff", budget=64, block_size=8, kv_quant=kv_quant[:4])[1]
    _, logits = vdjax.prefill(params, ids, "valuediff", budget=64, block_size=8, kv_quant=kv_quant)
    err = np.abs(np.asarray(logits) - np.asarray(ref_logits)).max() / np.abs(np.asarray(ref_logits)).max()
    assert err < (0.02 if kv_quant.startswith("int8") else 0.3), err
    assert np.isfinite(np.asarray(plain)).all()


def test_smooth_keys_compose_and_count_their_calibration(model):
    """int4-smooth with every cache kind (per head, a head-adaptive pool, dense), layer scan = unrolled, the
    bytes: the token layout's plus centre and factor (bf16 [B, K, D]; a pool's [B, 1, D]) per layer; a head
    dim that is not a power of two is refused by name."""
    params, ids = model
    for policy in ("valuediff", "adakv:valuediff", "snapkv", "dense"):
        budget = None if policy == "dense" else 12
        a = vdjax.run(params, ids, policy, budget=budget, kv_quant="int4-smooth", kv_group=8, **RUN)
        b = vdjax.run(params, ids, policy, budget=budget, kv_quant="int4", kv_group=8, **RUN)
        heads = 1 if policy.startswith("adakv") else CFG.num_kv_heads  # a pool: one calibration per row
        assert a.cache_bytes - b.cache_bytes == CFG.num_layers * len(ids) * heads * 16 * 2 * 2
        assert np.asarray(a.cache.valid_counts()).sum(-1).max() <= 2 * (budget or 64)
        assert all(lc.k.factor is not None and (np.asarray(lc.k.factor) > 0).all() for lc in a.cache.layers)
        if policy in ("valuediff", "adakv:valuediff"):  # values rotated too: the same bytes and slots
            r = vdjax.run(params, ids, policy, budget=budget, kv_quant="int4-smooth-rot", kv_group=8, **RUN)
            assert r.cache_bytes == a.cache_bytes and all(lc.v.layout == "rotate" for lc in r.cache.layers)
            counts = [np.asarray(g.cache.valid_counts()).sum(-1) for g in (r, a)]  # a pool splits by score
            np.testing.assert_array_equal(*counts)
    u = vdjax.run(params, ids, "valuediff", budget=12, kv_quant="int4-smooth", layer_scan=False, **RUN)
    s = vdjax.run(params, ids, "valuediff", budget=12, kv_quant="int4-smooth", layer_scan=True, **RUN)
    assert (u.tokens == s.tokens).all()
    odd = random_params(tiny_config(num_heads=2, num_kv_heads=1, head_dim=12), seed=3)
    with pytest.raises(ValueError, match=r"kv_quant='int4-smooth' rotates keys by a Hadamard matrix: it "
                                         r"needs a power-of-two head_dim; this model's is 12 \(use 'int4'\)"):
        vdjax.generate(odd, ids, "valuediff", budget=12, kv_quant="int4-smooth")

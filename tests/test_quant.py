"""vdjax.engine.quant (issue 49, phase 1) against an independent NumPy reference: codes bit-exact, round-trip
bounds per group, constant groups exact, int4 packing, slot gathers / writes, exact bytes, attention over a
dequantized cache, jit, errors."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from vdjax.engine import cache as C
from vdjax.engine import quant as Q
from vdjax.models import transformer as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import tiny_config  # noqa: E402

NP_DTYPES = {jnp.dtype(jnp.bfloat16): ml_dtypes.bfloat16, jnp.dtype(jnp.float16): np.float16,
             jnp.dtype(jnp.float32): np.float32}
SCALE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


# ---- the NumPy reference ----------------------------------------------------------------------------------

def ref_store(v: np.ndarray, dt, up: bool) -> np.ndarray:
    """fp32 v in storage dtype dt, rounded toward +inf (up) or -inf where nearest rounding went past v."""
    s = v.astype(dt)
    back = s.astype(np.float32)
    if up:
        return np.where(back < v, np.nextafter(s, np.array(np.inf, dt)), s).astype(dt)
    return np.where(back > v, np.nextafter(s, np.array(-np.inf, dt)), s).astype(dt)


def ref_quantize(x: np.ndarray, bits: int, group: int, scale_dtype):
    """(codes uint8 [..., D], scale, zero [..., D / group] in scale_dtype) of x, asymmetric min/max."""
    dt = NP_DTYPES[jnp.dtype(scale_dtype)]
    xf = np.asarray(x, np.float32)
    g = xf.reshape(xf.shape[:-1] + (xf.shape[-1] // group, group))
    lo, hi = g.min(-1), g.max(-1)
    levels = np.float32(2**bits - 1)
    zero = ref_store(lo, dt, up=False)
    zf = zero.astype(np.float32)
    want = ((hi - zf) * np.float32(1 / levels)).astype(np.float32)
    scale = ref_store(want, dt, up=True)
    sf = scale.astype(np.float32)
    inv = (np.float32(1) / np.where(sf > 0, sf, np.float32(1))).astype(np.float32)
    codes = np.clip(np.rint((g - zf[..., None]) * inv[..., None]), 0, levels).astype(np.uint8)
    return codes.reshape(xf.shape), scale, zero


def ref_dequantize(codes, scale, zero, group) -> np.ndarray:
    """fp32 code * scale + zero."""
    c = codes.astype(np.float32).reshape(codes.shape[:-1] + (codes.shape[-1] // group, group))
    x = c * scale.astype(np.float32)[..., None] + zero.astype(np.float32)[..., None]
    return x.reshape(codes.shape)


def ref_pack(codes: np.ndarray) -> np.ndarray:
    """Channel 2i low nibble, 2i + 1 high nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def ref_unpack(packed: np.ndarray) -> np.ndarray:
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = packed % 16
    out[..., 1::2] = packed // 16
    return out


def ref_attention(q, q_pos, kc, vc, pos_c, kn, vn, scale):
    """NumPy fp64 attention of q [B, S, Nq, D] over cache slots (kc, vc [B, K, N, D], pos -1 empty) + the
    block's own tokens kn, vn [B, K, S, D], causal by absolute position."""
    b, s, nq, d = q.shape
    kh = kc.shape[1]
    g = nq // kh
    out = np.zeros((b, s, nq, d))
    for bi in range(b):
        for h in range(nq):
            k = np.concatenate([kc[bi, h // g], kn[bi, h // g]]).astype(np.float64)  # [C, D]
            v = np.concatenate([vc[bi, h // g], vn[bi, h // g]]).astype(np.float64)
            kp = np.concatenate([pos_c[bi, h // g], q_pos[bi]])
            for si in range(s):
                if q_pos[bi, si] < 0:  # a pad query: its output is not compared
                    continue
                ok = (kp >= 0) & (kp <= q_pos[bi, si])
                lg = k[ok] @ q[bi, si, h].astype(np.float64) * scale
                w = np.exp(lg - lg.max())
                out[bi, si, h] = (w / w.sum()) @ v[ok]
    return out


# ---- inputs -----------------------------------------------------------------------------------------------

def kv_like(shape, seed=0) -> np.ndarray:
    """Key-like fp32 data: per-token magnitudes over three decades, a few outlier channels, an offset."""
    r = np.random.default_rng(seed)
    x = r.standard_normal(shape).astype(np.float32)
    x *= np.exp(r.uniform(-3, 3, shape[:-1] + (1,))).astype(np.float32)
    x[..., 3] *= 20
    x[..., -5] += 7
    return x


# ---- quantize / dequantize ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [8, 64])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16])
def test_codes_bit_exact_and_round_trip_bound(bits, group, scale_dtype, in_dtype):
    x = jnp.asarray(kv_like((2, 3, 11, 64), seed=bits + group), in_dtype)
    q = Q.quantize(x, bits, group, scale_dtype)
    xn = np.asarray(x.astype(jnp.float32))
    codes, scale, zero = ref_quantize(xn, bits, group, scale_dtype)
    assert q.data.dtype == jnp.uint8 and q.shape == x.shape and q.dtype == jnp.dtype(in_dtype)
    assert q.data.shape == (2, 3, 11, 64 * bits // 8)
    assert q.scale.dtype == jnp.dtype(scale_dtype) and q.scale.shape == (2, 3, 11, 64 // group)
    np.testing.assert_array_equal(np.asarray(Q.codes_of(q)), codes)
    np.testing.assert_array_equal(np.asarray(q.scale.astype(jnp.float32)), scale.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(q.zero.astype(jnp.float32)), zero.astype(np.float32))
    if bits == 4:
        np.testing.assert_array_equal(np.asarray(q.data), ref_pack(codes))
    assert codes.max() <= 2**bits - 1 and codes.max() == 2**bits - 1  # the range is used
    # round trip: within half a step of every group (+ fp32 rounding of the reconstruction)
    xh = np.asarray(Q.dequantize(q, jnp.float32))
    np.testing.assert_allclose(xh, ref_dequantize(codes, scale, zero, group), rtol=1e-6, atol=1e-6)
    err = np.abs(xh - xn).reshape(2, 3, 11, 64 // group, group).max(-1)
    mag = np.abs(xn).reshape(2, 3, 11, 64 // group, group).max(-1)
    bound = scale.astype(np.float32) / 2 + 4 * np.finfo(np.float32).eps * mag
    assert np.all(err <= bound), float(np.max(err - bound))
    # and the stored grid covers the group: zero <= min, zero + levels * scale >= max
    g = xn.reshape(2, 3, 11, 64 // group, group)
    assert np.all(zero.astype(np.float32) <= g.min(-1))
    top = zero.astype(np.float32) + (2**bits - 1) * scale.astype(np.float32)
    assert np.all(top >= g.max(-1) - 4 * np.finfo(np.float32).eps * mag)
    # the error is really that small (outlier channels included): int8 under 1 %, int4 under 25 %
    rel = np.linalg.norm(xh - xn) / np.linalg.norm(xn)
    assert rel < (0.01 if bits == 8 else 0.25), rel
    # the logical dtype comes back by default
    assert Q.dequantize(q).dtype == jnp.dtype(in_dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_constant_groups_round_trip_exactly(bits):
    r = np.random.default_rng(1)
    # bf16-representable values: exact with bf16 scales; any fp32 value: exact with fp32 scales
    vals = r.standard_normal((2, 2, 5, 4)).astype(np.float32)
    vals[0, 0, 0, 0] = 0.0
    vals[0, 0, 1, 1] = -3.0e4
    vals[1, 1, 2, 3] = 1e-30
    vals = vals.astype(ml_dtypes.bfloat16).astype(np.float32)
    x = np.repeat(vals, 16, axis=-1)  # [2, 2, 5, 64]: every group of 16 constant
    for sd, data in ((jnp.bfloat16, x), (jnp.float32, x + np.float32(1e-3) * np.float32(np.pi))):
        q = Q.quantize(jnp.asarray(data), bits, 16, sd)
        np.testing.assert_array_equal(np.asarray(Q.dequantize(q)), data)
        assert np.all(np.asarray(q.scale.astype(jnp.float32)) == 0)
        assert not np.any(np.isnan(np.asarray(Q.dequantize(q))))
    # constant groups beside varying ones in the same token
    y = x.copy()
    y[..., 16:32] = r.standard_normal(y[..., 16:32].shape)
    q = Q.quantize(jnp.asarray(y, jnp.bfloat16), bits, 16, jnp.bfloat16)
    out = np.asarray(Q.dequantize(q, jnp.float32))
    np.testing.assert_array_equal(out[..., :16], y[..., :16])
    np.testing.assert_array_equal(out[..., 32:], y[..., 32:])
    # an all-zero tensor and `empty` dequantize to zeros
    z = Q.quantize(jnp.zeros((1, 1, 3, 8)), bits, 4)
    assert np.all(np.asarray(Q.dequantize(z)) == 0)
    e = Q.empty((2, 3, 4, 64), bits, 32, jnp.bfloat16)
    assert e.shape == (2, 3, 4, 64) and e.dtype == jnp.bfloat16 and e.bits == bits and e.group == 32
    assert np.all(np.asarray(Q.dequantize(e).astype(jnp.float32)) == 0)


def test_pack_unpack_inverse_over_all_bytes():
    every = np.arange(256, dtype=np.uint8).reshape(4, 64)
    unpacked = np.asarray(Q.unpack_int4(jnp.asarray(every)))
    np.testing.assert_array_equal(unpacked, ref_unpack(every))
    assert unpacked.shape == (4, 128) and unpacked.max() == 15
    np.testing.assert_array_equal(np.asarray(Q.pack_int4(jnp.asarray(unpacked))), every)
    # channel order: channel 0 low nibble, channel 1 high nibble
    assert int(Q.pack_int4(jnp.asarray([[1, 2]], jnp.uint8))[0, 0]) == 0x21
    codes = np.random.default_rng(2).integers(0, 16, (3, 5, 32)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(Q.pack_int4(jnp.asarray(codes))), ref_pack(codes))
    np.testing.assert_array_equal(np.asarray(Q.unpack_int4(Q.pack_int4(jnp.asarray(codes)))), codes)


# ---- slot helpers ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
def test_take_and_put_slots_equal_dequantize_then_gather_or_scatter(bits):
    b, k, n, s, d = 2, 3, 9, 4, 32
    r = np.random.default_rng(3)
    q = Q.quantize(jnp.asarray(kv_like((b, k, n, d), 4)), bits, 16)
    dense = Q.dequantize(q)  # [B, K, N, D]
    idx = jnp.asarray(np.stack([[r.permutation(n)[:6] for _ in range(k)] for _ in range(b)]), jnp.int32)
    t = Q.take_slots(q, idx)
    assert t.shape == (b, k, 6, d) and t.scale.shape == (b, k, 6, d // 16)
    np.testing.assert_array_equal(np.asarray(Q.dequantize(t)),
                                  np.asarray(jnp.take_along_axis(dense, idx[..., None], axis=2)))
    new = Q.quantize(jnp.asarray(kv_like((b, k, s, d), 5)), bits, 16)
    # distinct destinations per head, some dropped (index N)
    dest = np.stack([[np.where(r.random(s) < 0.3, n, r.permutation(n)[:s]) for _ in range(k)]
                     for _ in range(b)])
    dest = jnp.asarray(dest, jnp.int32)
    want = np.asarray(C.scatter_slots(dense, dest, Q.dequantize(new)))
    np.testing.assert_array_equal(want, np.asarray(C.select_slots(dense, dest, Q.dequantize(new))))
    for fused in (True, False):
        put = Q.put_slots(q, dest, new, fused=fused)
        assert put.shape == q.shape and put.data.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(Q.dequantize(put)), want)
    assert not np.array_equal(want, np.asarray(dense))  # something was written
    # a pooled layout [B, 1, P, D] and stacked layers [L, B, K, N, D] work alike (the slot axis is -2)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), q)
    assert stacked.shape == (2, b, k, n, d)
    st = Q.take_slots(stacked, jnp.stack([idx, idx]))
    np.testing.assert_array_equal(np.asarray(Q.dequantize(st))[1], np.asarray(Q.dequantize(t)))


# ---- bytes -------------------------------------------------------------------------------------------------

def test_nbytes_and_bytes_per_token_exact():
    b, k, n = 2, 3, 7
    for d, bits, g, sd, per in ((64, 8, 64, jnp.bfloat16, 64 + 4), (64, 8, 32, jnp.bfloat16, 64 + 8),
                                (64, 4, 32, jnp.bfloat16, 32 + 8), (64, 4, 64, jnp.float32, 32 + 8),
                                (64, 4, 16, jnp.float16, 32 + 16), (256, 8, 64, jnp.bfloat16, 256 + 16),
                                (256, 4, 32, jnp.bfloat16, 128 + 32), (256, 4, 128, jnp.bfloat16, 128 + 8)):
        q = jax.eval_shape(lambda x, bits=bits, g=g, sd=sd: Q.quantize(x, bits, g, sd),
                           jnp.ones((b, k, n, d)))
        assert Q.nbytes(q) == q.nbytes == b * k * n * per
        assert Q.nbytes(q) == sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(q))
        assert Q.bytes_per_token(d, bits, g, sd) == per
        assert Q.nbytes(Q.empty((b, k, n, d), bits, g, scale_dtype=sd)) == b * k * n * per
    assert Q.bytes_per_token(64, None) == 128 and Q.bytes_per_token(256, None) == 512
    assert Q.bytes_per_token(64, None, dense_dtype=jnp.float32) == 256
    assert Q.bytes_per_token(64, 4) == 36  # group None = one group per token-head
    # N at a fraction of a dense bf16 cache's bytes: 25 % of 2048 tokens at D = 64
    assert Q.slots_for_bytes(0.25, 2048, 64) == 512
    assert Q.slots_for_bytes(0.25, 2048, 64, "int8", 64) == 65536 // 68 == 963
    assert Q.slots_for_bytes(0.25, 2048, 64, "int4", 32) == 65536 // 40 == 1638
    assert Q.slots_for_bytes(0.125, 2048, 64, "int4", 64) == 32768 // 36 == 910
    assert Q.slots_for_bytes(1e-9, 16, 64, "int4") == 1
    for kvq, g in ((None, None), ("int8", 32), ("int4", 16)):
        nq = Q.slots_for_bytes(0.25, 2048, 256, kvq, g)
        bits = Q.kv_quant_bits(kvq)
        per = Q.bytes_per_token(256, bits, g)
        assert nq * per <= 0.25 * 2048 * 512 < (nq + 1) * per
    # the smooth layout's key centre and factor (one bf16 [D] pair per KV head) count against the budget:
    # at 25 % of 2048 tokens, D = 256, int4 g64: 1820 slots fit the codes and scales, 1816 with calibration
    assert Q.slots_for_bytes(0.25, 2048, 256, "int4", 64) == 1820
    assert Q.slots_for_bytes(0.25, 2048, 256, "int4-smooth", 64) == (2 * 262144 - 1024) // (2 * 144) == 1816
    for d, kvq, g in ((64, "int4-smooth", 64), (256, "int4-smooth", 32), (128, "int8-smooth", 64)):
        nq = Q.slots_for_bytes(0.25, 2048, d, kvq, g)
        bits = Q.kv_quant_bits(kvq)
        # keys smooth, values per token: what one KV head's cache holds at nq and nq + 1 slots
        held = [Q.nbytes(Q.empty((1, 1, n, d), bits, g, layout="smooth"))
                + Q.nbytes(Q.empty((1, 1, n, d), bits, g))
                for n in (nq, nq + 1)]
        assert held[0] <= 2 * 0.25 * 2048 * Q.bytes_per_token(d, None) < held[1]


# ---- attention over a dequantized cache -------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
def test_attention_over_dequantized_cache_matches_numpy(bits):
    cfg = tiny_config(head_dim=16, num_heads=4, num_kv_heads=2)
    b, k, n, s, d = 2, 2, 7, 3, 16
    r = np.random.default_rng(6)
    kc, vc = kv_like((b, k, n, d), 7), kv_like((b, k, n, d), 8)
    pos_c = np.stack([[r.permutation(20)[:n] for _ in range(k)] for _ in range(b)]).astype(np.int32)
    pos_c[0, 1, 2] = -1  # an empty slot
    q_pos = np.array([[20, 21, 22], [-1, 20, 21]], np.int32)  # row 1: a pad query
    qry = r.standard_normal((b, s, 4, d)).astype(np.float32) * 0.3
    kn = r.standard_normal((b, k, s, d)).astype(np.float32)
    vn = r.standard_normal((b, k, s, d)).astype(np.float32)
    qk, qv = Q.quantize(jnp.asarray(kc), bits, 8), Q.quantize(jnp.asarray(vc), bits, 8)
    out, _ = tf.attend(jnp.asarray(qry), jnp.asarray(q_pos), Q.dequantize(qk), Q.dequantize(qv),
                       jnp.asarray(pos_c), jnp.asarray(kn), jnp.asarray(vn), cfg)
    # the reference dequantizes its own codes
    kd = ref_dequantize(*ref_quantize(kc, bits, 8, jnp.bfloat16), 8)
    vd = ref_dequantize(*ref_quantize(vc, bits, 8, jnp.bfloat16), 8)
    want = ref_attention(qry, q_pos, kd, vd, pos_c, kn, vn, cfg.attn_scale)
    ok = q_pos >= 0
    np.testing.assert_allclose(np.asarray(out)[ok], want[ok], rtol=1e-5, atol=1e-5)
    # and it is not the unquantized attention (the test can see quantization)
    exact = ref_attention(qry, q_pos, kc, vc, pos_c, kn, vn, cfg.attn_scale)
    assert np.max(np.abs(exact[ok] - want[ok])) > 1e-4


# ---- jit ---------------------------------------------------------------------------------------------------

def test_everything_jits_and_agrees():
    x = jnp.asarray(kv_like((2, 3, 6, 32), 9))
    new_x = jnp.asarray(kv_like((2, 3, 2, 32), 10))
    idx = jnp.asarray(np.tile(np.array([5, 0, 3], np.int32), (2, 3, 1)))
    dest = jnp.asarray(np.tile(np.array([4, 6], np.int32), (2, 3, 1)))
    for bits in (8, 4):
        quant = jax.jit(Q.quantize, static_argnums=(1, 2, 3))
        q, qj = Q.quantize(x, bits, 16), quant(x, bits, 16, jnp.bfloat16)
        for a, bb in zip(jax.tree.leaves(q), jax.tree.leaves(qj), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(bb))
        assert (qj.bits, qj.group, qj.dtype) == (bits, 16, jnp.dtype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(jax.jit(Q.dequantize)(q)), np.asarray(Q.dequantize(q)))
        np.testing.assert_array_equal(np.asarray(jax.jit(Q.take_slots)(q, idx).data),
                                      np.asarray(Q.take_slots(q, idx).data))
        new = Q.quantize(new_x, bits, 16)
        for fused in (True, False):
            put = jax.jit(Q.put_slots, static_argnums=3)(q, dest, new, fused)
            np.testing.assert_array_equal(np.asarray(Q.dequantize(put)),
                                          np.asarray(Q.dequantize(Q.put_slots(q, dest, new, fused))))
        e = jax.jit(lambda bits=bits: Q.empty((2, 3, 6, 32), bits, 16))()
        assert e.shape == (2, 3, 6, 32)
        if bits == 8:
            continue
        # a QuantTensor is a scan carry: write one slot per step
        one = Q.take_slots(new, jnp.zeros((2, 3, 1), jnp.int32))

        def step(c, i, one=one):
            return Q.put_slots(c, jnp.full((2, 3, 1), i, jnp.int32), one), None
        final, _ = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(3, dtype=jnp.int32)))(q)
        got = np.asarray(Q.dequantize(final))
        np.testing.assert_array_equal(got[:, :, :3], np.repeat(np.asarray(Q.dequantize(new))[:, :, :1], 3, 2))
        np.testing.assert_array_equal(got[:, :, 3:], np.asarray(Q.dequantize(q))[:, :, 3:])
    packed = jax.jit(Q.pack_int4)(jnp.arange(16, dtype=jnp.uint8))
    np.testing.assert_array_equal(np.asarray(jax.jit(Q.unpack_int4)(packed)), np.arange(16))


# ---- errors ------------------------------------------------------------------------------------------------

def test_errors_name_argument_value_and_allowed():
    names = (None, "int8", "int4", "int8-smooth", "int4-smooth", "int8-smooth-rot", "int4-smooth-rot")
    assert [Q.kv_quant_bits(v) for v in names] == [None, 8, 4, 8, 4, 8, 4]
    assert [Q.kv_quant_layout(v) for v in names] == ["token"] * 3 + ["smooth"] * 4
    assert [Q.kv_value_layout(v) for v in names] == ["token"] * 5 + ["rotate"] * 2
    for bad in ("int3", "fp8", "INT8", 8, True, "int4-smoth", "int4-rot"):
        with pytest.raises(ValueError, match=r"kv_quant must be one of None, 'int8', 'int4', 'int8-smooth', "
                                             r"'int4-smooth', 'int8-smooth-rot', 'int4-smooth-rot'; "
                                             r"got") as e:
            Q.kv_quant_bits(bad)
        assert repr(bad) in str(e.value)
    x = jnp.zeros((1, 1, 2, 64))
    with pytest.raises(ValueError, match=r"bits must be one of \(8, 4\); got 3"):
        Q.quantize(x, 3, 32)
    with pytest.raises(ValueError, match=r"group must divide head_dim=64; got group=48"):
        Q.quantize(x, 8, 48)
    with pytest.raises(ValueError, match=r"group must be a positive int dividing head_dim=64; got 0"):
        Q.quantize(x, 4, 0)
    with pytest.raises(ValueError, match=r"head_dim must be even; got head_dim=3"):
        Q.quantize(jnp.zeros((1, 1, 2, 3)), 4, 1)
    with pytest.raises(ValueError, match=r"group must divide head_dim=64; got group=40"):
        Q.empty((1, 1, 2, 64), 4, 40)
    with pytest.raises(ValueError, match=r"group must divide head_dim=256; got group=96"):
        Q.bytes_per_token(256, 8, 96)
    with pytest.raises(ValueError, match=r"kv_quant must be one of .*got 'int2'"):
        Q.slots_for_bytes(0.25, 2048, 64, "int2")
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\]; got 1.5"):
        Q.slots_for_bytes(1.5, 2048, 64, "int8")
    with pytest.raises(ValueError, match=r"tokens must be a positive int; got 0"):
        Q.slots_for_bytes(0.5, 0, 64, "int8")
    with pytest.raises(ValueError, match=r"head_dim must be a power of two; got head_dim=48"):
        Q.empty((1, 1, 2, 48), 8, 16, layout="smooth")
    with pytest.raises(ValueError, match=r"head_dim must be a power of two; got head_dim=48"):
        Q.quantize(jnp.zeros((1, 1, 2, 48)), 8, 16, rotate=True)
    with pytest.raises(ValueError, match=r"layout must be one of \('token', 'smooth', 'rotate'\); got 'chan"):
        Q.empty((1, 1, 2, 64), 8, 16, layout="channel")
    q8, q4 = Q.quantize(x, 8, 32), Q.quantize(x, 4, 32)
    c, f = Q.calibrate(x, jnp.ones((1, 1, 2), bool))
    with pytest.raises(ValueError, match=r"put_slots: new must be quantized like the buffer .* layout"):
        Q.put_slots(q8, jnp.zeros((1, 1, 2), jnp.int32), Q.quantize(x, 8, 32, centre=c, factor=f))
    with pytest.raises(ValueError, match=r"put_slots: new must be quantized like the buffer"):
        Q.put_slots(q8, jnp.zeros((1, 1, 2), jnp.int32), q4)
    with pytest.raises(ValueError, match=r"put_slots: new must be quantized like the buffer .* layout"):
        Q.put_slots(q8, jnp.zeros((1, 1, 2), jnp.int32), Q.quantize(x, 8, 32, rotate=True))
    with pytest.raises(ValueError, match=r"quantize: rotate=True is the rotate layout, centre/factor the"):
        Q.quantize(x, 8, 32, centre=c, factor=f, rotate=True)


# ---- the smooth key layout ---------------------------------------------------------------------------------

def ref_hadamard(d: int) -> np.ndarray:
    """H[i, j] = (-1) ** popcount(i & j) / sqrt(d) (Sylvester's construction written out)."""
    i = np.arange(d)
    bits = np.vectorize(lambda a: bin(a).count("1"))(i[:, None] & i[None, :])
    return ((-1.0) ** bits / np.sqrt(d)).astype(np.float32)


def ref_calibrate(x: np.ndarray, written: np.ndarray, dt) -> tuple[np.ndarray, np.ndarray]:
    """Per (row, head) over the written tokens: channel mid-range and max(half-range, FLOOR * largest) ** 0.5,
    stored in dt; zeros where nothing is written."""
    lead = x.shape[:-2]
    centre = np.zeros(lead + (x.shape[-1],), np.float32)
    factor = np.zeros_like(centre)
    for ix in np.ndindex(lead):
        w = written[ix]
        if not w.any():
            continue
        sel = x[ix][w].astype(np.float32)  # [S_w, D]
        hi, lo = sel.max(0), sel.min(0)
        half = (hi - lo) / 2
        half = np.maximum(half, np.float32(Q.FLOOR) * half.max())
        factor[ix] = np.where(half > 0, half, 1.0) ** np.float32(Q.SMOOTH)
        centre[ix] = (hi + lo) / 2
    return centre.astype(dt), factor.astype(dt)


@pytest.mark.parametrize("bits", [8, 4])
def test_smooth_layout_against_numpy(bits):
    """Calibration, codes, scales and the read-back of the smooth layout equal a NumPy reference built from
    ref_quantize: y = ((x - c) / f) @ H quantized per token, x^ = (y^ @ H) * f + c; and it beats the plain
    per-token layout on keys with outlier channels."""
    b, k, n, d, g = 2, 2, 24, 32, 16
    dt = NP_DTYPES[jnp.dtype(jnp.bfloat16)]
    x = kv_like((b, k, n, d), 11) / 30 + np.linspace(-2, 2, d, dtype=np.float32)  # offsets and outliers
    x[..., 7] *= 40
    written = np.ones((b, k, n), bool)
    written[1, 0, 5:] = False  # a head calibrated on its first five tokens only
    written[1, 1] = False  # a head with nothing written: not calibrated
    c, f = Q.calibrate(jnp.asarray(x), jnp.asarray(written))
    rc, rf = ref_calibrate(x, written, dt)
    np.testing.assert_array_equal(np.asarray(c.astype(jnp.float32)), rc.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(f.astype(jnp.float32)), rf.astype(np.float32))
    assert (np.asarray(f)[1, 1] == 0).all() and (np.asarray(f)[0] > 0).all()
    h = ref_hadamard(d)
    np.testing.assert_allclose(Q.hadamard(d), h, atol=1e-7)
    np.testing.assert_allclose(h @ h, np.eye(d), atol=1e-6)
    q = Q.quantize(jnp.asarray(x), bits, g, centre=c, factor=f)
    assert q.layout == "smooth" and q.centre.shape == (b, k, d)
    cf, ff = rc.astype(np.float32)[..., None, :], rf.astype(np.float32)[..., None, :]
    y = ((x - cf) / np.where(ff > 0, ff, 1)) @ h  # [B, K, N, D]
    codes, scale, zero = ref_quantize(y, bits, g, jnp.bfloat16)
    got = np.asarray(Q.codes_of(q))
    # fp32 matmul order may move a value across a rounding boundary: nearly every code equal, none off by 2
    assert (got == codes).mean() > 0.995 and np.abs(got.astype(int) - codes).max() <= 1
    sc, zr = (np.asarray(a).astype(np.float32) for a in (q.scale, q.zero))
    y_back = ref_dequantize(got, sc, zr, g)
    want = (y_back @ h) * ff + cf
    np.testing.assert_allclose(np.asarray(Q.dequantize(q, jnp.float32)), want, rtol=1e-5, atol=1e-5)
    # the error bound: |x^ - x| <= f * ||y^ - y||_2 per element, ||y^ - y||_inf <= scale / 2 per group
    err_y = np.abs(y_back - y).reshape(b, k, n, d // g, g).max(-1)
    assert (err_y <= np.asarray(q.scale).astype(np.float32) / 2 * (1 + 1e-3) + 1e-6).all()
    plain = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(x), bits, g), jnp.float32))
    ok = written.all(-1)  # heads calibrated on all their tokens
    smooth_err = np.linalg.norm((np.asarray(Q.dequantize(q, jnp.float32)) - x)[ok])
    assert smooth_err < 0.7 * np.linalg.norm((plain - x)[ok])
    # an empty smooth tensor reads zeros, slot gathers and writes keep the calibration
    e = Q.empty((b, k, n, d), bits, g, layout="smooth")
    assert float(jnp.abs(Q.dequantize(e)).max()) == 0 and e.centre.shape == (b, k, d)
    e = Q.recalibrated(e, jnp.asarray(x), jnp.asarray(written))
    np.testing.assert_array_equal(np.asarray(e.factor), np.asarray(f))
    again = Q.recalibrated(e, jnp.asarray(x[..., ::-1, :] * 3), jnp.asarray(written))  # calibrated: unchanged
    np.testing.assert_array_equal(np.asarray(again.factor), np.asarray(f))
    dest = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, k, n))
    put = Q.put_slots(e, dest, Q.quantize_like(e, jnp.asarray(x)))
    np.testing.assert_array_equal(np.asarray(Q.dequantize(put, jnp.float32)),
                                  np.asarray(Q.dequantize(q, jnp.float32)))
    grown = Q.pad_slots(put, 2, 3)
    assert grown.shape == (b, k, n + 3, d) and grown.centre.shape == (b, k, d)
    assert Q.nbytes(q) == Q.nbytes(Q.quantize(jnp.asarray(x), bits, g)) + 2 * b * k * d * 2


@pytest.mark.parametrize("bits", [8, 4])
def test_rotate_layout_against_numpy(bits):
    """The rotate layout (the -smooth-rot names' values): codes, scales and the read-back equal a NumPy
    reference, y = x @ H quantized per token and x^ = y^ @ H; the same bytes as the token layout and less
    error on heavy-tailed vectors; slot gathers and writes keep the layout."""
    b, k, n, d, g = 2, 2, 24, 32, 16
    # heavy-tailed entries (Student t, 2 degrees of freedom): a few large channels a token, in no fixed place
    x = np.random.default_rng(12).standard_t(2, (b, k, n, d)).astype(np.float32)
    h = ref_hadamard(d)
    q = Q.quantize(jnp.asarray(x), bits, g, rotate=True)
    assert q.layout == "rotate" and q.centre is None and q.factor is None
    codes, scale, zero = ref_quantize(x @ h, bits, g, jnp.bfloat16)
    got = np.asarray(Q.codes_of(q))
    # fp32 matmul order may move a value across a rounding boundary: nearly every code equal, none off by 2
    assert (got == codes).mean() > 0.995 and np.abs(got.astype(int) - codes).max() <= 1
    sc, zr = (np.asarray(a).astype(np.float32) for a in (q.scale, q.zero))
    np.testing.assert_allclose(sc, scale.astype(np.float32), rtol=1e-2)
    want = ref_dequantize(got, sc, zr, g) @ h
    back = np.asarray(Q.dequantize(q, jnp.float32))
    # fp32 sums of D terms as large as the largest channel: the tolerance scales with it
    np.testing.assert_allclose(back, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # H orthogonal: the error's 2-norm per token is the rotated error's, <= sqrt(D) * max scale / 2
    err = np.linalg.norm(back - x, axis=-1)
    bound = np.sqrt(d) * np.asarray(q.scale).astype(np.float32).max(-1) / 2 * (1 + 1e-3) + 1e-5
    assert (err <= bound).all()
    plain = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(x), bits, g), jnp.float32))
    assert np.linalg.norm(back - x) < 0.85 * np.linalg.norm(plain - x)
    assert Q.nbytes(q) == Q.nbytes(Q.quantize(jnp.asarray(x), bits, g))
    e = Q.empty((b, k, n, d), bits, g, layout="rotate")
    assert float(jnp.abs(Q.dequantize(e)).max()) == 0 and e.layout == "rotate" and Q.nbytes(e) == Q.nbytes(q)
    dest = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[::-1], (b, k, n))
    put = Q.put_slots(e, dest, Q.quantize_like(e, jnp.asarray(x)))
    assert put.layout == "rotate"
    np.testing.assert_array_equal(np.asarray(Q.dequantize(put, jnp.float32)), back[..., ::-1, :])
    idx = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[::-1][:5], (b, k, 5))
    # the read-back matmul (y @ H) of a gathered slice may round its last bit differently
    np.testing.assert_allclose(np.asarray(Q.dequantize(Q.take_slots(put, idx), jnp.float32)),
                               back[..., :5, :], rtol=1e-5, atol=1e-5)


def test_eval_budget_bytes_picks_slots_per_kv_quant():
    """`vdjax eval --budget-bytes F` turns F into N for the run's --kv-quant (calibration counted) and refuses
    --budgets beside it."""
    import types

    from vdjax.app.args import UsageError
    from vdjax.app.commands import _eval_budgets

    params = types.SimpleNamespace(config=types.SimpleNamespace(head_dim=256))

    def pick(kvq, group, fractions, budgets=None):
        args = types.SimpleNamespace(budget_bytes=fractions, budgets=budgets, kv_quant=kvq, kv_group=group)
        return _eval_budgets(args, params, 2048)

    assert pick(None, None, [0.25, 0.125]) == [512, 256]
    assert pick("int8", 64, [0.25]) == [963]
    assert pick("int4", 64, [0.25]) == [1820]
    assert pick("int4-smooth", 64, [0.25, 0.125]) == [1816, 906]
    assert pick("int4-smooth-rot", 64, [0.25]) == [1816]  # values rotated: no extra bytes
    assert pick("int4", None, [0.25]) == [2048 * 512 // 4 // 132]  # group None: D, 128 + 4 B a token
    assert pick("int8", 64, None, budgets=[100]) == [100]
    with pytest.raises(UsageError, match="--budget-bytes: give --budgets or --budget-bytes, not both"):
        pick("int8", 64, [0.25], budgets=[100])

"""Quantized KV storage (issue 49): the pure core the cache and attention build on.

A `QuantTensor` stores a [B, K, N, D] key or value tensor as unsigned integer codes with one scale and one
zero (offset) per group, asymmetric min/max as KIVI: x ~= code * scale + zero, code in [0, 2^bits - 1],
zero = the group's minimum, scale = (max - min) / (2^bits - 1), round to nearest (ties to even), clamped.

Layout: **per token**. A group is `group` consecutive channels of one token's head vector (D / group groups
per slot), so every slot [b, k, n] is self-contained: eviction's slot gathers (`take_slots`) and slot
writes (`put_slots`, the same semantics as `cache.scatter_slots` / `cache.select_slots`) move codes, scales
and zeros together, and a token is quantized exactly once, when it is written. KIVI quantizes keys per
channel (groups of G consecutive *tokens* of one channel): in a fixed-size cache that evicts token by token
a group's tokens are scattered over slots that are overwritten one at a time, so every write (and every
eviction) would requantize a whole group from its other members' already-quantized codes, and a streaming
residual of full-precision tokens would be needed as KIVI keeps. experiments/quant_layout.py measures what
that layout would buy on SmolLM2-135M's real keys (results/bytes/layout.md).

Storage:
- int8: `data` uint8 [..., N, D], one code per channel.
- int4: `data` uint8 [..., N, D / 2], two codes per byte: channel 2i in the low nibble, 2i + 1 in the high
  nibble (`pack_int4`).
- `scale`, `zero` [..., N, D / group] in `scale_dtype` (bf16 by default: 2 bytes each per group). They are
  rounded *outward* when stored (zero down, scale up, one ulp where round-to-nearest went the wrong way) so
  the stored grid still covers [min, max]: the per-element error stays <= scale / 2 (plus fp32 rounding)
  whatever the scale dtype. A constant group (max == min) stores scale 0 and round-trips exactly when its
  value is representable in `scale_dtype` (always so for a bf16 cache with bf16 scales).

Smooth keys (`kv_quant="int8-smooth"` / `"int4-smooth"`; values stay plain per token): per-token groups
lose to KIVI's per-channel groups on keys, whose few outlier channels set every group's range. The smooth
layout keeps slots self-contained and moves the channel structure into two fixed [D] vectors per (row, KV
head): a centre c and a factor f calibrated from the first tokens written into the head (`calibrate`:
the written tokens' per-channel mid-range and half-range ** SMOOTH, SmoothQuant-like), and a normalised
Hadamard rotation H (QuaRot-like: spreads what is left of an outlier over all channels). A key is stored
as the per-token quantization of y = ((x - c) / f) @ H and read as x = (y @ H) * f + c (H = H.T = H^-1).
c and f (scale dtype) are stored with the tensor and counted in its bytes (2 * D * itemsize per head and
row, not per token); results/bytes/layout*.md measure the layouts.

Rotated values (`kv_quant="int8-smooth-rot"` / `"int4-smooth-rot"`: keys smooth as above, values in the
"rotate" layout): a value is stored as the per-token quantization of y = x @ H and read as x = y @ H. No
calibration and no extra bytes; the rotation spreads a token's few large channels over all of them, so its
groups' ranges shrink (layout*.md: 1.2-1.3x less value error at int4; smoothing values like keys is worse).

Bytes (one token, one KV head, one of k / v): D * bits / 8 + 2 * (D / group) * itemsize(scale_dtype);
`bytes_per_token`, `nbytes` (exact), `slots_for_bytes`
(N at a fraction of a dense bf16 cache's bytes; `calibration_bytes`: the smooth keys' centre + factor).
Arithmetic is fp32 throughout; `dequantize` casts to the requested dtype at the end.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

KV_QUANT = {None: None, "int8": 8, "int4": 4, "int8-smooth": 8, "int4-smooth": 4,  # name -> bits
            "int8-smooth-rot": 8, "int4-smooth-rot": 4}
SMOOTH = 0.5  # the smooth layout's factor exponent: f = half-range ** SMOOTH (0.5 measured best, layout.md)
FLOOR = 1e-3  # a channel's calibrated half-range at least FLOOR times the head's largest (f stays finite)
BITS = (8, 4)
DEFAULT_SCALE_DTYPE = jnp.bfloat16  # see the module docstring and results/bytes/layout.md
LAYOUT = "token"  # groups of `group` consecutive channels within one token's head vector
LAYOUTS = ("token", "smooth", "rotate")


@flax.struct.dataclass
class QuantTensor:
    """A quantized [..., N, D] tensor (per-token groups): data uint8 [..., N, D * bits / 8], scale and zero
    [..., N, D / group]; x ~= code * scale + zero. `shape` is derived from the arrays (so tree maps, scan
    stacking and vmap keep it right); bits, group, layout and the logical dtype are static."""

    data: jax.Array  # uint8 [..., N, D] (int8) or [..., N, D / 2] (int4, two codes per byte)
    scale: jax.Array  # [..., N, D / group] scale_dtype
    zero: jax.Array  # [..., N, D / group] scale_dtype (the group minimum, in value units)
    bits: int = flax.struct.field(pytree_node=False, default=8)
    group: int = flax.struct.field(pytree_node=False, default=64)
    dtype: Any = flax.struct.field(pytree_node=False, default=jnp.dtype(jnp.float32))  # logical dtype
    layout: str = flax.struct.field(pytree_node=False, default=LAYOUT)
    # smooth layout only: the fixed per-(row, head) channel centre and factor [..., D] (scale_dtype; factor 0:
    # not calibrated yet); None for the token layout
    centre: Any = None
    factor: Any = None

    @property
    def head_dim(self) -> int:
        """D, the logical last axis."""
        return self.data.shape[-1] * 8 // self.bits

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [..., N, D]."""
        return tuple(self.data.shape[:-1]) + (self.head_dim,)

    @property
    def scale_dtype(self):
        """The dtype scales and zeros are stored in."""
        return self.scale.dtype

    @property
    def nbytes(self) -> int:
        """Exact bytes held: packed data + scales + zeros."""
        return nbytes(self)


# ---- validation -------------------------------------------------------------------------------------------

def kv_quant_bits(kv_quant) -> int | None:
    """Bits of a kv_quant name (None -> None, "int8"/"int8-smooth"/"int8-smooth-rot" -> 8, "int4"... -> 4);
    ValueError for anything else."""
    if isinstance(kv_quant, str) or kv_quant is None:
        if kv_quant in KV_QUANT:
            return KV_QUANT[kv_quant]
    raise ValueError(f"kv_quant must be one of {', '.join(map(repr, KV_QUANT))}; got {kv_quant!r}")


def kv_quant_layout(kv_quant) -> str:
    """The key layout of a kv_quant name: "smooth" for the -smooth and -smooth-rot names, else "token"."""
    kv_quant_bits(kv_quant)
    return "smooth" if "-smooth" in str(kv_quant) else "token"


def kv_value_layout(kv_quant) -> str:
    """The value layout of a kv_quant name: "rotate" for the -rot names, else "token"."""
    kv_quant_bits(kv_quant)
    return "rotate" if str(kv_quant).endswith("-rot") else "token"


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in BITS:
        raise ValueError(f"bits must be one of {BITS}; got {bits!r}")
    return int(bits)


def _check_group(group, head_dim: int, bits: int) -> int:
    """The group size (None -> head_dim); ValueError unless a positive divisor of head_dim."""
    if group is None:
        group = head_dim
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(f"group must be a positive int dividing head_dim={head_dim}; got {group!r}")
    if head_dim % group:
        raise ValueError(f"group must divide head_dim={head_dim}; got group={group}")
    if bits == 4 and head_dim % 2:
        raise ValueError(f"int4 packs two channels per byte: head_dim must be even; got head_dim={head_dim}")
    return int(group)


# ---- int4 packing -----------------------------------------------------------------------------------------

def pack_int4(codes: jax.Array) -> jax.Array:
    """Codes [..., D] in [0, 15] -> uint8 [..., D / 2]: channel 2i in the low nibble, 2i + 1 in the high."""
    c = codes.astype(jnp.uint8).reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))  # [..., D/2, 2]
    return (c[..., 0] & 0xF) | (c[..., 1] << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """uint8 [..., D / 2] -> codes uint8 [..., D] in [0, 15] (inverse of `pack_int4`)."""
    p = packed.astype(jnp.uint8)
    both = jnp.stack([p & 0xF, p >> 4], axis=-1)  # [..., D/2, 2]
    return both.reshape(p.shape[:-1] + (p.shape[-1] * 2,))


# ---- the smooth layout's fixed transform ------------------------------------------------------------------

def hadamard(d: int) -> np.ndarray:
    """The normalised Sylvester Hadamard matrix [d, d] (orthogonal, symmetric); d a power of two."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"the smooth layout rotates head vectors by a Hadamard matrix: head_dim must be a "
                         f"power of two; got head_dim={d}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(d))


def _rotate(x: jax.Array) -> jax.Array:
    """x [..., D] fp32 @ H (H symmetric and orthogonal: its own inverse), full fp32 precision everywhere."""
    return jnp.matmul(x, jnp.asarray(hadamard(x.shape[-1])), precision=jax.lax.Precision.HIGHEST)


def calibrate(x: jax.Array, written: jax.Array, scale_dtype=DEFAULT_SCALE_DTYPE) -> tuple:
    """The smooth layout's (centre, factor) [..., D] in scale_dtype from the tokens x [..., S, D] where
    written [..., S]: per channel the mid-range and max(half-range, FLOOR * the head's largest) ** SMOOTH;
    (0, 0) (not calibrated) where no token is written."""
    xf = x.astype(jnp.float32)
    w = written[..., None]
    mx = jnp.max(jnp.where(w, xf, -jnp.inf), axis=-2)  # [..., D]
    mn = jnp.min(jnp.where(w, xf, jnp.inf), axis=-2)
    any_ = jnp.any(written, axis=-1)[..., None]  # [..., 1]
    half = jnp.where(any_, (mx - mn) / 2, 0.0)
    half = jnp.maximum(half, FLOOR * jnp.max(half, axis=-1, keepdims=True))
    factor = jnp.where(any_ & (half > 0), half, jnp.where(any_, 1.0, 0.0)) ** SMOOTH  # constant head: 1
    centre = jnp.where(any_, (mx + mn) / 2, 0.0)
    return centre.astype(scale_dtype), factor.astype(scale_dtype)


def recalibrated(q: QuantTensor, x: jax.Array, written: jax.Array) -> QuantTensor:
    """q with (centre, factor) set from x [..., S, D] where written [..., S] in every (row, head) not yet
    calibrated (factor 0); q itself for the token layout."""
    if q.layout != "smooth":
        return q
    c, f = calibrate(x, written, q.scale_dtype)
    ready = jnp.any(q.factor > 0, axis=-1, keepdims=True)  # [..., 1]
    return q.replace(centre=jnp.where(ready, q.centre, c), factor=jnp.where(ready, q.factor, f))


def quantize_like(q: QuantTensor, x: jax.Array) -> QuantTensor:
    """x [..., S, D] quantized as q is stored (bits, group, scale dtype, layout and q's calibration)."""
    return quantize(x, q.bits, q.group, q.scale_dtype, q.centre, q.factor, rotate=q.layout == "rotate")


# ---- quantize / dequantize --------------------------------------------------------------------------------

def _outward(v: jax.Array, ref: jax.Array, dtype, up: bool) -> jax.Array:
    """fp32 v stored in `dtype`, rounded toward +inf (up) or -inf when round-to-nearest crossed ref."""
    s = v.astype(dtype)
    f = s.astype(jnp.float32)
    if up:
        return jnp.where(f < ref, jnp.nextafter(s, jnp.asarray(jnp.inf, dtype)), s)
    return jnp.where(f > ref, jnp.nextafter(s, jnp.asarray(-jnp.inf, dtype)), s)


def quantize(x: jax.Array, bits: int, group: int | None = None, scale_dtype=DEFAULT_SCALE_DTYPE,
             centre: jax.Array | None = None, factor: jax.Array | None = None,
             rotate: bool = False) -> QuantTensor:
    """x [..., N, D] -> QuantTensor (per-token groups of `group` channels; None = D): asymmetric min/max.
    With centre and factor [..., D] (the smooth layout): ((x - centre) / factor) @ H quantized instead (a
    factor 0, not calibrated, counts as 1); with `rotate` (the rotate layout): x @ H."""
    bits = _check_bits(bits)
    d = x.shape[-1]
    group = _check_group(group, d, bits)
    if rotate and centre is not None:
        raise ValueError("quantize: rotate=True is the rotate layout, centre/factor the smooth one; not both")
    levels = float(2**bits - 1)
    xf = x.astype(jnp.float32)
    if centre is not None:
        f = factor.astype(jnp.float32)[..., None, :]  # [..., 1, D]
        xf = _rotate((xf - centre.astype(jnp.float32)[..., None, :]) / jnp.where(f > 0, f, 1.0))
    elif rotate:
        xf = _rotate(xf)
    xf = xf.reshape(x.shape[:-1] + (d // group, group))  # [..., N, G, g]
    mn = jnp.min(xf, axis=-1)  # [..., N, G]
    mx = jnp.max(xf, axis=-1)
    zero = _outward(mn, mn, scale_dtype, up=False)  # stored <= min
    zf = zero.astype(jnp.float32)
    want = (mx - zf) * np.float32(1 / levels)  # a multiply, as XLA would rewrite a division by a constant
    scale = _outward(want, want, scale_dtype, up=True)  # stored >= (max - zero) / levels
    sf = scale.astype(jnp.float32)
    # times the reciprocal (what XLA makes of a division by a broadcast anyway: explicit, so every backend and
    # the NumPy reference agree bit for bit); constant group: scale 0, every code 0, x = zero
    inv = 1.0 / jnp.where(sf > 0, sf, 1.0)  # [..., N, G]
    codes = jnp.clip(jnp.round((xf - zf[..., None]) * inv[..., None]), 0, levels).astype(jnp.uint8)
    codes = codes.reshape(x.shape)  # [..., N, D]
    data = pack_int4(codes) if bits == 4 else codes
    layout = "smooth" if centre is not None else "rotate" if rotate else LAYOUT
    return QuantTensor(data, scale, zero, bits=bits, group=group, dtype=jnp.dtype(x.dtype),
                       layout=layout, centre=centre, factor=factor)


def codes_of(q: QuantTensor) -> jax.Array:
    """The unpacked integer codes uint8 [..., N, D]."""
    return unpack_int4(q.data) if q.bits == 4 else q.data


def dequantize(q: QuantTensor, dtype=None) -> jax.Array:
    """QuantTensor -> x [..., N, D] in `dtype` (None: the logical dtype): code * scale + zero in fp32."""
    c = codes_of(q).astype(jnp.float32)  # [..., N, D]
    c = c.reshape(c.shape[:-1] + (c.shape[-1] // q.group, q.group))  # [..., N, G, g]
    x = c * q.scale.astype(jnp.float32)[..., None] + q.zero.astype(jnp.float32)[..., None]
    x = x.reshape(q.shape)
    if q.centre is not None:  # the smooth layout: rotate back, times the factor, plus the centre
        fac, cen = (a.astype(jnp.float32)[..., None, :] for a in (q.factor, q.centre))  # [..., 1, D]
        x = _rotate(x) * fac + cen
    elif q.layout == "rotate":
        x = _rotate(x)
    return x.astype(q.dtype if dtype is None else dtype)


def empty(shape, bits: int, group: int | None = None, dtype=jnp.bfloat16,
          scale_dtype=DEFAULT_SCALE_DTYPE, layout: str = LAYOUT) -> QuantTensor:
    """An all-zero QuantTensor of logical shape [..., N, D] (dequantizes to zeros, as `LayerCache.empty`);
    the smooth layout not calibrated yet (centre, factor [..., D] zeros); the rotate layout as the token's."""
    bits = _check_bits(bits)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    shape = tuple(int(s) for s in shape)
    d = shape[-1]
    group = _check_group(group, d, bits)
    lead = shape[:-1]
    groups = lead + (d // group,)
    calib = {}
    if layout != LAYOUT:
        hadamard(d)  # a power of two
    if layout == "smooth":
        calib = {name: jnp.zeros(lead[:-1] + (d,), scale_dtype) for name in ("centre", "factor")}
    return QuantTensor(jnp.zeros(lead + (d * bits // 8,), jnp.uint8), jnp.zeros(groups, scale_dtype),
                       jnp.zeros(groups, scale_dtype), bits=bits, group=group, dtype=jnp.dtype(dtype),
                       layout=layout, **calib)


# ---- slot-axis helpers (the axis eviction gathers and writes: -2 of the logical shape) --------------------

def _leaves(q: QuantTensor) -> tuple[jax.Array, jax.Array, jax.Array]:
    return q.data, q.scale, q.zero


def take_slots(q: QuantTensor, idx: jax.Array) -> QuantTensor:
    """Gather slots: idx [..., M] (in [0, N)) -> QuantTensor [..., M, D] (data, scales, zeros together)."""
    return q.replace(**{name: jnp.take_along_axis(a, idx[..., None], axis=-2)
                        for name, a in zip(("data", "scale", "zero"), _leaves(q), strict=True)})


def pad_slots(q: QuantTensor, axis: int, more: int) -> QuantTensor:
    """q with `more` empty slots appended on the slot `axis` of data, scales and zeros (calibration kept)."""
    def one(a):
        return jnp.pad(a, [(0, 0)] * axis + [(0, more)] + [(0, 0)] * (a.ndim - axis - 1))

    return q.replace(**{name: one(a) for name, a in zip(("data", "scale", "zero"), _leaves(q), strict=True)})


def _check_same(q: QuantTensor, new: QuantTensor) -> None:
    a = (q.bits, q.group, str(q.scale_dtype), q.head_dim, q.layout)
    b = (new.bits, new.group, str(new.scale_dtype), new.head_dim, new.layout)
    if a != b:
        raise ValueError(
            "put_slots: new must be quantized like the buffer (bits, group, scale dtype, head_dim, layout); "
            f"got {b} into {a}")


def scatter_slots(buf: jax.Array, dest: jax.Array, new: jax.Array) -> jax.Array:
    """Write new [..., S, *E] into buf [..., N, *E] at slots dest [..., S] (index N = dropped); the leading
    dims (rows, heads, maybe stacked layers) index alike. (The cache's slot write: `cache` re-exports it.)"""
    lead, s = dest.shape[:-1], dest.shape[-1]
    rows = int(np.prod(lead))
    flat = buf.reshape((rows,) + buf.shape[len(lead):])
    out = flat.at[jnp.arange(rows)[:, None], dest.reshape(rows, s)].set(
        new.reshape((rows, s) + new.shape[len(lead) + 1:]), mode="drop")
    return out.reshape(buf.shape)


def put_slots(q: QuantTensor, dest: jax.Array, new: QuantTensor, fused: bool = True) -> QuantTensor:
    """Write new [..., S, D] into q [..., N, D] at slots dest [..., S] (index N = dropped), codes and scales
    together (the smooth layout: new must be quantized with q's calibration, which is kept). `fused`
    (default): one select per leaf as `cache.select_slots`; else a scatter as `cache.scatter_slots`. Same
    result either way (dest entries other than N must be distinct)."""
    _check_same(q, new)
    if not fused:
        return q.replace(**{name: scatter_slots(a, dest, b) for name, a, b in
                            zip(("data", "scale", "zero"), _leaves(q), _leaves(new), strict=True)})
    s = dest.shape[-1]
    n = q.data.shape[-2]
    rows_new = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), dest.shape)  # [..., S]
    src = scatter_slots(jnp.full(dest.shape[:-1] + (n,), -1, jnp.int32), dest, rows_new)  # [..., N]
    take = jnp.clip(src, 0, s - 1)[..., None]  # [..., N, 1]
    hit = (src >= 0)[..., None]

    def select(buf, rows):
        return jnp.where(hit, jnp.take_along_axis(rows, take, axis=-2), buf)

    return q.replace(**{name: select(a, b) for name, a, b in
                        zip(("data", "scale", "zero"), _leaves(q), _leaves(new), strict=True)})


# ---- bytes ------------------------------------------------------------------------------------------------

def nbytes(q: QuantTensor) -> int:
    """Exact bytes of a QuantTensor: packed data + scales + zeros (+ the smooth layout's centre, factor)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(q))


def bytes_per_token(head_dim: int, bits: int | None, group: int | None = None,
                    scale_dtype=DEFAULT_SCALE_DTYPE, dense_dtype=jnp.bfloat16) -> int:
    """Bytes one token takes in one KV head for one of k / v (bits None: unquantized in `dense_dtype`)."""
    if bits is None:
        return head_dim * jnp.dtype(dense_dtype).itemsize
    bits = _check_bits(bits)
    group = _check_group(group, head_dim, bits)
    return head_dim * bits // 8 + 2 * (head_dim // group) * jnp.dtype(scale_dtype).itemsize


def calibration_bytes(head_dim: int, kv_quant, scale_dtype=DEFAULT_SCALE_DTYPE) -> int:
    """Bytes the smooth layout's key centre + factor take per KV head (0 for the token layout)."""
    return 2 * head_dim * jnp.dtype(scale_dtype).itemsize if kv_quant_layout(kv_quant) == "smooth" else 0


def slots_for_bytes(fraction: float, tokens: int, head_dim: int, kv_quant=None, group: int | None = None,
                    scale_dtype=DEFAULT_SCALE_DTYPE) -> int:
    """Slots N per head whose k + v bytes at `kv_quant` fit in `fraction` of a dense bf16 cache of `tokens`
    tokens (the largest such N, at least 1): N = floor((2 * fraction * tokens * bf16 bytes - calibration)
    / (2 * quantized bytes)), calibration = the smooth layout's key centre + factor (2 * D scale_dtype)."""
    bits = kv_quant_bits(kv_quant)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.floating, np.integer)) or not (
            0 < fraction <= 1):
        raise ValueError(f"fraction must be a number in (0, 1]; got {fraction!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 1:
        raise ValueError(f"tokens must be a positive int; got {tokens!r}")
    dense = tokens * bytes_per_token(head_dim, None)
    per = bytes_per_token(head_dim, bits, group, scale_dtype)
    calib = calibration_bytes(head_dim, kv_quant, scale_dtype)
    return max(1, int((2 * Fraction(fraction) * dense - calib) // (2 * per)))  # exact rational floor

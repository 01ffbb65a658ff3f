"""HF checkpoint folder (config.json + *.safetensors) -> Params, driven by one key table per architecture.

A table row is `(pattern, target, transform)`:
  - `pattern` is an HF tensor name, `{i}` standing for the layer (`model.layers.{i}.mlp.up_proj.weight`);
  - `target` is a path in the weights dict (`"layers.w_up"`, one array per layer in `weights["layers"][i]`, or `"embed"`), or
    None for keys that carry no weights and are skipped on purpose (`rotary_emb.inv_freq`);
  - `transform(w, cfg)` maps the HF tensor to vdjax's layout. It only uses `.T` / `.reshape`, so it runs on
    NumPy arrays and, through `jax.eval_shape`, on shapes alone.
Every shape is checked against `weight_shapes(cfg)` from the headers alone, before any tensor is read; all
missing keys, unexpected keys and shape mismatches are reported together in one ValueError.
A new family is new rows (and a `weight_shapes` switch), not a new code path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from vdjax.models.config import ModelConfig, from_hf_config, resolve_architecture
from vdjax.models.params import Params

Transform = Callable[[Any, ModelConfig], Any]
Row = tuple[str, Optional[str], Optional[Transform]]  # (HF key pattern, weights path, transform)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


# ---- transforms: HF tensor -> vdjax layout (H hidden, Nq/K query/kv heads, D head_dim, F mlp width) ----
def keep(w, cfg: ModelConfig):
    """Unchanged ([V, H] embeddings, [H] norms)."""
    return w


def transpose(w, cfg: ModelConfig):
    """HF Linear [out, in] -> [in, out]."""
    return w.T


def heads_in(w, cfg: ModelConfig):
    """q/k/v_proj [N*D, H] -> [H, N, D]."""
    return w.T.reshape(cfg.hidden_size, -1, cfg.head_dim)


def heads_out(w, cfg: ModelConfig):
    """o_proj [H, Nq*D] -> [Nq, D, H]."""
    return w.T.reshape(-1, cfg.head_dim, cfg.hidden_size)


def heads_bias(b, cfg: ModelConfig):
    """q/k/v_proj bias [N*D] -> [N, D]."""
    return b.reshape(-1, cfg.head_dim)


# ---- tables ----
def _layer_rows(p: str) -> list[Row]:
    """Rows shared by Llama-style decoder layers under the model prefix `p`."""
    layer = p + "layers.{i}."
    return [
        (layer + "input_layernorm.weight", "layers.attn_norm", keep),
        (layer + "self_attn.q_proj.weight", "layers.wq", heads_in),
        (layer + "self_attn.k_proj.weight", "layers.wk", heads_in),
        (layer + "self_attn.v_proj.weight", "layers.wv", heads_in),
        (layer + "self_attn.o_proj.weight", "layers.wo", heads_out),
        (layer + "mlp.gate_proj.weight", "layers.w_gate", transpose),
        (layer + "mlp.up_proj.weight", "layers.w_up", transpose),
        (layer + "mlp.down_proj.weight", "layers.w_down", transpose),
        (layer + "self_attn.rotary_emb.inv_freq", None, None),  # older checkpoints; recomputed from config
    ]


def _model_rows(p: str) -> list[Row]:
    """Embedding, final norm, LM head and weightless keys around the layers."""
    return [
        (p + "embed_tokens.weight", "embed", keep),
        (p + "norm.weight", "final_norm", keep),
        ("lm_head.weight", "lm_head", keep),  # [V, H] as is; dropped (after an equality check) when tied
        (p + "rotary_emb.inv_freq", None, None),
        (p + "rotary_emb.original_inv_freq", None, None),
    ]


def _qkv_bias_rows(p: str) -> list[Row]:
    """q/k/v projection biases (Qwen2/2.5) and the o_proj bias [H] (Llama/Qwen3 with attention_bias)."""
    return [(p + f"layers.{{i}}.self_attn.{n}_proj.bias", f"layers.b{n}", heads_bias) for n in "qkv"] + [
        (p + "layers.{i}.self_attn.o_proj.bias", "layers.bo", keep)]


def _qk_norm_rows(p: str) -> list[Row]:
    """Per-head RMSNorm weights [D] on q and k (Qwen3, Gemma3)."""
    return [(p + f"layers.{{i}}.self_attn.{n}_norm.weight", f"layers.{n}_norm", keep) for n in "qk"]


def _gemma_norm_rows(p: str) -> list[Row]:
    """Gemma's four norms: pre/post attention, pre/post MLP (post_attention_layernorm is *post*-attention)."""
    layer = p + "layers.{i}."
    return [
        (layer + "post_attention_layernorm.weight", "layers.post_attn_norm", keep),
        (layer + "pre_feedforward_layernorm.weight", "layers.mlp_norm", keep),
        (layer + "post_feedforward_layernorm.weight", "layers.post_mlp_norm", keep),
    ]


LLAMA_ROWS: list[Row] = _model_rows("model.") + _layer_rows("model.") + _qkv_bias_rows("model.") + [
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.mlp_norm", keep),
]
QWEN_ROWS: list[Row] = LLAMA_ROWS + _qk_norm_rows("model.")  # rows a config lacks
GEMMA_ROWS: list[Row] = (_model_rows("model.") + _layer_rows("model.") + _gemma_norm_rows("model.")
                         + _qk_norm_rows("model."))


def _gemma3_mm_rows(p: str) -> list[Row]:
    """The multimodal Gemma3 checkpoint: the text model's rows under prefix `p`; the vision tower and the
    projector are read by nobody here (`{*}` matches any rest of the key)."""
    head = "language_model.lm_head.weight" if p.startswith("language_model.") else "lm_head.weight"
    rows = _model_rows(p) + _layer_rows(p) + _gemma_norm_rows(p) + _qk_norm_rows(p)
    rows = [(head if key == "lm_head.weight" else key, t, fn) for key, t, fn in rows]
    top = "" if p.startswith("language_model.") else "model."
    return rows + [(top + "vision_tower.{*}", None, None), (top + "multi_modal_projector.{*}", None, None)]


# Keyed by config.json `architectures[0]`; a row whose target the config does not ask for (e.g. biases of a
# Qwen3 without attention_bias) makes its key "unexpected" if the file has it, "missing" never.
TABLES: dict[str, list[Row] | tuple[list[Row], ...]] = {
    "LlamaForCausalLM": LLAMA_ROWS,
    "Qwen2ForCausalLM": QWEN_ROWS,
    "Qwen3ForCausalLM": QWEN_ROWS,
    "Gemma2ForCausalLM": GEMMA_ROWS,
    "Gemma3ForCausalLM": GEMMA_ROWS,
    # transformers >= 4.52 in memory / older saves: model.language_model.*; transformers 5 (and the Hub's
    # google/gemma-3-*-it) write language_model.model.*: the rows that match more of the file's keys win.
    "Gemma3ForConditionalGeneration": (_gemma3_mm_rows("model.language_model."),
                                       _gemma3_mm_rows("language_model.model.")),
}


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The skeleton: every weight path -> its shape (layer weights per layer, without the leading [L])."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nk = cfg.num_heads, cfg.num_kv_heads
    shapes = {
        "embed": (cfg.vocab_size, h),
        "final_norm": (h,),
        "layers.attn_norm": (h,),
        "layers.wq": (h, nq, d),
        "layers.wk": (h, nk, d),
        "layers.wv": (h, nk, d),
        "layers.wo": (nq, d, h),
        "layers.mlp_norm": (h,),
        "layers.w_gate": (h, f),
        "layers.w_up": (h, f),
        "layers.w_down": (f, h),
    }
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    if cfg.qkv_bias:
        shapes.update({"layers.bq": (nq, d), "layers.bk": (nk, d), "layers.bv": (nk, d)})
    if cfg.o_bias:
        shapes["layers.bo"] = (h,)
    if cfg.qk_norm:
        shapes.update({"layers.q_norm": (d,), "layers.k_norm": (d,)})
    if cfg.post_norms:
        shapes.update({"layers.post_attn_norm": (h,), "layers.post_mlp_norm": (h,)})
    return shapes


# ---- reading ----
def _compile(rows: list[Row]) -> list[tuple[re.Pattern, Row]]:
    """Each row's pattern as an anchored regex with the layer index captured."""
    layer, rest = re.escape("{i}"), re.escape("{*}")
    return [(re.compile(re.escape(p).replace(layer, r"(\d+)").replace(rest, r".*") + r"\Z"), (p, t, fn))
            for p, t, fn in rows]


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder; refuse pickle-only folders."""
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"checkpoint {path}: {INDEX_FILE} lists shards that do not exist: {absent}")
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
        with safe_open(file, framework="flax") as f:
            for key in f.keys():
                s = f.get_slice(key)
                out[key] = (file, tuple(s.get_shape()), s.get_dtype())
    return out


def _read(file: Path, key: str) -> np.ndarray:
    """One tensor as NumPy (bf16 via ml_dtypes; safetensors' numpy framework cannot read bf16)."""
    with safe_open(file, framework="flax") as f:
        return np.asarray(f.get_tensor(key))


def _plan(path: Path, cfg: ModelConfig, rows: list[Row], headers: dict) -> dict[str, dict[int | None, tuple]]:
    """Match every key to a target and check every shape; raise one ValueError listing all problems."""
    expected = weight_shapes(cfg)
    if cfg.tie_embeddings:
        expected["lm_head"] = expected["embed"]  # an optional duplicate, checked against the embedding
    compiled = _compile(rows)
    plan: dict[str, dict[int | None, tuple]] = {}  # target -> {layer or None: (key, transform)}
    unexpected, mismatched = [], []
    found: set[tuple[str, int | None]] = set()  # (target, layer) present in the file, right shape or not
    for key, (_, shape, _) in sorted(headers.items()):
        match = next(((m, row) for rx, row in compiled if (m := rx.match(key))), None)
        if match is None:
            unexpected.append(key)
            continue
        m, (_, target, fn) = match
        if target is None:  # weightless key, ignored on purpose
            continue
        layer = int(m.group(1)) if m.groups() else None
        want = expected.get(target)
        if want is None or (layer is not None and layer >= cfg.num_layers):
            unexpected.append(key)
            continue
        if (target, layer) in found:
            unexpected.append(f"{key} (a second tensor for {target})")
            continue
        found.add((target, layer))
        try:
            got = jax.eval_shape(lambda w: fn(w, cfg), jax.ShapeDtypeStruct(shape, jnp.float32)).shape
        except (TypeError, ValueError):
            got = None
        if got != want:
            mismatched.append(f"{key}: shape {list(shape)} does not give {target} {list(want)} (config)")
            continue
        plan.setdefault(target, {})[layer] = (key, fn)
    missing = []
    for target in expected:
        if target == "lm_head" and cfg.tie_embeddings:
            continue
        pattern = next((p for p, t, _ in rows if t == target), None)
        if pattern is None:
            missing.append(f"<{target}: the table has no row for it>")
            continue
        layers = range(cfg.num_layers) if "{i}" in pattern else [None]
        missing += [pattern.format(i=i) for i in layers if (target, i) not in found]
    if missing or unexpected or mismatched:
        groups = (("missing keys", missing), ("unexpected keys", unexpected),
                  ("shape mismatches", mismatched))
        parts = [f"{name} ({len(items)}): {', '.join(items)}" for name, items in groups if items]
        raise ValueError(f"checkpoint {path} does not match its config.json:\n  " + "\n  ".join(parts))
    return plan


def _set(tree: dict, path: str, value: Any) -> None:
    """tree["a"]["b"] = value for path "a.b"."""
    *parents, leaf = path.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def load_weights(
    path: str | Path, cfg: ModelConfig, rows: list[Row] | tuple[list[Row], ...], dtype: Any = jnp.float32
) -> dict[str, Any]:
    """The weights dict of the safetensors in folder `path`, mapped by `rows`, checked against `cfg`, cast."""
    path = Path(path)
    headers = _headers(_weight_files(path))
    if isinstance(rows, tuple):  # alternative key layouts of one architecture: take the best-matching one
        rows = max(rows, key=lambda r: sum(any(rx.match(k) for rx, _ in _compile(r)) for k in headers))
    plan = _plan(path, cfg, rows, headers)
    dtype = np.dtype(dtype)
    if cfg.tie_embeddings and "lm_head" in plan:
        (head_key, _), = plan.pop("lm_head").values()
        (embed_key, _), = plan["embed"].values()
        if not np.array_equal(_read(headers[head_key][0], head_key), _read(headers[embed_key][0], embed_key)):
            raise ValueError(
                f"checkpoint {path}: config.json ties embeddings (tie_word_embeddings) but {head_key} "
                f"differs from {embed_key}; fix tie_word_embeddings or the weights"
            )
    weights: dict[str, Any] = {}
    for target, by_layer in plan.items():
        if None in by_layer:  # a global weight
            key, fn = by_layer[None]
            _set(weights, target, jnp.asarray(fn(_read(headers[key][0], key).astype(dtype), cfg)))
        else:  # one tensor per layer: weights["layers"][i][name]
            layers = weights.setdefault("layers", [{} for _ in range(cfg.num_layers)])
            for i in range(cfg.num_layers):
                key, fn = by_layer[i]
                layers[i][target.split(".", 1)[1]] = jnp.asarray(fn(_read(headers[key][0], key).astype(dtype), cfg))
    weights["layers"] = tuple(weights.get("layers", ()))
    return weights


def load_hf_checkpoint(path: str | Path, dtype: Any = jnp.float32) -> Params:
    """Load an HF checkpoint folder (config.json + safetensors) into Params cast to `dtype`."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"checkpoint {path}: no config.json (expected an HF checkpoint folder)")
    hf_config = json.loads((path / "config.json").read_text())
    generation = path / "generation_config.json"
    generation = json.loads(generation.read_text()) if generation.is_file() else None
    cfg = from_hf_config(hf_config, generation)  # refuses unsupported architectures and math it cannot reproduce
    arch = resolve_architecture(hf_config)
    if arch not in TABLES:
        raise ValueError(
            f"checkpoint {path}: no weight table for architecture {arch!r}; have {sorted(TABLES)}"
        )
    return Params(weights=load_weights(path, cfg, TABLES[arch], dtype), config=cfg, source=str(Path(path).resolve()))

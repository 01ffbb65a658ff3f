"""config.json (and generation_config.json) -> ModelConfig, through the family declarations
(`families.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vdjax.models.config import ModelConfig
from vdjax.models.families import ARCHITECTURES

# HF config attributes every family reads generically, or that do not change the forward math (bookkeeping,
# training-only, I/O flags). A family's own keys are in its spec (`Family.reads`).
_GENERIC_KEYS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
        "output_hidden_states", "output_attentions", "return_dict", "use_cache", "initializer_range",
        "attention_dropout", "pretraining_tp", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
        "label2id", "problem_type", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
        "max_position_embeddings",
        "tie_word_embeddings", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
        "rope_scaling", "rope_parameters", "hidden_act", "attention_bias", "mlp_bias", "tokenizer_class",
        "_attn_implementation_autoset", "tf_legacy_loss", "use_bfloat16", "torchscript", "pruned_heads",
        "finetuning_task", "task_specific_params", "cross_attention_hidden_size", "add_cross_attention",
        "is_decoder", "tie_encoder_decoder", "decoder_start_token_id", "sep_token_id", "prefix",
        "bad_words_ids", "begin_suppress_tokens", "suppress_tokens", "_commit_hash", "transformers.js_config",
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "num_return_sequences",
        "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
        "remove_invalid_values", "exponential_decay_length_penalty", "chat_template", "embedding_dropout",
        "resid_pdrop", "attn_pdrop", "embd_pdrop",
    }
)
_ROPE_TYPES = ("default", "llama3", "linear", "yarn")


def supported_architectures() -> tuple[str, ...]:
    """HF architecture names vdjax reads (`models/families.py`)."""
    return tuple(ARCHITECTURES)


def _freeze(value: Any) -> Any:
    """Lists/dicts -> tuples so the config stays hashable."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _one_rope(params: Mapping[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) of one rope_parameters/rope_scaling dict."""
    params = dict(params)
    theta = float(params.pop("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, (None if rope_type == "default" else params)


def _rope_settings(hf: Mapping[str, Any], family):
    """((theta, scaling), (local theta, local scaling) or None) from `rope_parameters` (transformers 5, maybe
    nested per layer type) or the older `rope_theta`/`rope_scaling`/`rope_local_base_freq`."""
    params = hf.get("rope_parameters")
    if not params and not hf.get("rope_scaling"):
        params = family.defaults.get("rope_parameters")  # (GPT-OSS: YaRN when config.json says nothing)
    base = float(hf.get("rope_theta", family.defaults.get("rope_theta", 10000.0)))
    if params and ("full_attention" in params or "sliding_attention" in params):
        full = _one_rope(params.get("full_attention") or {}, base)
        local = _one_rope(params.get("sliding_attention") or {},
                          float(hf.get("rope_local_base_freq", 10000.0)))
        return full, local
    if params:
        full = _one_rope(params, base)
    else:
        full = (base, None)
        scaling = hf.get("rope_scaling")
        if scaling:
            full = _one_rope(dict(scaling) | {"rope_theta": base}, base)
    if family.local_rope:  # older Gemma3 configs: rope_scaling is global-only, local base separate
        return full, (float(hf.get("rope_local_base_freq", 10000.0)), None)
    return full, None


def _check_scaling(scaling, problems: list[str], max_positions: int):
    """Normalise a scaling dict (rope_type key; YaRN's HF defaults filled in: original_max_position_embeddings
    = max_position_embeddings, factor = their ratio) and record an unhandled rope type."""
    if scaling is None:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in _ROPE_TYPES:
        problems.append(f"rope type {rope_type!r} (handled: {_ROPE_TYPES})")
    scaling = {k: v for k, v in scaling.items() if k != "type"}
    scaling["rope_type"] = rope_type
    if rope_type == "yarn":
        scaling["original_max_position_embeddings"] = int(scaling.get("original_max_position_embeddings")
                                                          or max_positions)
        if scaling.get("factor") is None:
            scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return _freeze(scaling)


def resolve_architecture(hf: Mapping[str, Any]):
    """The `Arch` of a config.json (its `architectures[0]`, else from `model_type`); refuse others."""
    archs = tuple(hf.get("architectures") or ())
    model_type = hf.get("model_type", "<none>")
    by_type = {t: a for a in ARCHITECTURES.values() for t in a.model_types}
    name = archs[0] if archs else getattr(by_type.get(model_type), "name", model_type)
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r} (config.json 'architectures'); supported: "
                         f"{tuple(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def _ids(value: Any) -> tuple[int, ...]:
    """A token id or list of ids (or None) as a tuple of ints."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def stop_ids(eos: Any, generation: Mapping[str, Any] | None = None) -> tuple[int, ...]:
    """EOS ids: config.json's `eos` (an id or a list), then those only generation_config.json has
    (Llama-3-Instruct's <|eot_id|>, Gemma-it's <end_of_turn> live there alone): transformers stops at both."""
    return tuple(dict.fromkeys(_ids(eos) + _ids((generation or {}).get("eos_token_id"))))


def _problems(hf: Mapping[str, Any], outer: Mapping[str, Any], arch) -> list[str]:
    """Every setting of the config vdjax cannot reproduce: the family's refusals,
    generic ones, unknown keys."""
    problems = list(arch.family.problems(hf))
    rope = hf.get("rope_parameters") or {}
    partial = (rope.get("partial_rotary_factor") if isinstance(rope, Mapping) else None) or hf.get(
        "partial_rotary_factor")
    if partial not in (None, 1, 1.0) and "partial_rotary_factor" not in arch.family.reads:
        problems.append(f"partial_rotary_factor={partial} (partial RoPE is handled for Qwen3.5 only)")
    quant = hf.get("quantization_config") or outer.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        if method not in arch.family.quantizations:
            allowed = arch.family.quantizations or "none (unquantized checkpoints only)"
            problems.append(f"quantization_config.quant_method={method!r} ({arch.name} reads: {allowed})")
    if hf.get("mlp_bias", False):
        problems.append("mlp_bias=True (MLP biases are not handled)")
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=True (vdjax is causal)")
    known = _GENERIC_KEYS | arch.family.reads | {"quantization_config"}  # (checked above)
    unknown = sorted(k for k in hf if k not in known and not k.startswith("_"))
    if outer is not hf:
        unknown += sorted(k for k in outer if k not in known and not k.startswith("_")
                          and k not in arch.outer_keys)
    for key in unknown:
        value = hf.get(key, outer.get(key))
        if value not in (None, False, 0, "", [], {}):
            problems.append(f"{key}={value!r} (attribute not understood by the {arch.name} converter)")
    return problems


def _quant_method(hf: Mapping[str, Any], outer: Mapping[str, Any]) -> str | None:
    """The checkpoint's quantization method (quantization_config.quant_method), or None."""
    quant = hf.get("quantization_config") or outer.get("quantization_config")
    return None if not quant else str(quant.get("quant_method") if isinstance(quant, Mapping) else quant)


def from_hf_config(hf: Mapping[str, Any], generation: Mapping[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from a parsed HF config.json (and generation_config.json, for its EOS ids); refuse
    architectures or math it does not handle (every problem named at once)."""
    arch = resolve_architecture(hf)
    outer, family = hf, arch.family
    if arch.nested:
        hf = dict(hf.get("text_config") or {})
        if not hf:
            raise ValueError(f"{arch.name} config.json has no text_config")
    problems = _problems(hf, outer, arch)
    (theta, scaling), local = _rope_settings(hf, family)
    max_positions = int(hf.get("max_position_embeddings", 8192))
    scaling = _check_scaling(scaling, problems, max_positions)
    local_theta, local_scaling = (None, None) if local is None else (
        local[0], _check_scaling(local[1], problems, max_positions))
    if dict(local_scaling or ()).get("rope_type") == "yarn":
        problems.append("YaRN on the sliding layers' own RoPE (handled on the global RoPE only)")
    if problems:
        raise ValueError("config.json has settings vdjax cannot reproduce exactly: " + "; ".join(problems))

    def get(key, default=None):  # the text config's value, else the outer config's, else the family default
        return hf.get(key, outer.get(key, family.defaults.get(key, default)))

    heads, layers = int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    types = (family.layer_types(hf, layers) if family.layer_types else
             tuple(hf.get("layer_types") or ("full_attention",) * layers))
    return ModelConfig(
        family=family.name, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_layers=layers, num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or hf["hidden_size"] // heads),
        rms_norm_eps=float(get("rms_norm_eps", 1e-5)), rope_theta=theta, rope_scaling=scaling,
        local_rope_theta=local_theta, local_rope_scaling=local_scaling,
        tie_embeddings=bool(outer.get("tie_word_embeddings", False) if arch.tie_outer
                            else get("tie_word_embeddings", False)), layer_types=types,
        sliding_window=int(get("sliding_window")) if "sliding_attention" in types else None,
        bos_token_id=get("bos_token_id"), eos_token_ids=stop_ids(get("eos_token_id"), generation),
        pad_token_id=get("pad_token_id"), quantization=_quant_method(hf, outer),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        **family.switches(hf),
    )

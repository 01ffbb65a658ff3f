"""Frozen, hashable model configuration: one transformer, per-family switches, built from HF config.json."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
_MODEL_TYPES = {"llama": "LlamaForCausalLM"}  # used when config.json has no `architectures`

# HF config attributes that do not change the forward math (bookkeeping, training-only, I/O flags).
_IGNORED_KEYS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
        "output_hidden_states", "output_attentions", "return_dict", "use_cache", "initializer_range",
        "attention_dropout", "pretraining_tp", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
        "label2id", "problem_type", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
        "tie_word_embeddings", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
        "rope_parameters", "hidden_act", "attention_bias", "mlp_bias", "tokenizer_class", "quantization_config",
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
_ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder-only transformer (hashable: a valid jit static argument)."""

    family: str  # "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # (("rope_type", "llama3"), ("factor", 8.0), ...) as a sorted tuple of items, or None.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_embeddings: bool = False
    mlp_act: str = "silu"  # gated MLP activation: "silu" | "gelu_tanh"
    norm_offset: float = 0.0  # RMSNorm weight is (norm_offset + w): 1.0 for Gemma
    embed_scale: bool = False  # multiply embeddings by sqrt(hidden_size) (Gemma)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma3)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default head_dim)
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    post_norms: bool = False  # extra norms after attention and MLP (Gemma2/3)
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_position_embeddings: int = 8192

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group)."""
        return self.num_heads // self.num_kv_heads

    @property
    def attn_scale(self) -> float:
        """Scale applied to q·k logits."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        """RoPE scaling parameters as a dict ({} for plain RoPE)."""
        return dict(self.rope_scaling or ())


def _freeze(value: Any) -> Any:
    """Lists/dicts -> tuples so the config stays hashable."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _rope_settings(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from either `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    params = hf.get("rope_parameters")
    if params:
        params = dict(params)
        theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return theta, (None if rope_type == "default" else params)
    scaling = hf.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    return float(hf.get("rope_theta", 10000.0)), scaling


def from_hf_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed HF config.json; refuse architectures or math it does not handle."""
    archs = tuple(hf.get("architectures") or ())
    model_type = hf.get("model_type", "<none>")
    arch = archs[0] if archs else _MODEL_TYPES.get(model_type, model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} (config.json 'architectures'); supported: {SUPPORTED_ARCHITECTURES}"
        )
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.get('hidden_act')!r} (only 'silu' is handled for {arch})")
    if hf.get("attention_bias", False):
        problems.append("attention_bias=True (Llama q/k/v/o biases are not handled)")
    if hf.get("mlp_bias", False):
        problems.append("mlp_bias=True (MLP biases are not handled)")
    theta, scaling = _rope_settings(hf)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type not in _ROPE_TYPES:
            problems.append(f"rope type {rope_type!r} (handled: {_ROPE_TYPES})")
        scaling = {k: v for k, v in scaling.items() if k != "type"}
        scaling["rope_type"] = rope_type
    unknown = sorted(k for k in hf if k not in _IGNORED_KEYS and not k.startswith("_"))
    for key in unknown:
        if hf[key] not in (None, False, 0, "", [], {}):
            problems.append(f"{key}={hf[key]!r} (attribute not understood by the {arch} converter)")
    if problems:
        raise ValueError("config.json has settings vdjax cannot reproduce exactly: " + "; ".join(problems))

    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return ModelConfig(
        family="llama",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=_freeze(scaling) if scaling else None,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
    )

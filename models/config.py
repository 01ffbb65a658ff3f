"""Frozen, hashable model configuration: one transformer, per-family switches, built from HF config.json."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder-only transformer (hashable: a valid jit static argument)."""

    family: str  # a key of models/families.py FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # global (full-attention) layers
    # (("rope_type", "llama3"), ("factor", 8.0), ...) as a sorted tuple of items, or None.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    local_rope_theta: float | None = None  # sliding layers, when they differ (Gemma3: 10k local / 1M global)
    local_rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_embeddings: bool = False
    mlp_act: str = "silu"  # gated MLP activation: "silu" | "gelu_tanh"
    norm_offset: float = 0.0  # RMSNorm weight is (norm_offset + w): 1.0 for Gemma
    embed_scale: bool = False  # multiply embeddings by sqrt(hidden_size) (Gemma)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3 plain w, Gemma3 (1 + w))
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default head_dim)
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" | "linear_attention" per layer
    sliding_window: int | None = None
    post_norms: bool = False  # norms on the attention and MLP outputs before the residual add (Gemma2/3)
    qkv_bias: bool = False  # q/k/v projection biases (Qwen2; Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # output projection bias (Llama/Qwen3 with attention_bias)
    attn_gate: bool = False  # q_proj also yields a gate per head: attention output x sigmoid(gate) (Qwen3.5)
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of each head (None: all; Qwen3.5: D/4)
    # Gated DeltaNet ("linear_attention" layers, Qwen3.5): key/value heads, their dims, the conv kernel
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    sinks: bool = False  # a learned logit per query head joins every softmax, then is dropped (GPT-OSS)
    # mixture of experts (GPT-OSS): router top-k, softmax over the k logits, clamped SwiGLU experts with
    # biases
    num_experts: int = 0
    experts_per_token: int = 0
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # how the checkpoint stores weights ("mxfp4": GPT-OSS experts); loading only
    quantization: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_position_embeddings: int = 8192

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types {bad} not handled; allowed: {LAYER_TYPES}")
        if "linear_attention" in self.layer_types:
            dims = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                    self.linear_value_head_dim, self.linear_conv_kernel)
            if min(dims) < 1 or self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_attention layers need linear heads / dims / conv kernel >= 1 and "
                                 f"value heads a multiple of key heads, got {dims}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and in (0, "
                             f"head_dim={self.head_dim}]")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding layers but sliding_window is not set")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be in [1, num_experts="
                             f"{self.num_experts}]")
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

    @property
    def rope_attention_factor(self) -> float:
        """YaRN's attention factor, folded into RoPE's cos and sin (so q.k scales
        by its square); 1 otherwise."""
        return yarn_attention_factor(self.rope_scaling_dict)

    def attends(self, layer: int) -> bool:
        """Whether `layer` has attention (and a KV cache); False for Gated DeltaNet layers."""
        return self.layer_types[layer] != "linear_attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers with a KV cache (every layer but the linear-attention ones)."""
        return tuple(i for i in range(self.num_layers) if self.attends(i))

    def window(self, layer: int) -> int | None:
        """The sliding window W of `layer` (q_pos - kv_pos < W is visible), or None for a global layer."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def rope(self, layer: int) -> tuple[float, dict[str, Any]]:
        """(theta, scaling dict) of `layer`: the local pair on sliding layers where the config has one."""
        if self.layer_types[layer] == "sliding_attention" and self.local_rope_theta is not None:
            return self.local_rope_theta, dict(self.local_rope_scaling or ())
        return self.rope_theta, self.rope_scaling_dict


def yarn_attention_factor(scaling: Mapping[str, Any]) -> float:
    """The attention factor of a YaRN scaling dict (HF `_compute_yarn_parameters`): `attention_factor` if
    given, else 0.1 ln(factor) + 1 (or the ratio of the mscale / mscale_all_dim terms); 1 for other types."""
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale()

"""Every model family, declared once: its HF architectures, config switches and weights (see
`models/spec.py`).

Adding a family: a `Family` (switches + weights) and its `Arch` entries here, the math its switches turn on in
`models/transformer.py`, and tests (parity with HF on a tiny random model).
"""

from __future__ import annotations

from collections.abc import Mapping

from vdjax.models.spec import (
    Arch,
    Family,
    Layout,
    Weight,
    heads_bias,
    heads_in,
    heads_out,
    keep,
    q_heads_in,
    transpose,
)

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


# ---- weight groups ----------------------------------------------------------------------------------------
def _attends(cfg, layer) -> bool:
    """`when` of an attention weight: every layer but a Gated DeltaNet one."""
    return cfg.attends(layer)


def _has(switch: str):
    """`when` of an attention weight present only where the config switch is on."""
    return lambda cfg, layer: bool(getattr(cfg, switch)) and cfg.attends(layer)


def _linear(cfg, layer) -> bool:
    """`when` of a Gated DeltaNet weight."""
    return not cfg.attends(layer)


MODEL = (
    Weight("embed", ("vocab", "hidden"), "embed_tokens.weight", init="embed", layer=False),
    Weight("final_norm", ("hidden",), "norm.weight", init="norm", layer=False),
    # [V, H] as is; absent with tied embeddings (a file's equal duplicate is checked and dropped)
    Weight("lm_head", ("vocab", "hidden"), "^lm_head.weight", layer=False),
)
ATTENTION = (
    Weight("wq", ("hidden", "q_heads", "q_dim"), "self_attn.q_proj.weight", q_heads_in, when=_attends),
    Weight("wk", ("hidden", "kv_heads", "head_dim"), "self_attn.k_proj.weight", heads_in, when=_attends),
    Weight("wv", ("hidden", "kv_heads", "head_dim"), "self_attn.v_proj.weight", heads_in, when=_attends),
    Weight("wo", ("q_heads", "head_dim", "hidden"), "self_attn.o_proj.weight", heads_out, when=_attends),
    Weight("bq", ("q_heads", "head_dim"), "self_attn.q_proj.bias", heads_bias, when=_has("qkv_bias")),
    Weight("bk", ("kv_heads", "head_dim"), "self_attn.k_proj.bias", heads_bias, when=_has("qkv_bias")),
    Weight("bv", ("kv_heads", "head_dim"), "self_attn.v_proj.bias", heads_bias, when=_has("qkv_bias")),
    Weight("bo", ("hidden",), "self_attn.o_proj.bias", when=_has("o_bias")),
    Weight("q_norm", ("head_dim",), "self_attn.q_norm.weight", init="norm", when=_has("qk_norm")),
    Weight("k_norm", ("head_dim",), "self_attn.k_norm.weight", init="norm", when=_has("qk_norm")),
)
MLP = (
    Weight("w_gate", ("hidden", "mlp"), "mlp.gate_proj.weight", transpose),
    Weight("w_up", ("hidden", "mlp"), "mlp.up_proj.weight", transpose),
    Weight("w_down", ("mlp", "hidden"), "mlp.down_proj.weight", transpose),
)
# Llama: a norm before each sublayer; HF calls the second one post_attention_layernorm
LLAMA_NORMS = (
    Weight("attn_norm", ("hidden",), "input_layernorm.weight", init="norm"),
    Weight("mlp_norm", ("hidden",), "post_attention_layernorm.weight", init="norm"),
)
# Gemma: norms before and after both sublayers (post_attention_layernorm is *post*-attention here)
GEMMA_NORMS = (
    Weight("attn_norm", ("hidden",), "input_layernorm.weight", init="norm"),
    Weight("post_attn_norm", ("hidden",), "post_attention_layernorm.weight", init="norm"),
    Weight("mlp_norm", ("hidden",), "pre_feedforward_layernorm.weight", init="norm"),
    Weight("post_mlp_norm", ("hidden",), "post_feedforward_layernorm.weight", init="norm"),
)


# Gated DeltaNet (Qwen3.5's linear-attention layers; `models/deltanet.py`)
def _lin_heads_in(w, cfg):
    """in_proj_z [Hv*dv, H] -> [H, Hv, dv]."""
    return w.T.reshape(cfg.hidden_size, cfg.linear_num_value_heads, -1)


def _lin_heads_out(w, cfg):
    """out_proj [H, Hv*dv] -> [Hv, dv, H]."""
    return w.T.reshape(cfg.linear_num_value_heads, -1, cfg.hidden_size)


def _conv_taps(w, cfg):
    """conv1d [C, 1, K] -> [K, C] (tap K - 1 multiplies the current token)."""
    return w.reshape(w.shape[0], -1).T


DELTANET = (
    Weight("w_qkv", ("hidden", "lin_qkv"), "linear_attn.in_proj_qkv.weight", transpose, when=_linear),
    Weight("w_z", ("hidden", "lin_v_heads", "lin_dv"), "linear_attn.in_proj_z.weight", _lin_heads_in,
           when=_linear),
    Weight("w_b", ("hidden", "lin_v_heads"), "linear_attn.in_proj_b.weight", transpose, when=_linear),
    Weight("w_a", ("hidden", "lin_v_heads"), "linear_attn.in_proj_a.weight", transpose, when=_linear),
    Weight("conv_w", ("conv_kernel", "lin_qkv"), "linear_attn.conv1d.weight", _conv_taps, when=_linear),
    Weight("dt_bias", ("lin_v_heads",), "linear_attn.dt_bias", keep, init="gain", when=_linear),
    Weight("A_log", ("lin_v_heads",), "linear_attn.A_log", keep, when=_linear),
    Weight("dn_norm", ("lin_dv",), "linear_attn.norm.weight", keep, init="gain", when=_linear),  # plain w
    Weight("w_out", ("lin_v_heads", "lin_dv", "hidden"), "linear_attn.out_proj.weight", _lin_heads_out,
           when=_linear),
)


# GPT-OSS: a learned sink logit per query head; a mixture of experts instead of the MLP
def _gate_up(w, cfg):
    """gate_up_proj [E, H, 2F] (gate and up columns interleaved) -> [E, H, 2F] as [gate | up]."""
    return w.reshape(*w.shape[:-1], -1, 2).swapaxes(-1, -2).reshape(w.shape)


SINKS = (Weight("sinks", ("q_heads",), "self_attn.sinks", keep),)
MOE = (
    Weight("router_w", ("hidden", "routes"), "mlp.router.weight", transpose),  # replicated: every row routes
    Weight("router_b", ("routes",), "mlp.router.bias", keep),
    Weight("moe_gate_up", ("experts", "hidden", "gate_up"), "mlp.experts.gate_up_proj",
           _gate_up),  # [in, out]
    Weight("moe_gate_up_b", ("experts", "gate_up"), "mlp.experts.gate_up_proj_bias", _gate_up),
    Weight("moe_down", ("experts", "mlp", "hidden"), "mlp.experts.down_proj", keep),
    Weight("moe_down_b", ("experts", "hidden"), "mlp.experts.down_proj_bias", keep),
)


# ---- config switches --------------------------------------------------------------------------------------
def _llama_switches(hf: Mapping) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias)


def _qwen2_switches(hf: Mapping) -> dict:
    return dict(qkv_bias=True, o_bias=bool(hf.get("attention_bias", False)))


def _qwen3_switches(hf: Mapping) -> dict:
    return _llama_switches(hf) | dict(qk_norm=True)


def _gemma_switches(hf: Mapping) -> dict:
    return dict(mlp_act="gelu_tanh", norm_offset=1.0, embed_scale=True, post_norms=True,
                attn_softcap=float(hf["attn_logit_softcapping"]) if hf.get("attn_logit_softcapping")
                else None,
                final_softcap=float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping")
                else None,
                query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]) if hf.get("query_pre_attn_scalar")
                else None)


def _gemma3_switches(hf: Mapping) -> dict:
    return _gemma_switches(hf) | dict(qk_norm=True)


def _qwen3_5_switches(hf: Mapping) -> dict:
    rope = dict(hf.get("rope_parameters") or {})
    factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    return dict(norm_offset=1.0, qk_norm=True, attn_gate=True, rotary_dim=int(head_dim * factor),
                linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
                linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
                linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)))


def _gpt_oss_switches(hf: Mapping) -> dict:
    bias = bool(hf.get("attention_bias", True))
    return dict(qkv_bias=bias, o_bias=bias, sinks=True,
                num_experts=int(hf.get("num_local_experts", hf.get("num_experts", 128))),
                experts_per_token=int(hf.get("num_experts_per_tok", hf.get("experts_per_token", 4))),
                swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def _gpt_oss_problems(hf: Mapping) -> list[str]:
    out = []
    if (hf.get("attn_logit_softcapping") or hf.get("final_logit_softcapping")
            or hf.get("query_pre_attn_scalar")):
        out.append("logit softcapping / query_pre_attn_scalar for GPT-OSS (only Gemma's is handled)")
    return out


def _qwen3_5_layers(hf: Mapping, n: int) -> tuple[str, ...]:
    """`layer_types`, else every `full_attention_interval`-th layer (default 4) attends, the
    others are Gated DeltaNet layers."""
    every = int(hf.get("full_attention_interval", 4))
    return tuple(hf.get("layer_types") or ("linear_attention" if (i + 1) % every else "full_attention"
                                          for i in range(n)))


def _qwen3_5_problems(hf: Mapping) -> list[str]:
    out = _silu_only("Qwen3.5")(hf)
    if hf.get("attention_bias", False):
        out.append("attention_bias=True (not handled for Qwen3.5)")
    return out


def _silu_only(arch: str):
    """Refusals shared by the non-Gemma families."""
    def problems(hf: Mapping) -> list[str]:
        out = []
        act = hf.get("hidden_act") or "silu"
        if act != "silu":
            out.append(f"hidden_act={act!r} (handled for {arch}: ('silu',))")
        if hf.get("attn_logit_softcapping") or hf.get("final_logit_softcapping"):
            out.append(f"logit softcapping for {arch} (only Gemma's is handled)")
        if hf.get("query_pre_attn_scalar"):
            out.append(f"query_pre_attn_scalar for {arch} (only Gemma's is handled)")
        return out
    return problems


def _gemma_problems(hf: Mapping) -> list[str]:
    out = []
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        out.append(f"hidden_act={act!r} (handled for Gemma: {_GELU_TANH})")
    if hf.get("attention_bias", False):
        out.append("attention_bias=True (not handled for Gemma)")
    return out


# ---- layer patterns ---------------------------------------------------------------------------------------
def _qwen_layers(hf: Mapping, n: int) -> tuple[str, ...]:
    """Qwen2/3: sliding layers only with use_sliding_window (from max_window_layers on); HF ignores
    layer_types' sliding entries otherwise (the window is None)."""
    if not hf.get("use_sliding_window", False):
        return ("full_attention",) * n
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    first = int(hf.get("max_window_layers", n))
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))


def _gemma2_layers(hf: Mapping, n: int) -> tuple[str, ...]:
    return tuple(hf.get("layer_types") or ("sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(n)))


def _gemma3_layers(hf: Mapping, n: int) -> tuple[str, ...]:
    every = int(hf.get("sliding_window_pattern", 6))
    return tuple(hf.get("layer_types") or ("sliding_attention" if (i + 1) % every else "full_attention"
                                          for i in range(n)))


_QWEN_READS = frozenset({"use_sliding_window", "max_window_layers", "sliding_window", "layer_types"})
_GEMMA_READS = frozenset({"hidden_activation", "query_pre_attn_scalar", "sliding_window", "layer_types",
                          "attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq",
                          "sliding_window_pattern", "cache_implementation", "use_bidirectional_attention"})

LLAMA = Family("llama", MODEL + LLAMA_NORMS + ATTENTION + MLP, _llama_switches,
               frozenset({"layer_types", "sliding_window"}), problems=_silu_only("LlamaForCausalLM"))
QWEN2 = Family("qwen2", LLAMA.weights, _qwen2_switches, _QWEN_READS, _qwen_layers,
               _silu_only("Qwen2ForCausalLM"))
QWEN3 = Family("qwen3", LLAMA.weights, _qwen3_switches, _QWEN_READS, _qwen_layers,
               _silu_only("Qwen3ForCausalLM"))
_GEMMA_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": True}
GEMMA2 = Family("gemma2", MODEL + GEMMA_NORMS + ATTENTION + MLP, _gemma_switches, _GEMMA_READS,
                _gemma2_layers, _gemma_problems, defaults=_GEMMA_DEFAULTS)
GEMMA3 = Family("gemma3", GEMMA2.weights, _gemma3_switches, _GEMMA_READS, _gemma3_layers, _gemma_problems,
                defaults=_GEMMA_DEFAULTS | {"rope_theta": 1_000_000.0}, local_rope=True)

# Qwen3.5: gated attention every 4th layer, Gated DeltaNet in between; (1+w) norms everywhere (q/k-norm too)
# but the DeltaNet output norm (plain w); partial RoPE (the text model's mRoPE sections give 1-D positions).
# Read but without effect in HF's modeling code (and so here): attn_output_gate (it always gates),
# mamba_ssm_dtype (the rule runs in fp32), mtp_* (the multi-token-prediction head, skipped), mlp_only_layers.
QWEN3_5 = Family("qwen3_5", MODEL + LLAMA_NORMS + ATTENTION + MLP + DELTANET, _qwen3_5_switches,
                 frozenset({"layer_types", "full_attention_interval", "linear_num_key_heads",
                            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                            "linear_conv_kernel_dim", "partial_rotary_factor", "attn_output_gate",
                            "mamba_ssm_dtype", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
                            "mlp_only_layers", "output_gate_type"}),
                 _qwen3_5_layers, _qwen3_5_problems, defaults={"rms_norm_eps": 1e-6})

# GPT-OSS: q/k/v/o biases, plain RMSNorm, sliding (128) and full layers alternating, YaRN RoPE (its attention
# factor in cos/sin), learned sinks, a mixture of experts; MXFP4 expert weights dequantized on load.
# Read without effect on inference: router_aux_loss_coef, output_router_logits (training), the redundant
# experts_per_token / initial_context_length; hidden_act (the experts use their own clamped SwiGLU).
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
GPT_OSS = Family("gpt_oss", MODEL + LLAMA_NORMS + ATTENTION + SINKS + MOE, _gpt_oss_switches,
                 frozenset({"layer_types", "sliding_window", "num_local_experts", "num_experts",
                            "num_experts_per_tok", "experts_per_token", "swiglu_limit", "swiglu_alpha",
                            "router_aux_loss_coef", "output_router_logits", "initial_context_length"}),
                 _gemma2_layers, _gpt_oss_problems, quantizations=("mxfp4",),
                 defaults={"head_dim": 64, "rope_theta": 150000.0, "rope_parameters": _GPT_OSS_ROPE,
                           "sliding_window": 128})

FAMILIES = {f.name: f for f in (LLAMA, QWEN2, QWEN3, GEMMA2, GEMMA3, QWEN3_5, GPT_OSS)}

# The multimodal Gemma3 checkpoint: the text model under a language-model prefix; the vision tower and the
# projector are read by nobody here. transformers >= 4.52 in memory / older saves: model.language_model.*;
# transformers 5 (and the Hub's google/gemma-3-*-it) write language_model.model.*.
_GEMMA3_MM = (
    Layout("model.language_model.", "", ("model.vision_tower.{*}", "model.multi_modal_projector.{*}")),
    Layout("language_model.model.", "language_model.", ("vision_tower.{*}", "multi_modal_projector.{*}")),
)
_MM_KEYS = frozenset({"text_config", "vision_config", "mm_tokens_per_image", "boi_token_index",
                      "eoi_token_index", "image_token_index", "image_token_id", "initializer_range"})

# Qwen3.5 checkpoints: the released (multimodal) layout keeps the text model under model.language_model.*
# beside model.visual.* and mtp.*, lm_head at the top; Qwen3_5ForCausalLM.save_pretrained writes model.*.
_QWEN3_5_SKIP = ("model.visual.{*}", "mtp.{*}")
_QWEN3_5_LAYOUTS = (Layout("model.language_model.", "", _QWEN3_5_SKIP), Layout("model.", "", _QWEN3_5_SKIP))
_QWEN3_5_MM_KEYS = frozenset({"text_config", "vision_config", "image_token_id", "video_token_id",
                              "vision_start_token_id", "vision_end_token_id", "initializer_range"})

ARCHITECTURES = {a.name: a for a in (
    Arch("LlamaForCausalLM", LLAMA, ("llama",)),
    Arch("Qwen2ForCausalLM", QWEN2, ("qwen2",)),
    Arch("Qwen3ForCausalLM", QWEN3, ("qwen3",)),
    Arch("Gemma2ForCausalLM", GEMMA2, ("gemma2",)),
    Arch("Gemma3ForCausalLM", GEMMA3, ("gemma3_text",)),
    Arch("Gemma3ForConditionalGeneration", GEMMA3, ("gemma3",), nested=True, layouts=_GEMMA3_MM,
         outer_keys=_MM_KEYS),
    Arch("GptOssForCausalLM", GPT_OSS, ("gpt_oss",)),
    Arch("Qwen3_5ForCausalLM", QWEN3_5, ("qwen3_5_text",), layouts=_QWEN3_5_LAYOUTS[::-1]),
    # HF ties the multimodal model's embeddings by the top-level tie_word_embeddings, not text_config's
    Arch("Qwen3_5ForConditionalGeneration", QWEN3_5, ("qwen3_5",), nested=True, layouts=_QWEN3_5_LAYOUTS,
         outer_keys=_QWEN3_5_MM_KEYS, tie_outer=True),
)}

"""Family specs: every weight declared once, and everything that follows from the declaration.

A `Weight` names one array (its key in `Params.weights` or in a layer's dict), its shape as named dimensions
(sizes from the config: `dims(cfg)`), its Hugging Face key, the transform from the HF tensor to vdjax's
layout, its random init, and when the config has it. A `Family` is the HF architectures it reads, the config
switches it sets (`switches(hf) -> dict` of `ModelConfig` fields) and its weights. From that one declaration:

- `expected(cfg)`:         every (path, layer) with its shape -- the converter's targets and shape checks;
- `hf_rows(cfg, layout)`:  HF key pattern -> (path, transform), plus the keys skipped on purpose;
- `abstract(cfg, dtype)`:  the weights pytree as `jax.ShapeDtypeStruct`s (shapes before any memory exists);
- `init_params(cfg, seed)`: random weights (tests, benchmarks);
- `split_axis(...)`:       which axis of a weight splits over the mesh's "model" axis
(`vdjax.engine.sharding`).

Dimension names: vocab, hidden, q_heads, kv_heads, head_dim, mlp (plus those a family adds, e.g. experts).
Heads split over "model" when the KV heads divide by its size, `mlp` (and
`experts`) when they divide. """

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

Transform = Callable[[Any, Any], Any]  # (HF tensor or shape, ModelConfig) -> vdjax layout


# ---- transforms: HF tensor -> vdjax layout (only .T / .reshape, so they run on shapes too) ----------------
def keep(w, cfg):
    """Unchanged ([V, H] embeddings, [H] norms)."""
    return w


def transpose(w, cfg):
    """HF Linear [out, in] -> [in, out]."""
    return w.T


def heads_in(w, cfg):
    """k/v_proj [N*D, H] -> [H, N, D]."""
    return w.T.reshape(cfg.hidden_size, -1, cfg.head_dim)


def q_heads_in(w, cfg):
    """q_proj [Nq*Dq, H] -> [H, Nq, Dq] (Dq = D, or 2D with an output gate: [query_h | gate_h] per head)."""
    return w.T.reshape(cfg.hidden_size, cfg.num_heads, -1)


def heads_out(w, cfg):
    """o_proj [H, Nq*D] -> [Nq, D, H]."""
    return w.T.reshape(-1, cfg.head_dim, cfg.hidden_size)


def heads_bias(b, cfg):
    """q/k/v_proj bias [N*D] -> [N, D]."""
    return b.reshape(-1, cfg.head_dim)


def always(cfg, layer) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight array of a family.

    `hf` is the HF key: for a layer weight relative to the layer (`self_attn.q_proj.weight`), for a
    model-level weight relative to the model prefix (`embed_tokens.weight`), or `^lm_head.weight` for a key
    relative to the head prefix (outside the model). `init`: "normal" (N(0, 1) x scale), "embed" (x 3 scale),
    "norm" (the family's identity norm weight 1 - norm_offset, plus noise), "gain" (1 plus noise: a
    plain-weight norm whatever the family's offset), "zeros", "ones". `when(cfg, layer)`: whether the config
    has this weight (at this layer; layer None for model-level weights).
    """

    name: str
    dims: tuple[str, ...]
    hf: str
    transform: Transform = keep
    init: str = "normal"
    when: Callable[[Any, Any], bool] = always
    layer: bool = True

    def shape(self, cfg) -> tuple[int, ...]:
        """The shape under `cfg` (per layer for layer weights)."""
        sizes = dims(cfg)
        return tuple(sizes[d] for d in self.dims)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a checkpoint keeps the text model: key prefixes and what it holds that vdjax never reads."""

    prefix: str = "model."  # before embed_tokens / layers / norm
    head: str = ""  # before lm_head.weight
    ignored: tuple[str, ...] = ()  # key patterns skipped on purpose ({*} = anything)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its config switches (from HF config.json) and its weights.

    `switches(hf)` returns the family's `ModelConfig` fields from the (text) config dict, `reads` the HF keys
    it reads (any other key that is set and not generic is refused by name), `layer_types(hf, n)` the default
    per-layer attention kinds when config.json has no `layer_types`,
    `problems(hf)` the settings it refuses. """

    name: str
    weights: tuple[Weight, ...]
    switches: Callable[[Mapping], dict]
    reads: frozenset[str] = frozenset()
    layer_types: Callable[[Mapping, int], tuple[str, ...]] | None = None
    problems: Callable[[Mapping], list[str]] = lambda hf: []
    # HF defaults of generic keys where this family's differ (rms_norm_eps, tie_word_embeddings, rope_theta)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    quantizations: tuple[str, ...] = ()  # quantization_config.quant_method values the converter reads
    local_rope: bool = False  # sliding layers have their own RoPE base (Gemma3: 10k local / 1M global)
    ignored: tuple[str, ...] = ("layers.{i}.self_attn.rotary_emb.inv_freq", "rotary_emb.inv_freq",
                                "rotary_emb.original_inv_freq")  # weightless keys (recomputed from config)

    def weight(self, name: str) -> Weight:
        """The declaration of weight `name`."""
        for w in self.weights:
            if w.name == name:
                return w
        raise KeyError(f"family {self.name!r} declares no weight {name!r}")


@dataclasses.dataclass(frozen=True)
class Arch:
    """An HF architecture name: its family, whether config.json nests the text model under `text_config`,
    and the key layouts its checkpoints use (the best-matching one is taken)."""

    name: str
    family: Family
    model_types: tuple[str, ...] = ()
    nested: bool = False
    layouts: tuple[Layout, ...] = (Layout(),)
    outer_keys: frozenset[str] = frozenset()  # top-level config keys of a nested config, not the text model's
    tie_outer: bool = False  # a nested config ties embeddings by its top-level tie_word_embeddings


# ---- derivations ------------------------------------------------------------------------------------------
def dims(cfg) -> dict[str, int]:
    """Named dimension sizes of a config."""
    v_heads, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {"vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "q_heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "mlp": cfg.intermediate_size,
            "q_dim": cfg.head_dim * (2 if cfg.attn_gate else 1),  # query (+ gate) per head
            # Gated DeltaNet: the [q | k | v] projection, value heads, their dim, the conv kernel
            "lin_qkv": 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + v_heads * dv,
            "lin_v_heads": v_heads, "lin_dv": dv, "conv_kernel": cfg.linear_conv_kernel,
            # mixture of experts: experts (split over "model"), the router's outputs (replicated), gate | up
            "experts": cfg.num_experts, "routes": cfg.num_experts, "gate_up": 2 * cfg.intermediate_size}


HEAD_AXES = ("q_heads", "kv_heads")
SPLIT_AXES = ("experts", "mlp", "lin_v_heads")

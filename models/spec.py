"""Family specs: every weight declared once, and everything that follows from the declaration.

A `Weight` names one array (its key in `Params.weights` or in a layer's dict), its shape as named dimensions
(sizes from the config: `dims(cfg)`), its Hugging Face key, the transform from the HF tensor to vdjax's layout,
its random init, and when the config has it. A `Family` is the HF architectures it reads, the config switches
it sets (`switches(hf) -> dict` of `ModelConfig` fields) and its weights. From that one declaration:

- `expected(cfg)`:         every (path, layer) with its shape -- the converter's targets and shape checks;
- `hf_rows(cfg, layout)`:  HF key pattern -> (path, transform), plus the keys skipped on purpose;
- `abstract(cfg, dtype)`:  the weights pytree as `jax.ShapeDtypeStruct`s (shapes before any memory exists);
- `init_params(cfg, seed)`: random weights (tests, benchmarks);
- `split_axis(...)`:       which axis of a weight splits over the mesh's "model" axis (`vdjax.sharding`).

Dimension names: vocab, hidden, q_heads, kv_heads, head_dim, mlp (plus those a family adds, e.g. experts).
Heads split over "model" when the KV heads divide by its size, `mlp` (and `experts`) when they divide.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

if TYPE_CHECKING:
    from vdjax.models.config import ModelConfig

Transform = Callable[[Any, "ModelConfig"], Any]


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

    `hf` is the HF key: for a layer weight relative to the layer (`self_attn.q_proj.weight`), for a model-level
    weight relative to the model prefix (`embed_tokens.weight`), or `^lm_head.weight` for a key relative to the
    head prefix (outside the model). `init`: "normal" (N(0, 1) x scale), "embed" (x 3 scale), "norm" (the
    family's identity norm weight 1 - norm_offset, plus noise), "gain" (1 plus noise: a plain-weight norm
    whatever the family's offset), "zeros", "ones". `when(cfg, layer)`: whether
    the config has this weight (at this layer; layer None for model-level weights).
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
    per-layer attention kinds when config.json has no `layer_types`, `problems(hf)` the settings it refuses.
    """

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


def family_of(cfg) -> Family:
    """The Family of a config."""
    from vdjax.models.families import FAMILIES

    if cfg.family not in FAMILIES:
        raise ValueError(f"config family {cfg.family!r} has no spec; known: {sorted(FAMILIES)}")
    return FAMILIES[cfg.family]


def present(cfg, weight: Weight, layer: int | None) -> bool:
    """Whether `cfg` has `weight` (at `layer`): lm_head only with untied embeddings, then `weight.when`."""
    if weight.name == "lm_head" and cfg.tie_embeddings:
        return False
    return bool(weight.when(cfg, layer))


def expected(cfg) -> dict[tuple[str, int | None], tuple[int, ...]]:
    """{(weight name, layer or None): shape} of every array the config has."""
    out = {}
    for w in family_of(cfg).weights:
        for layer in (range(cfg.num_layers) if w.layer else [None]):
            if present(cfg, w, layer):
                out[w.name, layer] = w.shape(cfg)
    return out


def hf_key(weight: Weight, layout: Layout) -> str:
    """The HF key pattern of a weight in a layout (`{i}` = the layer)."""
    if weight.hf.startswith("^"):
        return layout.head + weight.hf[1:]
    return layout.prefix + ("layers.{i}." if weight.layer else "") + weight.hf


def hf_rows(cfg, layout: Layout) -> tuple[dict[str, Weight], tuple[str, ...]]:
    """(HF key pattern -> Weight of the family, key patterns skipped on purpose) in `layout`."""
    fam = family_of(cfg)
    rows = {hf_key(w, layout): w for w in fam.weights}
    skipped = tuple(layout.prefix + k for k in fam.ignored) + layout.ignored
    return rows, skipped


def abstract(cfg, dtype=np.float32) -> dict[str, Any]:
    """The weights pytree of `cfg` as `jax.ShapeDtypeStruct`s: {"embed": ..., "layers": ({...}, ...)}."""
    import jax

    tree: dict[str, Any] = {"layers": tuple({} for _ in range(cfg.num_layers))}
    for (name, layer), shape in expected(cfg).items():
        leaf = jax.ShapeDtypeStruct(shape, dtype)
        if layer is None:
            tree[name] = leaf
        else:
            tree["layers"][layer][name] = leaf
    return tree


def _draw(cfg, w: Weight, normal: Callable, scale: float):
    """One weight's random values (see `Weight.init`); `normal(shape)` gives N(0, 1) fp32 noise (NumPy on the
    host or jax on the device: the arithmetic is the same)."""
    shape = w.shape(cfg)
    if w.init in ("zeros", "ones"):
        return np.full(shape, 1.0 if w.init == "ones" else 0.0, np.float32)
    noise = normal(shape) * scale
    if w.init == "embed":
        return noise * 3
    if w.init in ("norm", "gain"):
        return (1.0 - (cfg.norm_offset if w.init == "norm" else 0.0)) + noise * 0.3
    return noise


_NORMAL = None


def _device_normal(key):
    """N(0, 1) noise drawn on the device by one jitted sampler (a program per distinct shape)."""
    import jax

    global _NORMAL
    if _NORMAL is None:
        _NORMAL = jax.jit(lambda k, s: jax.random.normal(k, s), static_argnums=1)
    return lambda shape: _NORMAL(key, shape)


def init_params(cfg, seed: int = 0, *, scale: float = 0.3, dtype=np.float32, on_device: bool = False,
                source: str | None = None):
    """Random Params of `cfg`: every declared weight, weight i drawn from `np.random.default_rng((seed, i))`
    (a weight's values do not depend on the others), cast to `dtype` and put on the default device.

    `on_device=True` draws on the device instead (jax.random from key(seed), fold_in(i)): for models too large
    to draw on the host quickly (benchmarks); other values than the host draw.
    """
    import jax
    import jax.numpy as jnp

    from vdjax.models.params import Params

    tree = abstract(cfg)
    fam = family_of(cfg)
    for i, (name, layer) in enumerate(expected(cfg)):
        if on_device:
            normal = _device_normal(jax.random.fold_in(jax.random.key(seed), i))
        else:
            rng = np.random.default_rng((seed, i))
            normal = lambda shape, rng=rng: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
        value = jnp.asarray(_draw(cfg, fam.weight(name), normal, np.float32(scale)), dtype)
        (tree if layer is None else tree["layers"][layer])[name] = value
    return Params(weights=tree, config=cfg, source=source)


def split_axis(cfg, name: str, model_size: int) -> int | None:
    """The axis of weight `name` that splits over a "model" mesh axis of `model_size`, or None (replicated).

    Head axes split when the KV heads divide by it (the query heads then follow), other splittable axes
    (mlp, experts, ...) when their own size divides.
    """
    w = family_of(cfg).weight(name)
    sizes = dims(cfg)
    for axis, d in enumerate(w.dims):
        if d in HEAD_AXES and sizes["kv_heads"] % model_size == 0:
            return axis
        if d in SPLIT_AXES and sizes[d] % model_size == 0:
            return axis
    return None


HEAD_AXES = ("q_heads", "kv_heads")
SPLIT_AXES = ("experts", "mlp", "lin_v_heads")

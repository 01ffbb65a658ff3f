"""The params pytree: weight arrays plus the static config they belong to."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

from vdjax.models.config import ModelConfig


@flax.struct.dataclass
class Params:
    """Model weights (a dict pytree, one dict per layer) carrying their config.

    weights = {
      "embed": [V, H], "final_norm": [H], "lm_head": [V, H] (absent when embeddings are tied),
      "layers": ({"attn_norm": [H], "wq": [H, Nq, D], "wk": [H, K, D], "wv": [H, K, D], "wo": [Nq, D, H],
                  "mlp_norm": [H], "w_gate": [H, F], "w_up": [H, F], "w_down": [F, H],
                  # where the config asks: "bq": [Nq, D], "bk"/"bv": [K, D] (qkv_bias), "bo": [H] (o_bias),
                  # "q_norm"/"k_norm": [D] (qk_norm), "post_attn_norm"/"post_mlp_norm": [H] (post_norms)
                 }, ...)  # L dicts
    }
    Layers are separate arrays, not stacked on an [L] axis: XLA on CPU copies a layer's slice of a stacked
    array before each matmul, which doubles the weight traffic of a decode step.
    """

    weights: dict[str, Any]
    config: ModelConfig = flax.struct.field(pytree_node=False)
    source: str | None = flax.struct.field(pytree_node=False, default=None)  # checkpoint folder it came from

    @property
    def dtype(self):
        """Dtype of the embedding table (the model's compute dtype)."""
        return self.weights["embed"].dtype

    def nbytes(self) -> int:
        """Total bytes of all weight arrays."""
        return sum(x.nbytes for x in jax.tree.leaves(self.weights))

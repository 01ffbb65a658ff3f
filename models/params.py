"""The params pytree: weight arrays plus the static config they belong to."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

from vdjax.models.config import ModelConfig


@flax.struct.dataclass
class Params:
    """Model weights (a dict pytree, layer weights stacked on a leading [L] axis) carrying their config.

    weights = {
      "embed": [V, H], "final_norm": [H], "lm_head": [V, H] (absent when embeddings are tied),
      "layers": {"attn_norm": [L, H], "wq": [L, H, Nq, D], "wk": [L, H, K, D], "wv": [L, H, K, D],
                 "wo": [L, Nq, D, H], "mlp_norm": [L, H], "w_gate": [L, H, F], "w_up": [L, H, F],
                 "w_down": [L, F, H]},
    }
    """

    weights: dict[str, Any]
    config: ModelConfig = flax.struct.field(pytree_node=False)

    @property
    def dtype(self):
        """Dtype of the embedding table (the model's compute dtype)."""
        return self.weights["embed"].dtype

    def nbytes(self) -> int:
        """Total bytes of all weight arrays."""
        return sum(x.nbytes for x in jax.tree.leaves(self.weights))

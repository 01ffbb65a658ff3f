"""The params pytree: weight arrays plus the static config they belong to."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

from vdjax.models.config import ModelConfig


@flax.struct.dataclass
class Params:
    """Model weights (a dict pytree, one dict per layer) carrying their config.

    weights = {"embed": [V, H], "final_norm": [H], ..., "layers": ({"wq": [H, Nq, D], ...}, ...)}: every
    array, its shape and when a config has it are declared once in the family spec (`models/families.py`);
    `vdjax.models.weights.abstract(cfg)` lists them for a config. Layers are separate arrays, not stacked on
    an [L] axis: XLA on CPU copies a layer's slice of a stacked array before each matmul, which doubles the
    weight traffic of a decode step. The layer scan reads `engine.forms.scan_form(params)`: the same weights
    stacked over layer groups under weights["layer_groups"], made once per params object (`forms.SCAN_FORMS`).
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

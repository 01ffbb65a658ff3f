"""vdjax: bounded-memory LLM inference by KV-cache eviction (ValueDiff and its baselines) in JAX.

    params = vdjax.load("smollm2-135m")
    tok = vdjax.load_tokenizer("smollm2-135m")
    out = vdjax.generate(params, ids, policy="valuediff", budget=256)
"""

from vdjax import hybrid as _hybrid  # noqa: F401  (registers the "hybrid" policy)
from vdjax.cache import KVCache, LayerCache, keep_mask, topk_gather
from vdjax.pipeline import Generation, generate, prefill, run
from vdjax.policies import POLICIES, AttnInfo, Policy, combine, get_policy, protect_recent, protect_sinks, register
from vdjax.sharding import make_mesh, shard_params

__all__ = [
    "AttnInfo", "Generation", "KVCache", "LayerCache", "POLICIES", "Policy", "combine", "generate", "get_policy",
    "keep_mask", "load", "load_tokenizer", "make_mesh", "prefill", "protect_recent", "protect_sinks", "register",
    "run", "shard_params", "topk_gather",
]


def load(name_or_path, dtype=None):
    """Load a registered model name (e.g. "smollm2-135m") or a local HF checkpoint folder -> Params."""
    from vdjax import registry

    return registry.load(name_or_path) if dtype is None else registry.load(name_or_path, dtype=dtype)


def load_tokenizer(name_or_path):
    """The HF tokenizer (chat template included) of a registered model name or local checkpoint folder."""
    from vdjax import registry

    return registry.load_tokenizer(name_or_path)

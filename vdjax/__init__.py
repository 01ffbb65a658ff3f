"""vdjax: bounded-memory LLM inference by KV-cache eviction (ValueDiff and its baselines) in JAX.

    params = vdjax.load("smollm2-135m")
    tok = vdjax.load_tokenizer("smollm2-135m")
    out = vdjax.generate(params, ids, policy="valuediff", budget=256)
    vdjax.answer(params, tok, context, question, policy="valuediff", budget=256).text   # text in, text out
"""

from vdjax import hybrid as _hybrid  # noqa: F401  (registers the "hybrid" policy)
from vdjax.cache import KVCache, LayerCache, keep_mask, topk_gather
from vdjax.pipeline import Generation, continuation_logprobs, generate, prefill, run
from vdjax.policies import POLICIES, AttnInfo, Policy, combine, get_policy, protect_recent, protect_sinks, register
from vdjax.sharding import make_mesh, shard_params
from vdjax.text import Answer, answer

__all__ = [
    "Answer", "answer", "AttnInfo", "Generation", "KVCache", "LayerCache", "POLICIES", "Policy", "combine",
    "continuation_logprobs", "generate", "get_policy",
    "keep_mask", "load", "load_tokenizer", "make_mesh", "prefill", "protect_recent", "protect_sinks", "register",
    "run", "shard_params", "topk_gather",
]


def load(name_or_path, dtype=None, revision=None):
    """Params of a registered name ("smollm2-135m"), a local HF checkpoint folder or a Hub id ("Qwen/Qwen3-4B",
    at `revision`); dtype None: fp32 on CPU, the checkpoint's dtype on GPU/TPU ("bfloat16" etc. to force)."""
    from vdjax import registry

    return registry.load(name_or_path, dtype, revision)


def load_tokenizer(name_or_path, revision=None):
    """The HF tokenizer (chat template included) of a registered name, local checkpoint folder or Hub id."""
    from vdjax import registry

    return registry.load_tokenizer(name_or_path, revision)

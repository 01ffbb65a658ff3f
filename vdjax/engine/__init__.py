"""The engine: the evicting KV cache, policies, the jit programs of block prefill and decode, sampling and
sharding.

Modules: `cache` (slots and top-k), `scores` (score functions), `policies` (registry, binding, composition),
`adaptive` (layer and head budgets),
`mixes` (the hybrid's score and saved mixes), `inputs` (checks, buckets, `plan`), `forms` (unrolled / scanned
layer forms), `evict` (scoring and planning an eviction), `programs` (the jit programs), `placement` (mesh
placement), `compiler` (compiling behind), `api` (the public calls), `timing` (compile-aware timings),
`sampling`, `sharding`. The engine imports nothing from `vdjax.analysis`,
`vdjax.eval` or `vdjax.app`. """

from vdjax.engine.api import Generation, compile_prefill, continuation_logprobs, generate, prefill, run
from vdjax.engine.cache import KVCache, LayerCache, keep_mask, kept_positions, topk_gather
from vdjax.engine.policies import (
                                   POLICIES,
                                   AttnInfo,
                                   BoundPolicy,
                                   Policy,
                                   adakv,
                                   bind,
                                   chunkkv,
                                   combine,
                                   criticaladakv,
                                   criticalkv,
                                   get_policy,
                                   protect_recent,
                                   protect_sinks,
                                   pyramidkv,
                                   register,
)
from vdjax.engine.sharding import make_mesh, shard_params

__all__ = [
    "AttnInfo", "BoundPolicy", "Generation", "KVCache", "LayerCache", "POLICIES", "Policy", "adakv", "bind",
    "chunkkv", "combine", "compile_prefill", "continuation_logprobs", "criticaladakv", "criticalkv",
    "generate", "get_policy", "keep_mask", "kept_positions", "make_mesh", "prefill", "protect_recent",
    "protect_sinks", "pyramidkv", "register", "run", "shard_params", "topk_gather",
]

"""vdjax: bounded-memory LLM inference by KV-cache eviction (ValueDiff and its baselines) in JAX.

    params = vdjax.load("smollm2-135m")
    tok = vdjax.load_tokenizer("smollm2-135m")
    out = vdjax.generate(params, ids, policy="valuediff", budget=256)
    vdjax.answer(params, tok, context, question, policy="valuediff", budget=256).text   # text in, text out

Sub-packages by layer: `engine` (cache, policies, programs), `loading` (registry, Hub, compile cache),
`text`, `analysis` (geometry, calibration, hybrid mixes), `app` (CLI, demo);
`models`, `convert`, `eval`. """

from vdjax import loading as _loading
from vdjax.engine import (
    POLICIES,
    AttnInfo,
    BoundPolicy,
    Generation,
    KVCache,
    LayerCache,
    Policy,
    adakv,
    bind,
    chunkkv,
    combine,
    continuation_logprobs,
    criticaladakv,
    criticalkv,
    generate,
    get_policy,
    keep_mask,
    kept_positions,
    make_mesh,
    prefill,
    protect_recent,
    protect_sinks,
    pyramidkv,
    register,
    run,
    shard_params,
    topk_gather,
)
from vdjax.loading import compile_cache, load_tokenizer
from vdjax.text import Answer, answer

__all__ = [
    "Answer", "answer", "AttnInfo", "BoundPolicy", "Generation", "KVCache", "LayerCache", "POLICIES",
    "Policy", "adakv", "bind", "chunkkv", "combine", "compile_cache", "continuation_logprobs",
    "criticaladakv", "criticalkv", "generate", "get_policy", "keep_mask", "kept_positions", "load",
    "load_tokenizer", "make_mesh", "prefill", "protect_recent", "protect_sinks", "pyramidkv", "register",
    "run", "shard_params", "topk_gather",
]


def load(name_or_path, dtype=None, revision=None):
    """Params of a registered name ("smollm2-135m"), a local HF checkpoint folder or a Hub id
    ("Qwen/Qwen3-4B",
    at `revision`); dtype None: fp32 on CPU, the checkpoint's dtype on GPU/TPU ("bfloat16" etc. to force).
    Switches the persistent compile cache on (`vdjax.compile_cache`; VDJAX_COMPILE_CACHE=0 keeps it off)."""
    compile_cache()
    return _loading.load(name_or_path, dtype, revision)

"""Shared test helpers: tiny random models without any download."""

import jax.numpy as jnp
import numpy as np

from vdjax.models.config import ModelConfig
from vdjax.models.params import Params
from vdjax.models.weights import init_params


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer GQA Llama-style config small enough to compile in about a second."""
    kw = dict(family="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, rope_theta=10000.0, eos_token_ids=(), max_position_embeddings=4096)
    kw.update(overrides)
    return ModelConfig(**kw)


def random_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.3) -> Params:
    """Random weights of every array the family spec declares (`spec.init_params`; scale large enough for
    peaked, seed-dependent attention)."""
    return init_params(cfg, seed, scale=scale)


def random_ids(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """n random token ids."""
    return np.random.RandomState(seed).randint(0, vocab, size=n).astype(np.int32)


def layer0_kv(params: Params, ids: np.ndarray):
    """Layer-0 keys (after RoPE) and values of the whole prompt: [K, T, D] each (dense, no eviction)."""
    from vdjax.models import transformer as tf

    cfg = params.config
    lw = params.weights["layers"][0]
    x = tf.embed(params, jnp.asarray(ids)[None])
    h = tf.rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    pos = jnp.arange(len(ids))[None]
    _, k, v, _ = tf.project_qkv(lw, h, pos, cfg, jnp.asarray(tf.rope_inv_freq(cfg)))
    return np.asarray(k[0].transpose(1, 0, 2)), np.asarray(v[0].transpose(1, 0, 2))


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(chat: bool = True):
    """A byte-level BPE (any text encodes) trained on the haystack sentences, with ChatML specials."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from vdjax.app.needle import ANSWER_PREFIX, INSTRUCTION, NEEDLE, NOISE, QUESTION

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = list(NOISE) + [
        NEEDLE,
        QUESTION,
        INSTRUCTION,
        ANSWER_PREFIX,
        "What is the capital of France? Paris. The magic number.",
    ]
    tok.train_from_iterator(text * 20, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML if chat else None,
    )


def policy_kwargs(policy: str, params: Params) -> dict:
    """The keywords a registered policy needs on a model without saved calibration data: hybrid's mix,
    qfilter's filters (fixed random ones of the model's [L][K][D] shape) and kvzip's replay prompt ids."""
    if policy == "hybrid":
        return {"mix": 0.5}
    if policy == "qfilter":
        cfg = params.config
        shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        return {"filters": np.random.RandomState(0).randn(*shape).tolist()}
    if policy == "kvzip":  # the replay prompts as ids (a random model has no tokenizer to read them from)
        return {"repeat_ids": (1, 2, 3), "continue_ids": (4, 5), "suffix_ids": (6,)}
    return {}

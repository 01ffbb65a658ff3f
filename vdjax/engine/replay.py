"""KVzip's context replay in true block mode (kvpress `KVzipPress`, arXiv 2505.23416).

After a block's tokens enter, a replay stream runs beside them through every layer: the repeat prompt, the
chat template's assistant turn (`suffix_ids`) and the block's tokens again, at the positions right after the
block. At each attention layer the replay attends to the layer's candidates (the cache, then the block) and
to itself, and each block token's score is the most attention it receives from a replay query
(`scores.replay_attention`); the score is carried per slot. The first block replays after "Repeat the previous
context exactly."; later blocks after "Repeat the part of the previous context exactly, starting with" and the
8 tokens before the block (kvpress's chunks: with `block_size >= T <= chunk_size` and a batch of one the
replay is kvpress's). A decoded token (and an appended question block) replays after the first prompt: the
tokens before it are not carried. The replay's own keys and values are dropped after each layer.
Unlike kvpress with a chat-template model, every prompt token is replayed: kvpress leaves the template's
prefix (the tokens before the user's text) out of the replay, scored 0 but for its sinks; vdjax does not know
where a prompt's template ends. With kvpress's ids given (`repeat_ids`, `continue_ids`, `suffix_ids`) and a
prompt without a template, the kept positions are kvpress's (tests/test_vs_kvpress.py).
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from vdjax.checks import check_int
from vdjax.models import transformer as tf
from vdjax.models.params import Params

PREV_POSTFIX = 8  # tokens of the previous chunk after the "starting with" prompt (kvpress's prepare)
REPEAT = "\n\nRepeat the previous context exactly."
CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with"


def replay_ids_from_tokenizer(tokenizer) -> dict[str, tuple[int, ...]]:
    """kvpress's replay prompts as ids: the repeat and continue prompts, and the suffix (the chat template's
    text between a user message and the assistant's answer; "\\n" without a template)."""
    if tokenizer.chat_template is None:
        suffix = "\n"
    else:
        dummy = "dummy context"
        sep = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + sep}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
        suffix = text.split(sep)[1]

    def ids(text):
        return tuple(int(i) for i in tokenizer.encode(text, add_special_tokens=False))

    return {"repeat_ids": ids(REPEAT), "continue_ids": ids(CONTINUE), "suffix_ids": ids(suffix)}


def bind_kvzip(params: Params, hyper, budget=None):
    """Resolve the replay ids: None -> from the checkpoint's tokenizer (a clear error when the model has no
    folder); given ones are checked (non-empty sequences of ids in the vocabulary)."""
    hyper = dict(hyper)
    names = ("repeat_ids", "continue_ids", "suffix_ids")
    if any(hyper.get(n) is None for n in names):
        if params.source is None:
            raise ValueError("policy 'kvzip' needs its replay prompts as ids: this model has no checkpoint "
                             "folder to read a tokenizer from; pass repeat_ids=, continue_ids= and "
                             "suffix_ids=")
        from transformers import AutoTokenizer

        found = replay_ids_from_tokenizer(AutoTokenizer.from_pretrained(str(params.source)))
        hyper.update({n: found[n] for n in names if hyper.get(n) is None})
    vocab = params.config.vocab_size
    for n in names:
        try:
            ids = tuple(operator.index(i) for i in hyper[n]) if not isinstance(hyper[n], (str, bytes)) else ()
        except TypeError:
            ids = ()
        if (not ids or any(isinstance(i, (bool, np.bool_)) for i in hyper[n])
                or not all(0 <= i < vocab for i in ids)):
            raise ValueError(f"policy 'kvzip': {n} must be a non-empty sequence of token ids in "
                             f"[0, {vocab}), got {hyper[n]!r}")
        hyper[n] = ids
    hyper["chunk_size"] = check_int("chunk_size", hyper["chunk_size"])
    return tuple(sorted(hyper.items()))


def replay_feature(v, weights, **_) -> jax.Array:
    """KVzip's `Policy.token_feature` marker: the programs compute the feature (the replay's attention) and
    pass it in; called directly it refuses."""
    raise ValueError("kvzip's per-token scores come from the replay the programs run (Policy.replay)")


def replay_stream(params: Params, hyper: dict, tok, q_pos, prev=None, first=None):
    """The replay of a block tok [B, S] at q_pos [B, S] (-1 = padding): (embeddings [B, R, H], positions
    [B, R], -1 = padding). `prev` [B, 8]: the tokens before the block, used (after the continue prompt) where
    `first` (a traced bool) is False; None: the first prompt. Each row's replay starts right after its block's
    last position; a row without tokens in the block replays nothing."""
    head = tuple(hyper["repeat_ids"]) + tuple(hyper["suffix_ids"])
    b = tok.shape[0]
    ids = jnp.broadcast_to(jnp.asarray(head, jnp.int32), (b, len(head)))
    valid = jnp.ones((b, len(head)), bool)
    if prev is not None:
        cont = jnp.concatenate([jnp.broadcast_to(jnp.asarray(hyper["continue_ids"], jnp.int32),
                                                 (b, len(hyper["continue_ids"]))), prev.astype(jnp.int32),
                                jnp.broadcast_to(jnp.asarray(hyper["suffix_ids"], jnp.int32),
                                                 (b, len(hyper["suffix_ids"])))], axis=1)
        width = max(len(head), cont.shape[1])

        def front(a, fill):  # left-pad to the common width: padding replays nothing (position -1)
            return jnp.pad(a, ((0, 0), (width - a.shape[1], 0)), constant_values=fill)

        ids = jnp.where(first, front(ids, 0), front(cont, 0))
        valid = jnp.where(first, front(valid, False), front(jnp.ones(cont.shape, bool), False))
    active = jnp.any(q_pos >= 0, axis=1, keepdims=True)  # [B, 1]
    ids = jnp.concatenate([ids, jnp.where(q_pos >= 0, tok, 0)], axis=1)  # [B, R]
    valid = jnp.concatenate([valid & active, q_pos >= 0], axis=1)
    last = jnp.max(q_pos, axis=1, keepdims=True)  # [B, 1]
    r_pos = jnp.where(valid, last + jnp.cumsum(valid, axis=1), -1).astype(jnp.int32)
    return tf.embed(params, ids), r_pos


def stream(params: Params, bound, tok, q_pos, prev=None, first=None):
    """The layers' input for tokens tok [B, S]: their embeddings, with the replay stream (`replay_stream`)
    beside them as (x, x_replay, replay positions) for a replaying policy."""
    x = tf.embed(params, tok)
    if not bound.policy.replay or bound.is_dense:
        return x
    return (x, *replay_stream(params, dict(bound.hyper), tok, q_pos, prev, first))


def main(x) -> jax.Array:
    """The block's own hidden states of a layer stream (without the replay)."""
    return x[0] if isinstance(x, tuple) else x

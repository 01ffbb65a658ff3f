"""Text in, text out: a context, a question, a policy and a budget -> the answer and what the cache held.

    tok = vdjax.load_tokenizer("gemma3-270m"); params = vdjax.load("gemma3-270m")
    a = vdjax.answer(params, tok, long_text, "\\n\\nQuestion: who wrote it?", policy="valuediff", budget=512)
    a.text, a.kept, a.cache_bytes, a.ttft_s

The equivalent of kvpress's `pipe(context, question=..., press=...)`. The model's chat template renders one
user turn `context + question` (or plain text for a model without one, or `chat=False`). `protocol`:
"paper" (default) block-prefills context and question together under eviction; "question_agnostic" compresses
the context alone to `budget`, then appends the question whole
(kvpress's `question=` setting). """

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from vdjax.engine.api import Generation, run
from vdjax.text.prompt import render_split

PROTOCOLS = ("paper", "question_agnostic")


@dataclasses.dataclass
class Answer:
    """What `answer` returns: the decoded text and the run behind it."""

    text: str
    tokens: np.ndarray  # [new] the generated ids
    context_tokens: int
    question_tokens: int
    budget: int  # cache slots per KV head (dense: the whole sequence)
    kept: tuple[int, int]  # (min, max) valid slots per KV head over layers and heads at the end
    cache_bytes: int  # the bounded cache's keys and values as stored (quantized: codes + scales + zeros)
    dense_cache_bytes: int  # keys and values of every token seen in every attention layer (a dense cache)
    ttft_s: float  # time to first token (compile included on a first call)
    decode_s: float
    generation: Generation

    def __str__(self) -> str:
        return self.text


def answer(params, tokenizer, context: str, question: str = "", policy: str = "valuediff",
           budget: int | None = None, *, protocol: str = "paper", chat: bool = True, answer_prefix: str = "",
           template_kwargs: Mapping[str, Any] | None = None, block_size: int = 128, max_new_tokens: int = 64,
           **run_kwargs) -> Answer:
    """Answer `question` about `context` under `policy` at `budget` slots per KV head (see the module).

    `template_kwargs` reach the chat template (enable_thinking=False, reasoning_effort="high");
    `run_kwargs` go to `vdjax.run` (temperature, top_p, key, mesh, the
    policy's hyper-parameters, ...). """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} not known; allowed: {PROTOCOLS}")
    if not isinstance(context, str) or not isinstance(question, str):
        raise TypeError(f"context and question must be str, got {type(context).__name__} and "
                        f"{type(question).__name__}")
    ctx, q = render_split(tokenizer, context, question, answer_prefix=answer_prefix, chat=chat,
                          template_kwargs=template_kwargs)
    if protocol == "paper" or not q:
        gen = run(params, [ctx + q], policy, budget, block_size, max_new_tokens, **run_kwargs)
    else:
        gen = run(params, [ctx], policy, budget, block_size, max_new_tokens, question=q, **run_kwargs)
    tokens = gen.tokens[0]
    counts = np.asarray(gen.cache.valid_counts())
    seen = len(ctx) + len(q) + len(tokens) - 1  # the last sampled token is never cached
    return Answer(tokenizer.decode(list(tokens), skip_special_tokens=True).strip(), tokens, len(ctx), len(q),
                  gen.cache.budget, (int(counts.min()), int(counts.max())), gen.cache.kv_nbytes(),
                  gen.cache.dense_nbytes(seen), gen.prefill_s, gen.decode_s, gen)

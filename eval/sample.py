"""The one sample format every benchmark builder returns and the runner consumes, and its tokenisation.

A benchmark module (`ruler`, `longbench`, `math500`) exposes `TASKS` and
`build(task, tokenizer, *, length, num_samples, seed, ...) -> list[Sample]`. The runner renders a sample with
`render_ids` under either protocol:

- paper (default): the whole prompt (context + question + answer prefix) goes through block prefill;
- question-agnostic: only `context` is compressed; the question (and answer
prefix) is appended afterwards. """

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from vdjax.checks import read_jsonl  # noqa: F401  (part of this module's interface)
from vdjax.text.prompt import render_chat, render_split

PROTOCOLS = ("paper", "question_agnostic")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One evaluation sample; `context + question` is the user message, `answer_prefix` opens the answer."""

    id: str                      # unique and stable within its task across runs (resume key)
    task: str
    context: str                 # compressed under the question-agnostic protocol
    question: str                # appended after compression under the question-agnostic protocol
    answers: tuple[str, ...]     # references (any may match, per the task's metric)
    max_new_tokens: int
    metric: str                  # name in vdjax.eval.metrics.METRICS
    answer_prefix: str = ""      # put after the templated prompt (RULER); the model continues it
    chat_template: bool = True   # False: plain text even when the tokenizer has a chat template (LongBench)
    stop: tuple[str, ...] = ()   # generation also stops at a token decoding to one of them (LongBench samsum)
    min_new_tokens: int = 0      # EOS and `stop` tokens are masked before this many new tokens
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def to_json(self) -> dict:
        """A JSON-serialisable dict of every field."""
        return dataclasses.asdict(self) | {"answers": list(self.answers), "stop": list(self.stop)}


def render_text(tokenizer, sample: Sample,
                template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, int]:
    """(full input text, character offset where the context ends) for `sample` with this tokenizer.

    With a chat template (and `sample.chat_template`), the user message is `context + question` and the
    answer prefix follows the generation prompt; otherwise the text is `context + question + answer_prefix`
    (`vdjax.text.prompt.render_chat`, robust to templates that trim the message). `template_kwargs` go to the
    chat template (`enable_thinking`, `reasoning_effort`).
    """
    return render_chat(tokenizer, sample.context, sample.question, answer_prefix=sample.answer_prefix,
                       chat=sample.chat_template, template_kwargs=template_kwargs)


def render_ids(tokenizer, sample: Sample,
               template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of `sample`: `vdjax.text.prompt.render_split` of its texts (tokenised once,
    split at the end of the context)."""
    return render_split(tokenizer, sample.context, sample.question, answer_prefix=sample.answer_prefix,
                        chat=sample.chat_template, template_kwargs=template_kwargs)


def token_counter(tokenizer, template_kwargs: Mapping[str, Any] | None = None) -> Callable[[Sample], int]:
    """A function giving a sample's input length plus its answer budget, in this tokenizer's tokens."""

    def count(sample: Sample) -> int:
        ctx, q = render_ids(tokenizer, sample, template_kwargs)
        return len(ctx) + len(q) + sample.max_new_tokens

    return count



"""Prompts from text: the model's chat template (or plain text for base models) and where the context ends.

    text, boundary = render_chat(tokenizer, context, question, answer_prefix=" Answer:")
    text[:boundary]          # everything up to the end of the context (template header included)

The boundary is what the question-agnostic protocol needs (the context is compressed, the question appended
afterwards) and is found without searching the templated text for the message: templates that strip the
message (Llama-3.x, Gemma-it: `content | trim`) or a question ending in
whitespace make a plain search fail. """

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# Marks the context/question boundary inside the message; invisible separators no template touches.
_MARK = "\u2063\u2064vdjax-context-end\u2064\u2063"


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def apply_template(tokenizer, content: str, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """One user turn through the tokenizer's chat template, generation prompt added, as text.

    `template_kwargs` reach the template (e.g. `enable_thinking=False` for Qwen3/Qwen3.5,
    `reasoning_effort="high"` for GPT-OSS's harmony template).
    """
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True, **dict(template_kwargs or {}))


def render_chat(tokenizer, context: str, question: str = "", *, answer_prefix: str = "", chat: bool = True,
                template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, int]:
    """(full input text, character offset where the context ends) of `context + question` as one user turn.

    With a chat template (and `chat`), the user message is `context + question` and `answer_prefix` follows
    the generation prompt; otherwise the text is `context + question + answer_prefix`. The boundary comes
    from rendering the message once more with a marker between context and question: where the template
    trims the ends of the message (an all-whitespace context or question), the boundary is where the two
    renderings part, i.e. right after whatever of the context survived.
    """
    if not (chat and has_chat_template(tokenizer)):
        return context + question + answer_prefix, len(context)
    text = apply_template(tokenizer, context + question, template_kwargs)
    marked = apply_template(tokenizer, context + _MARK + question, template_kwargs)
    cut = marked.find(_MARK)
    if cut < 0 or marked.count(_MARK) != 1:
        raise ValueError(f"the chat template of {type(tokenizer).__name__} does not keep the user message "
                         "intact (a marker inside it was dropped or repeated): cannot tell where the context "
                         "ends")
    if marked.replace(_MARK, "") != text:  # the template trimmed next to the boundary
        cut = min(cut, len(os.path.commonprefix([text, marked])))
    return text + answer_prefix, cut


def render_split(tokenizer, context: str, question: str = "", *, answer_prefix: str = "", chat: bool = True,
                 template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of `render_chat`'s text, tokenised once and
    split at the end of the context.

    `context + question` ids are exactly the tokenisation of the whole input (BOS added by the tokenizer when
    the text has no chat template of its own); a token straddling the
    boundary goes to the context. """
    text, boundary = render_chat(tokenizer, context, question, answer_prefix=answer_prefix, chat=chat,
                                 template_kwargs=template_kwargs)
    templated = chat and has_chat_template(tokenizer)
    enc = tokenizer(text, add_special_tokens=not templated, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    split = len(ids)
    for i, (start, end) in enumerate(offsets):
        if end > start and start >= boundary:
            split = i
            break
    return ids[:split], ids[split:]

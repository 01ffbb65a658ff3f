"""RULER-style single-needle prompts: a 7-digit "magic number" hidden in a repeated noise haystack.

    p = needle_prompt(tokenizer, length=2048, depth=0.5, seed=0)
    out = vdjax.generate(params, p.ids, budget=512)
    is_correct(tokenizer.decode(out[0]), p.answer)

The prompt is sized with the model's own tokenizer (binary search on the number of haystack sentences) so
the templated prompt is as close to `length` tokens as the sentence granularity allows.
"""

from __future__ import annotations

import dataclasses
import random

from vdjax.analysis import data
from vdjax.text.prompt import has_chat_template

NOISE = tuple(s if s.endswith(".") else s + "." for s in data.NOISE.split(". "))  # RULER's, a sentence each
NEEDLE = data.NEEDLE.format(type_needle_v="numbers", key="{key}", value="{value}")
INSTRUCTION = data.RETRIEVAL_INSTRUCTION
QUESTION = data.RETRIEVAL_QUESTION
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"

_ADJECTIVES = (
    "dazzling",
    "quiet",
    "ancient",
    "bright",
    "curious",
    "gentle",
    "hollow",
    "jolly",
    "lucky",
    "mighty",
    "nimble",
    "proud",
    "rapid",
    "silent",
    "tender",
    "vivid",
    "wandering",
    "zealous",
    "amber",
    "frosty",
)
_NOUNS = (
    "ocean",
    "forest",
    "comet",
    "harbor",
    "lantern",
    "meadow",
    "falcon",
    "glacier",
    "canyon",
    "orchard",
    "river",
    "summit",
    "thunder",
    "willow",
    "pebble",
    "island",
    "compass",
    "ember",
    "violet",
    "badger",
)


@dataclasses.dataclass(frozen=True)
class NeedlePrompt:
    """One needle prompt: token ids, rendered text, the key, the answer (value), depth, token count."""

    ids: list[int]
    text: str
    key: str
    answer: str
    depth: float
    n_tokens: int


def format_prompt(
    tokenizer, content: str, chat: bool = True, answer_prefix: str = ""
) -> tuple[str, list[int]]:
    """(text, ids) of a user message: chat-templated (generation prompt, then answer_prefix) or plain text.

    Without a chat template (or with chat=False) the text is `content`, then "Answer: <answer_prefix>" on a
    new line when a prefix is given.
    """
    if chat and has_chat_template(tokenizer):
        text = (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            + answer_prefix
        )
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = f"{content}\nAnswer: {answer_prefix}" if answer_prefix else content
    return text, list(tokenizer(text)["input_ids"])


def haystack(n_sentences: int, needle: str, depth: float) -> str:
    """n noise sentences (cycling through NOISE) with the needle inserted at fraction `depth` of them."""
    sentences = [NOISE[i % len(NOISE)] for i in range(n_sentences)]
    sentences.insert(round(depth * n_sentences), needle)
    return " ".join(sentences)


def needle_prompt(
    tokenizer,
    length: int = 2048,
    depth: float = 0.5,
    seed: int = 0,
    chat: bool = True,
    answer_prefix: bool = True,
) -> NeedlePrompt:
    """A seeded single-needle prompt whose templated token count is as close to `length` as possible.

    As in RULER, the answer prefix ("The special magic number for {key} ... is") ends the prompt, after the
    assistant turn's start when the tokenizer has a chat template: the answer
    then begins with the number. """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    rng = random.Random(seed)
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    value = str(rng.randint(1_000_000, 9_999_999))
    needle = NEEDLE.format(key=key, value=value)
    prefix = ANSWER_PREFIX.format(key=key) if answer_prefix else ""

    def build(n: int) -> tuple[str, list[int]]:
        content = f"{INSTRUCTION}\n{haystack(n, needle, depth)}\n{QUESTION.format(key=key)}"
        return format_prompt(tokenizer, content, chat, prefix)

    lo, hi = 0, 1  # find the largest n with len(build(n)) <= length (lengths grow with n)
    while len(build(hi)[1]) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(build(mid)[1]) <= length else (lo, mid)
    text, ids = min((build(lo), build(hi)), key=lambda b: abs(len(b[1]) - length))
    return NeedlePrompt(ids, text, key, value, depth, len(ids))


def is_correct(answer_text: str, value: str) -> bool:
    """True when the needle's value appears in the decoded answer."""
    return str(value) in answer_text

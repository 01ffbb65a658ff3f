"""RULER's word lists and texts: niah keys, cwe's vocabulary, the essay in sentences, qa's documents."""

from __future__ import annotations

import bisect
import functools
import re

from vdjax.analysis import data


@functools.cache
def key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(sorted unique adjectives, sorted unique nouns): niah's word keys are `f"{adj}-{noun}"`."""
    adjectives, nouns = data.words("adjectivelist.txt"), data.words("nounlist.txt")
    return tuple(sorted(set(adjectives))), tuple(sorted(set(nouns)))


@functools.cache
def cwe_words() -> tuple[str, ...]:
    """cwe's vocabulary: sorted(set(nouns + adjectives + verbs)) (shuffled per build seed, as RULER does)."""
    return tuple(sorted(set(data.words("nounlist.txt") + data.words("adjectivelist.txt")
                            + data.words("verblist.txt"))))


# A sentence ends after a word ending in . ! or ? (optionally followed by closing quotes/brackets) unless the
# word is a common abbreviation or an initial. This regex stands in for nltk's punkt `sent_tokenize`
# (whose model is a separate download): like punkt, it never splits inside a word ("mistakes.If").
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")
_ABBREVIATION = re.compile(
    r"^[(\"'\u201c\u2018]*(?:[A-Za-z]|mr|mrs|ms|dr|prof|sr|jr|st|vs|etc|e\.g|i\.e|inc|ltd|co|corp|u\.s|"
    r"u\.k|no|fig|al|cf|approx|dept|gen|gov|lt|mt|rev|sen|sgt|capt|col|jan|feb|mar|apr|aug|sep|sept|oct|nov|"
    r"dec|ph\.d|b\.a|m\.a|a\.m|p\.m)\.$", re.IGNORECASE)


@functools.cache
def _essay() -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(RULER's essay words, exclusive word index where each sentence ends), read and split once."""
    text = data.essays()
    words = tuple(re.sub(r"\s+", " ", text).split(" "))
    ends = []
    for i, word in enumerate(words):
        if word and _SENTENCE_END.search(word) and not _ABBREVIATION.match(word):
            end = i + 1
            while end < len(words) and not words[end]:  # the trailing '' of the split sticks to the sentence
                end += 1
            ends.append(end)
    if not ends or ends[-1] != len(words):
        ends.append(len(words))
    return words, tuple(ends)


def essay_sentence_ends(n: int) -> list[int]:
    """Sentence ends (exclusive word indices) in the first `n` essay words (repeated past the essay's end)."""
    words, ends = _essay()
    if n <= len(words):
        return list(ends[:bisect.bisect_left(ends, n)]) + [n]
    out = []
    for r in range(-(-n // len(words))):
        out.extend(e + r * len(words) for e in ends if e + r * len(words) < n)
    return out + [n]


def essay_text(a: int, b: int) -> str:
    """Essay words [a, b) joined by single spaces (indices past the end wrap around, as RULER repeats it)."""
    words, _ = _essay()
    size, parts = len(words), []
    while a < b:
        r, start = divmod(a, size)
        stop = min(b, (r + 1) * size)
        parts.extend(words[start:stop - r * size])
        a = stop
    return " ".join(filter(None, parts))


@functools.cache
def qa_data(dataset: str) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """(questions, documents) of RULER's qa.py for 'squad' or 'hotpotqa', read once."""
    if dataset == "squad":
        squad = data.json_file("squad.json")
        docs = sorted({p["context"] for d in squad["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in squad["data"]:
            more = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                for qa in p["qas"]:
                    if not qa["is_impossible"]:
                        qas.append(dict(query=qa["question"], outputs=tuple(a["text"] for a in qa["answers"]),
                                        context=(index[p["context"]],), support=(index[p["context"]],),
                                        more=tuple(i for i in more if i != index[p["context"]])))
        return tuple(qas), tuple(docs)
    hotpot = data.json_file("hotpotqa.json")
    docs = sorted({f"{t}\n{''.join(p)}" for d in hotpot for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = tuple(dict(query=d["question"], outputs=(d["answer"],), more=(),
                     context=tuple(index[f"{t}\n{''.join(p)}"] for t, p in d["context"]),
                     support=tuple(index[f"{t}\n{''.join(p)}"] for t, p in d["context"]
                                   if t in {title for title, _ in d["supporting_facts"]}))
                for d in hotpot)
    return qas, tuple(docs)

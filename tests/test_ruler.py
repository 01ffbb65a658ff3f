"""vdjax.eval.ruler: RULER's 13 tasks, exact templates, answers in the context, the target length hit."""

import collections
import importlib.resources
import json
import re
import zlib

import numpy as np
import pytest

from vdjax.eval import ruler, ruler_sources
from vdjax.eval.sample import render_ids, token_counter

LENGTH = 1024
NUM = 2
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NUMBER, UUID4 = r"\d{7}", r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
# Largest distance below the target allowed with WordTok: one haystack unit (see the module docstring):
# a noise sentence is 24 WordTok tokens, a word-key needle ~14-20, a uuid needle ~30, an essay word 1-3,
# a numbered cwe word 3-6, an fwe coded word 1 (the re-shuffle at n + 1 moves a few seams).
SLACK = dict(niah_single_1=24, niah_single_2=6, niah_single_3=6, niah_multikey_1=6, niah_multikey_2=24,
             niah_multikey_3=32, niah_multivalue=6, niah_multiquery=6, vt=24, cwe=8, fwe=4)


class WordTok:
    """Test tokenizer: a token per word or punctuation mark, BOS 0 on add_special_tokens, no chat template."""

    chat_template = None
    _token = re.compile(r"\w+|[^\w\s]")

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        """HF-fast-tokenizer-like encoding with input_ids and offset_mapping."""
        found = list(self._token.finditer(text))
        ids = [zlib.crc32(m.group().encode()) % 50000 + 1 for m in found]
        offsets = [m.span() for m in found]
        if add_special_tokens:
            ids, offsets = [0] + ids, [(0, 0)] + offsets
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = offsets
        return out


TOK = WordTok()
COUNT = token_counter(TOK)


@pytest.fixture(scope="module")
def built():
    """Every task built once at seed 0 with WordTok."""
    return {t: ruler.build(t, TOK, length=LENGTH, num_samples=NUM, seed=0) for t in ruler.TASKS}


def _word_key_ok(key: str) -> bool:
    """True when key is f"{adjective}-{noun}" with both from wonderwords (RULER's word keys)."""
    from wonderwords import random_word

    adjs = set(random_word._get_words_from_text_file("adjectivelist.txt"))
    nouns = set(random_word._get_words_from_text_file("nounlist.txt"))
    return any(key[:i] in adjs and key[i + 1:] in nouns for i, c in enumerate(key) if c == "-")


def test_tasks_and_depths():
    assert len(ruler.TASKS) == 13 and len(set(ruler.TASKS)) == 13
    assert ruler.DEPTHS == tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))


def test_fields_and_target_length(built):
    for task, samples in built.items():
        length = LENGTH
        assert len(samples) == NUM
        for i, s in enumerate(samples):
            family = "qa" if task.startswith("qa") else "niah" if task.startswith("niah") else task
            assert s.id == f"{task}-{length}-0-{i}" and s.task == task and s.chat_template is True
            assert s.max_new_tokens == dict(niah=128, vt=30, cwe=120, fwe=50, qa=32)[family]
            assert s.metric == ("string_match_part" if family == "qa" else "string_match_all")
            n = COUNT(s)
            assert n <= length, (task, n)
            # qa: less than one more document, a few hundred tokens at most
            assert length - n <= SLACK.get(task, 400), (task, length - n)
            assert s.extra["tokens_with_one_more"] > length  # the search's proof that n is as large as fits
            assert s.extra["length"] == length and s.extra["input_tokens"] == n - s.max_new_tokens
            assert s.extra["haystack"] >= 1
        assert samples[0].context != samples[1].context


def test_reproducible_and_seeded(built):
    for task in ("niah_single_2", "niah_multikey_2", "vt", "cwe", "fwe", "qa_1"):
        again = ruler.build(task, TOK, length=LENGTH, num_samples=NUM, seed=0)
        assert [s.to_json() for s in again] == [s.to_json() for s in built[task]]
        other = ruler.build(task, TOK, length=LENGTH, num_samples=NUM, seed=1)
        assert all(a.context != b.context for a, b in zip(other, built[task], strict=True))
        assert [s.id for s in other] == [f"{task}-{LENGTH}-1-{i}" for i in range(NUM)]
        first, = ruler.build(task, TOK, length=LENGTH, num_samples=1, seed=0)
        assert first.to_json() == built[task][0].to_json()  # independent of num_samples


HEAD_SINGLE = ("A special magic {v} is hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the {v} afterwards.\n")
HEAD_MULTI = ("Some special magic {v}s are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the {v}s afterwards.\n")


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
                                  "niah_multikey_2", "niah_multikey_3"])
def test_niah_single_answer(built, task):
    v = "uuid" if task in ("niah_single_3", "niah_multikey_3") else "number"
    for s in built[task]:
        (key,), (value,) = s.extra["keys"], s.answers
        assert re.fullmatch(UUID4 if v == "uuid" else NUMBER, value)
        assert re.fullmatch(UUID4, key) if task == "niah_multikey_3" else _word_key_ok(key)
        assert s.context.startswith(HEAD_SINGLE.format(v=v))
        assert s.question == f"\nWhat is the special magic {v} for {key} mentioned in the provided text?"
        assert s.answer_prefix == f" The special magic {v} for {key} mentioned in the provided text is"
        assert s.context.count(f"One of the special magic {v}s for {key} is: {value}.") == 1  # needle: plural
        assert s.context.count(key) == 1 and s.context.count(value) == 1
        body = s.context[len(HEAD_SINGLE.format(v=v)):]
        value_re = UUID4 if v == "uuid" else NUMBER
        needle = re.compile(rf"One of the special magic {v}s for .+? is: ({value_re})\.")
        if task == "niah_single_1":  # noise haystack: noise lines and the needle line, '\n'-joined
            lines = body.split("\n")
            assert len(lines) == s.extra["haystack"] + 1 and lines.count(NOISE) == s.extra["haystack"]
        elif task.startswith("niah_multikey_2") or task == "niah_multikey_3":  # needle haystack
            lines = body.split("\n")
            assert len(lines) == s.extra["haystack"] + 1 and all(needle.fullmatch(x) for x in lines)
        else:  # essay haystack: starts with the first essay words; needles between sentences
            assert body.startswith("April 2012A palliative care nurse called Bronnie Ware made a list")
            assert len(needle.findall(body)) == (4 if task == "niah_multikey_1" else 1)
            for m in needle.finditer(body):
                before = body[:m.start()]
                assert not before.strip() or re.search(r"[.!?][\"'\u201d\u2019)\]]* +$", before), before[-40:]
        assert len(s.extra["depths"]) == (4 if task == "niah_multikey_1" else 1)


def test_essay_sentences_and_needle_depths(built):
    words, ends = ruler_sources._essay()
    assert len(words) == 525449 and ends[:4] == (18, 22, 57, 96) and ends[-1] == len(words)
    assert " ".join(words[22:57]).count("mistakes.If") == 1  # no split inside a word, as punkt
    assert ruler_sources.essay_sentence_ends(25) == [18, 22, 25]  # a cut sentence ends the prefix
    w = len(words)
    assert ruler_sources.essay_sentence_ends(w + 30)[-4:] == [w, w + 18, w + 22, w + 30]  # the essay repeats
    assert ruler_sources.essay_text(len(words) - 4, len(words) + 2) == "drafts of this. April 2012A"
    head = HEAD_MULTI.format(v="number")
    for task in ("niah_single_2", "niah_multivalue"):
        for s in built[task]:
            body = s.context[s.context.index("afterwards.\n") + len("afterwards.\n"):]
            sentence_ends = ruler_sources.essay_sentence_ends(s.extra["haystack"])
            needles = list(re.finditer(rf"One of the special magic numbers for .+? is: {NUMBER}\.", body))
            assert len(needles) == len(s.extra["depths"]) == len(s.answers)
            for j, (depth, m) in enumerate(zip(s.extra["depths"], needles, strict=True)):
                cut = int(len(sentence_ends) * (depth / 100))  # RULER: insert before sentence int(S * depth)
                essay_words = len(body[:m.start()].split()) - sum(len(x.group().split()) for x in needles[:j])
                assert essay_words == (0 if cut == 0 else sentence_ends[cut - 1]), (task, depth)
        assert task == "niah_single_2" or s.context.startswith(head)


def test_niah_multivalue_and_multiquery(built):
    for s in built["niah_multivalue"]:
        (key,) = s.extra["keys"]
        assert s.context.startswith(HEAD_MULTI.format(v="number") + "April 2012A palliative care nurse")
        assert s.question == ("\nWhat are all the special magic numbers for "
                              f"{key} mentioned in the provided text?")
        assert s.answer_prefix == f" The special magic numbers for {key} mentioned in the provided text are"
        assert len(s.answers) == 4 and all(re.fullmatch(NUMBER, a) for a in s.answers)
        for a in s.answers:
            assert s.context.count(f"One of the special magic numbers for {key} is: {a}.") == 1
    for s in built["niah_multiquery"]:
        keys = s.extra["keys"]
        assert len(keys) == 4 and len(set(keys)) == 4 and len(s.answers) == 4
        query = f"{keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]}"
        assert s.question == ("\nWhat are all the special magic numbers for "
                              f"{query} mentioned in the provided text?")
        assert s.answer_prefix == f" The special magic numbers for {query} mentioned in the provided text are"
        for k, a in zip(keys, s.answers, strict=True):
            assert s.context.count(f"One of the special magic numbers for {k} is: {a}.") == 1


VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def test_vt(built):
    for s in built["vt"]:
        names, value = s.answers, re.search(r"value (\d{5}) in the text above", s.question).group(1)
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", x) for x in names)
        assert s.question == ("\nQuestion: Find all variables that are assigned the value "
                              f"{value} in the text above.")
        assert s.answer_prefix == (" Answer: According to the chain(s) of variable assignment in the text "
                                   f"above, 5 variables are assigned the value {value}, they are: ")
        # the in-context example (3-letter names, answered), then the task
        icl, task_text = s.context.split("\n\n" + VT_HEAD)
        assert icl.startswith(VT_HEAD) and s.context.startswith(VT_HEAD)
        m = re.search(r"assigned the value (\d{5}), they are:  ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3}) "
                      r"([A-Z]{3})$", icl)
        assert m and m.group(1) != "12345"
        assert f"VAR {m.group(2)} = {m.group(1)}\n" in icl
        lines = task_text.split("\n")
        chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]
        assert [x for x in lines if x != NOISE] == chain  # the chain, in order, in the noise
        assert len(lines) == s.extra["haystack"] + 5


CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n")
CWE_Q = "\nQuestion: What are the 10 most common words in the above list?"
CWE_A = " Answer: The top 10 words that appear most often in the list are:"


def _numbered(text: str) -> list[str]:
    """Words of '1. a 2. b ...', checking the numbering."""
    parts = re.split(r"(?:^| )(\d+)\. ", text)[1:]
    assert [int(x) for x in parts[0::2]] == list(range(1, len(parts) // 2 + 1))
    return parts[1::2]


def test_cwe(built):
    for s in built["cwe"]:
        assert s.context.startswith(CWE_HEAD + "1. ")
        assert s.question == CWE_Q and s.answer_prefix == CWE_A
        shot, main = s.context.split("\n" + CWE_HEAD)
        shot_list, shot_answer = shot[len(CWE_HEAD):].split(CWE_Q + CWE_A + " ")
        shot_counts = collections.Counter(_numbered(shot_list))
        assert len(shot_counts) == 20 and sorted(shot_counts.values()) == [1] * 10 + [3] * 10  # 20 words, 3/1
        assert set(_numbered(shot_answer)) == {w for w, c in shot_counts.items() if c == 3}
        counts = collections.Counter(_numbered(main))
        assert len(s.answers) == 10 and len(counts) == s.extra["haystack"]
        # length < 4096: RULER's short setting, 6 repeats of the common words, 1 of the others
        assert {w: counts[w] for w in s.answers} == {w: 6 for w in s.answers}
        assert sum(counts.values()) == 60 + (len(counts) - 10)


def test_fwe(built):
    head = ("Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words. ")
    for s in built["fwe"]:
        assert s.context.startswith(head)
        assert s.question == ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
                              "What are the three most frequently appeared words in the above coded text?")
        assert s.answer_prefix == (" Answer: According to the coded text above, the three most frequently "
                                   "appeared words are:")
        assert len(s.answers) == 3 and all(re.fullmatch(r"[a-z]{6}", a) for a in s.answers)
        counts = collections.Counter(s.context[len(head):].split(" "))
        ranked = counts.most_common()
        assert ranked[0][0] == "..." and tuple(w for w, _ in ranked[1:4]) == s.answers
        assert ranked[1][1] > ranked[2][1] > ranked[3][1] > ranked[4][1]
        n, zeta2 = s.extra["haystack"], np.pi ** 2 / 6
        assert [c for _, c in ranked[:4]] == [int(n * k ** -2.0 / zeta2) for k in (1, 2, 3, 4)]
        assert s.extra["vocab_size"] == (LENGTH - 50) // 50


QA_HEAD = ("Answer the question based on the given documents. Only give me the answer and do not output any "
           "other words.\n\nThe following are given documents.\n\nDocument 1:\n")
QA_Q = ("\n\nAnswer the question based on the given documents. Only give me the answer and do not output any "
        "other words.\n\nQuestion: {}")


def _json(name):
    """A RULER data file of long_context_eval."""
    path = importlib.resources.files("long_context_eval") / "data" / "synthetic" / "json" / name
    return json.loads(path.read_text(encoding="utf-8"))


def _documents(context: str) -> list[str]:
    """The documents of a qa context, checking 'Document i:' runs 1..n."""
    found = re.findall(r"(?:^|\n\n)Document (\d+):\n", context)
    assert [int(x) for x in found] == list(range(1, len(found) + 1))
    return re.split(r"(?:^|\n\n)Document \d+:\n", context[context.index("Document 1:\n"):])[1:]


def test_qa_1_squad(built):
    squad = [(p["context"], q) for d in _json("squad.json")["data"] for p in d["paragraphs"] for q in p["qas"]
             if not q["is_impossible"]]
    for i, s in enumerate(built["qa_1"]):  # RULER: sample i asks question i
        gold, qa = squad[i]
        assert s.context.startswith(QA_HEAD)
        assert s.question == QA_Q.format(qa["question"]) and s.answer_prefix == " Answer:"
        assert s.answers == tuple(a["text"] for a in qa["answers"])
        docs = _documents(s.context)
        assert len(docs) == s.extra["haystack"] and docs.count(gold) == 1
        assert s.extra["gold_documents"] == [docs.index(gold) + 1]
        assert s.answers[0] in gold
    assert built["qa_1"][0].question.endswith("Question: In what country is Normandy located?")
    assert built["qa_1"][0].answers == ("France",) * 4


def test_qa_gold_document_sits_where_the_official_seed_puts_it():
    """RULER shuffles qa's documents with a fresh Random(42): the gold document (first before the shuffle)
    gets the same slot for a given document count, near the end for 16-32 documents (86-94 %). vdjax's default
    seed is RULER's; seed 0 put it near the start (4-22 %)."""
    assert ruler.SEED == 42
    default = ruler.build("qa_1", TOK, length=3072, num_samples=8)  # 21-25 documents with WordTok
    assert [s.id for s in default] == [f"qa_1-3072-42-{i}" for i in range(8)]
    for s in default:
        n, (slot,) = s.extra["haystack"], s.extra["gold_documents"]
        assert 16 <= n <= 32 and 86 <= s.extra["depths"][0] <= 94, (n, s.extra["depths"])
        import random
        order = list(range(n))
        random.Random(42).shuffle(order)
        assert slot == order.index(0) + 1  # exactly RULER's permutation for this N
        docs_start = s.context.index("Document 1:\n")
        docs = s.context[docs_start:]  # the context part ends with the documents
        assert s.extra["depths_chars"][0] == round(100 * docs.index(f"Document {slot}:\n") / len(docs), 1)
    seed0 = ruler.build("qa_1", TOK, length=3072, num_samples=8, seed=0)
    assert max(s.extra["depths"][0] for s in seed0) <= 25


def test_qa_2_hotpotqa(built):
    first = _json("hotpotqa.json")[0]
    paragraphs = [f"{title}\n{''.join(sentences)}" for title, sentences in first["context"]]
    short, = ruler.build("qa_2", TOK, length=LENGTH, num_samples=1, seed=0)
    assert short.to_json() == built["qa_2"][0].to_json()
    full, = ruler.build("qa_2", TOK, length=2048, num_samples=1, seed=0)
    for s in (short, full):
        assert s.question == QA_Q.format("Were Scott Derrickson and Ed Wood of the same nationality?")
        assert s.answers == ("yes",) and s.answer_prefix == " Answer:" and s.context.startswith(QA_HEAD)
        docs = _documents(s.context)
        titles = [d.split("\n", 1)[0] for d in docs]
        assert len(docs) == s.extra["haystack"]
        supporting = sorted(titles[i - 1] for i in s.extra["supporting_documents"])
        assert supporting == ["Ed Wood", "Scott Derrickson"]
        assert [docs[i - 1] for i in s.extra["gold_documents"]] == [d for d in docs if d in paragraphs]
    # 2048: RULER's case, the question's 10 paragraphs plus distractors; 1024: they do not all fit (1082
    # tokens), so the supporting two and some of the other eight
    assert len(full.extra["gold_documents"]) == 10 and full.extra["haystack"] > 10
    assert 2 <= len(short.extra["gold_documents"]) == short.extra["haystack"] < 10


def test_fit_finds_the_largest_size():
    make = lambda n: n  # noqa: E731
    count = lambda n: 3 * n + 7 + (n % 2)  # noqa: E731  (non-decreasing)
    best = max(n for n in range(1, 2000) if count(n) <= 1000)
    for guess in (None, 1, 5, best - 1, best, best + 1, best + 300, 10_000):
        got = ruler._fit_haystack(make, count, 1000, lo=1, hi=None, guess=guess, what="t")
        assert got == (best, best, count(best), count(best + 1)), guess
    assert ruler._fit_haystack(make, count, 1000, lo=1, hi=100, guess=None, what="t") == (100, 100, 307, None)
    got = ruler._fit_haystack(make, count, 1000, lo=1, hi=best + 1, guess=5, what="t")
    assert got == (best, best, count(best), count(best + 1))
    with pytest.raises(ValueError, match="length=5 is too small for t"):
        ruler._fit_haystack(make, count, 5, lo=1, hi=None, guess=None, what="t")


def test_bad_input():
    with pytest.raises(ValueError, match="task must be one of niah_single_1.*'niah'"):
        ruler.build("niah", TOK, length=LENGTH, num_samples=1)
    with pytest.raises(ValueError, match="length must be an integer >= 1, got 0"):
        ruler.build("vt", TOK, length=0, num_samples=1)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1, got 0"):
        ruler.build("vt", TOK, length=LENGTH, num_samples=0)
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got '1'"):
        ruler.build("vt", TOK, length=LENGTH, num_samples=1, seed="1")
    with pytest.raises(ValueError, match="length=100 is too small for task 'niah_single_1'"):
        ruler.build("niah_single_1", TOK, length=100, num_samples=1)
    with pytest.raises(ValueError, match="length=200 is too small for fwe"):
        ruler.build("fwe", TOK, length=200, num_samples=1)
    with pytest.raises(ValueError, match=r"length=150 is too small for task 'qa_1' \(sample 0\).*1 docum"):
        ruler.build("qa_1", TOK, length=150, num_samples=1)
    with pytest.raises(ValueError, match="num_samples=99999 exceeds the .* questions of squad"):
        ruler.build("qa_1", TOK, length=LENGTH, num_samples=99999)
    with pytest.raises(ValueError, match="count must be a callable"):
        ruler.build("vt", TOK, length=LENGTH, num_samples=1, count=5)


def test_smollm2_hits_the_target(smollm2_dir):
    import vdjax

    tok = vdjax.load_tokenizer(smollm2_dir)
    assert tok.chat_template
    count = token_counter(tok)
    for task, slack in (("niah_single_2", 8), ("vt", 40), ("cwe", 16)):
        for s in ruler.build(task, tok, length=1024, num_samples=2, seed=0):
            ctx, q = render_ids(tok, s)
            n = len(ctx) + len(q) + s.max_new_tokens
            assert n == count(s) and 1024 - slack <= n <= 1024, (task, n)
            assert tok.decode(q).strip().startswith(s.question.strip()[:20])
    with pytest.raises(ValueError, match="is too small"):
        ruler.build("niah_single_2", tok, length=200, num_samples=1)


def test_count_that_never_exceeds_the_length():
    with pytest.raises(ValueError, match=r"count\(sample\) stays <= length=1024 up to 16385 sentences"):
        ruler.build("niah_single_1", TOK, length=LENGTH, num_samples=1, count=lambda s: 1)
    with pytest.raises(ValueError, match="length=1024 is too long for cwe: its 8166 distinct wonderwords"):
        ruler.build("cwe", TOK, length=LENGTH, num_samples=1, count=lambda s: 1)

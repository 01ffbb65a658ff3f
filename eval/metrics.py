"""Per-sample scores for RULER, LongBench v1 and MATH-500, plus retention against a dense run.

Every entry of `METRICS` has the signature `(prediction, answers, sample) -> float in [0, 1]`: the score of
one generated `prediction` against the sample's reference `answers` (`sample` may be None for metrics that
need nothing else from it). The functions are pure (no state, no I/O).

Fidelity to the official scorers:

- RULER (NVIDIA/RULER scripts/eval): `postprocess_pred` (strip, control characters -> newline), then
  `string_match_all` = fraction of references found (case-insensitive substring) and `string_match_part` =
  1 if any is found. The official functions report `100 * mean` over samples; here one sample, in [0, 1].
- LongBench v1 (THUDM/LongBench LongBench/metrics.py + eval.py `scorer`): the per-reference metric is the
  official one; the score is `max(0, max over answers)`, and for the tasks in `FIRST_LINE_TASKS` (trec,
  triviaqa, samsum, lsht) the prediction is first cut to its first line, `pred.lstrip('\\n').split('\\n')[0]`.
  That cut lives in the scorer, not in the per-reference metrics, exactly as in eval.py: it is keyed on
  `sample.task` and applies to whichever LongBench metric the task uses. Official quirks kept for parity:
  `rouge` returns 0.0 when the `rouge` package raises (empty text, RecursionError on very long sentences);
  `classification` removes sub-string class matches while iterating over the same list.
- MATH-500: the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`) of the prediction against each reference,
  1.0 when any matches, 0.0 otherwise or when there is no box. `grade_answer` (the paper's scorer, Appendix
  F) is openai/prm800k's `grade_answer` (`vdjax.eval.grader`); `math_equiv` is `math_verify`'s equivalence,
  kept as a second opinion. Over the k draws of a problem, `math_at_k` gives the
  paper's flex@k, exact@k and pass@k.

Differences from the official code are only in error handling: where the official would crash with an
IndexError/TypeError (a retrieval answer without a paragraph number, a classification sample without
`all_classes`, no references for RULER) this module raises a ValueError that names the problem, or returns
0.0 for an empty reference list (LongBench's `max` starting at 0 gives 0.0 too).
"""

from __future__ import annotations

import functools
import math
import re
import string
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from vdjax.eval import grader
from vdjax.eval.math500 import extract_boxed
from vdjax.eval.sample import Sample

Metric = Callable[[str, Sequence[str], "Sample | None"], float]

# LongBench eval.py `scorer`: these tasks' predictions are cut to their first line before scoring.
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")

# LongBench eval.py `dataset2metric`, as names in `METRICS`.
DATASET2METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "dureader": "rouge_zh",
    "gov_report": "rouge",
    "qmsum": "rouge",
    "multi_news": "rouge",
    "vcsum": "rouge_zh",
    "trec": "classification",
    "triviaqa": "qa_f1",
    "samsum": "rouge",
    "lsht": "classification",
    "passage_count": "count",
    "passage_retrieval_en": "retrieval",
    "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}

_EVAL_EXTRA = "pip install 'vdjax[eval]'"


def _need(module: str):
    """Import an optional scorer dependency, with an install hint when it is missing."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"this metric needs the `{module}` package: {_EVAL_EXTRA}") from e


@functools.lru_cache(maxsize=1)
def _jieba():
    """jieba with its start-up log silenced."""
    import logging

    jieba = _need("jieba")
    jieba.setLogLevel(logging.WARNING)
    return jieba


@functools.lru_cache(maxsize=1)
def _fuzz():
    """fuzzywuzzy.fuzz (the pure-difflib build that LongBench's requirements install), warning silenced."""
    _need("fuzzywuzzy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from fuzzywuzzy import fuzz
    return fuzz


def _check(prediction, answers) -> tuple[str, tuple[str, ...]]:
    """Validate the common arguments: a str prediction and a sequence of str answers."""
    if not isinstance(prediction, str):
        raise TypeError(f"prediction must be a str, got {type(prediction).__name__}: {prediction!r:.80}")
    if isinstance(answers, (str, bytes)) or not isinstance(answers, Iterable):
        raise TypeError(f"answers must be a sequence of str (not a bare string), got {answers!r:.80}")
    answers = tuple(answers)
    for a in answers:
        if not isinstance(a, str):
            raise TypeError(f"answers must contain only str, got {type(a).__name__}: {a!r:.80}")
    return prediction, answers


# ----------------------------------------------------------------------------------------------------- RULER


def _ruler_postprocess(prediction: str) -> str:
    """RULER evaluate.py `postprocess_pred`: strip, control characters to newlines, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: Sequence[str], sample: Sample | None = None) -> float:
    """RULER string_match_all: fraction of references contained (case-insensitively) in the prediction."""
    prediction, answers = _check(prediction, answers)
    if not answers:
        return 0.0
    pred = _ruler_postprocess(prediction).lower()
    return sum(1.0 for r in answers if r.lower() in pred) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str], sample: Sample | None = None) -> float:
    """RULER string_match_part: 1.0 when any reference is contained (case-insensitively) in the prediction."""
    prediction, answers = _check(prediction, answers)
    pred = _ruler_postprocess(prediction).lower()
    return max((1.0 if r.lower() in pred else 0.0 for r in answers), default=0.0)


# ---------------------------------------------------------------------------- LongBench per-reference scores


_EN_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """LongBench/SQuAD English normalisation: lower case, drop punctuation and articles, squeeze spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _EN_PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ZH_PUNCTUATION = frozenset(string.punctuation + _CN_PUNCTUATION)


def normalize_zh_answer(s: str) -> str:
    """LongBench Chinese normalisation: lower case, drop ASCII and CJK punctuation, remove all whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _ZH_PUNCTUATION)
    return "".join(s.split())


def _token_f1(pred_tokens: Sequence[str], ref_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (LongBench `f1_score`); 0 when nothing is shared."""
    num_same = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def _qa_f1(pred: str, ref: str, sample: Sample | None) -> float:
    """LongBench `qa_f1_score` for one reference."""
    return _token_f1(normalize_answer(pred).split(), normalize_answer(ref).split())


def _qa_f1_zh(pred: str, ref: str, sample: Sample | None) -> float:
    """LongBench `qa_f1_zh_score` for one reference (jieba words, normalised, empties dropped)."""
    jieba = _jieba()

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in jieba.cut(text, cut_all=False)) if w]

    return _token_f1(words(pred), words(ref))


def _rouge(pred: str, ref: str, sample: Sample | None) -> float:
    """LongBench `rouge_score`: ROUGE-L F of the `rouge` package; 0.0 whenever the package raises."""
    rouge = _need("rouge")
    try:
        scores = rouge.Rouge().get_scores([pred], [ref], avg=True)
    except Exception:  # the official catches everything (empty hypothesis, RecursionError on long text)
        return 0.0
    return float(scores["rouge-l"]["f"])


def _rouge_zh(pred: str, ref: str, sample: Sample | None) -> float:
    """LongBench `rouge_zh_score`: ROUGE-L F over jieba words joined by spaces."""
    jieba = _jieba()
    return _rouge(" ".join(jieba.cut(pred, cut_all=False)), " ".join(jieba.cut(ref, cut_all=False)), sample)


def _classification(pred: str, ref: str, sample: Sample | None) -> float:
    """LongBench `classification_score`: 1/#matched classes when the reference class is among the matches."""
    all_classes = None if sample is None else sample.extra.get("all_classes")
    if not all_classes:
        raise ValueError(
            "metric 'classification' needs sample.extra['all_classes'] (the task's class names, a non-empty "
            f"list), got sample={None if sample is None else sample.id!r} with all_classes={all_classes!r}"
        )
    matches = [c for c in all_classes if c in pred]
    # The official removes sub-string matches while iterating over the same list (so the element after a
    # removed one is not examined); kept verbatim for score parity.
    for term in matches:
        if term in ref and term != ref:
            matches.remove(term)
    return 1.0 / len(matches) if ref in matches else 0.0


def _number_share(pred: str, target: str) -> float:
    """Fraction of the integers in `pred` that equal `target` (0 when `pred` has none)."""
    numbers = re.findall(r"\d+", pred)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == target) / len(numbers)


def _count(pred: str, ref: str, sample: Sample | None) -> float:
    """LongBench `count_score`: share of the prediction's integers equal to the reference count."""
    return _number_share(pred, str(ref))


def _paragraph_id(ref: str, pattern: str, metric: str) -> str:
    """The paragraph number in a retrieval reference ('Paragraph 3' / '段落3')."""
    found = re.findall(pattern, ref)
    if not found:
        raise ValueError(
            f"metric {metric!r}: reference {ref!r:.80} has no paragraph number matching {pattern!r}"
        )
    return found[0]


def _retrieval(pred: str, ref: str, sample: Sample | None) -> float:
    """LongBench `retrieval_score`: share of the prediction's integers equal to the 'Paragraph N' number."""
    return _number_share(pred, _paragraph_id(ref, r"Paragraph (\d+)", "retrieval"))


def _retrieval_zh(pred: str, ref: str, sample: Sample | None) -> float:
    """LongBench `retrieval_zh_score`: share of the prediction's integers equal to the '段落N' number."""
    return _number_share(pred, _paragraph_id(ref, r"段落(\d+)", "retrieval_zh"))


def first_code_line(prediction: str) -> str:
    """LongBench `code_sim_score` line choice: the first line without '`', '#' or '//' ('' if none)."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def _code_sim(pred: str, ref: str, sample: Sample | None) -> float:
    """LongBench `code_sim_score`: fuzzywuzzy `fuzz.ratio` / 100 of the first code line vs the reference."""
    return _fuzz().ratio(first_code_line(pred), ref) / 100


def first_line(prediction: str) -> str:
    """LongBench eval.py cut for `FIRST_LINE_TASKS`: `prediction.lstrip('\\n').split('\\n')[0]`."""
    return prediction.lstrip("\n").split("\n")[0]


def _longbench(per_reference: Callable[[str, str, Sample | None], float], name: str) -> Metric:
    """A per-reference LongBench metric as eval.py's scorer applies it: first-line cut, max over answers."""

    def metric(prediction: str, answers: Sequence[str], sample: Sample | None = None) -> float:
        prediction, answers = _check(prediction, answers)
        if sample is not None and sample.task in FIRST_LINE_TASKS:
            prediction = first_line(prediction)
        score = 0.0
        for ref in answers:
            score = max(score, float(per_reference(prediction, ref, sample)))
        return score

    metric.__name__ = name
    metric.__doc__ = f"LongBench '{name}' scored as eval.py's scorer: {per_reference.__doc__}"
    return metric


# ------------------------------------------------------------------------------------------------- MATH-500


def _math_timeout() -> int | None:
    """math_verify's signal-based timeout only works in the main thread; elsewhere it is disabled."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_equiv(prediction: str, answers: Sequence[str], sample: Sample | None = None) -> float:
    """1.0 when the prediction's last \\boxed{...} is math_verify-equivalent to any reference, else 0.0."""
    prediction, answers = _check(prediction, answers)
    boxed = extract_boxed(prediction)
    if boxed is None or not boxed.strip():
        return 0.0
    mv = _need("math_verify")
    timeout = _math_timeout()
    target = mv.parse("\\boxed{" + boxed + "}", parsing_timeout=timeout)
    if not target:
        return 0.0
    for ref in answers:
        gold = mv.parse("\\boxed{" + ref + "}", parsing_timeout=timeout)
        if gold and mv.verify(gold, target, timeout_seconds=timeout):
            return 1.0
    return 0.0


def grade_answer(prediction: str, answers: Sequence[str], sample: Sample | None = None) -> float:
    """1.0 if prm800k's `grade_answer` accepts the prediction's last \\boxed{} for any reference, else 0.0."""
    prediction, answers = _check(prediction, answers)
    boxed = extract_boxed(prediction)
    return float(boxed is not None and any(grader.grade_answer(boxed, ref) for ref in answers))


def exact_match(prediction: str, answers: Sequence[str], sample: Sample | None = None) -> float:
    """1.0 when the last \\boxed{...} equals a reference as a string after Hendrycks/prm800k normalisation."""
    prediction, answers = _check(prediction, answers)
    boxed = extract_boxed(prediction)
    return float(boxed is not None and any(grader.exact_match(boxed, ref) for ref in answers))


def has_answer(prediction: str) -> bool:
    """The prediction has a non-empty last \\boxed{...} (Table 10's Empty% counts the generations without)."""
    boxed = extract_boxed(prediction)
    return boxed is not None and bool(boxed.strip())


@functools.lru_cache(maxsize=65536)
def _math_draw(boxed: str | None, answers: tuple[str, ...]) -> tuple[float, float, float]:
    """(flex, exact, math_equiv) of one boxed answer, cached: many generations box the same answer."""
    if boxed is None:
        return 0.0, 0.0, 0.0
    prediction = "\\boxed{" + boxed + "}"
    return (grade_answer(prediction, answers), exact_match(prediction, answers),
            math_equiv(prediction, answers))


def math_draw(prediction: str, answers: Sequence[str]) -> dict[str, float]:
    """One MATH generation's 0/1 scores: flex (grade_answer), exact (exact_match), math_equiv, and empty."""
    prediction, answers = _check(prediction, answers)
    boxed = extract_boxed(prediction)
    flex, exact, equiv = _math_draw(boxed, answers)
    return {"flex": flex, "exact": exact, "math_equiv": equiv, "empty": float(not has_answer(prediction))}


def math_at_k(draws: Sequence[dict[str, float]]) -> dict[str, float]:
    """A problem's scores over its k draws (`math_draw` dicts): the paper's Table 10 metrics.

    flex@k = mean `grade_answer` accuracy over the k draws; pass@k = 1.0 when at least one draw is correct
    (the paper's "score"); exact@k = mean exact match over the draws: the paper never defines it, so this
    takes the mean of `exact_match` (the Hendrycks/prm800k-normalised strings are equal, no sympy);
    math_equiv@k = mean `math_equiv`. With k = 1 (greedy), flex@1 = pass@1.
    """
    if not draws:
        raise ValueError("draws must hold at least one generation's scores, got none")
    k = len(draws)
    return {"flex": sum(d["flex"] for d in draws) / k, "exact": sum(d["exact"] for d in draws) / k,
            "pass": float(any(d["flex"] > 0 for d in draws)),
            "math_equiv": sum(d["math_equiv"] for d in draws) / k}


# ---------------------------------------------------------------------------------------------------- tables

METRICS: dict[str, Metric] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": _longbench(_qa_f1, "qa_f1"),
    "qa_f1_zh": _longbench(_qa_f1_zh, "qa_f1_zh"),
    "rouge": _longbench(_rouge, "rouge"),
    "rouge_zh": _longbench(_rouge_zh, "rouge_zh"),
    "classification": _longbench(_classification, "classification"),
    "retrieval": _longbench(_retrieval, "retrieval"),
    "retrieval_zh": _longbench(_retrieval_zh, "retrieval_zh"),
    "count": _longbench(_count, "count"),
    "code_sim": _longbench(_code_sim, "code_sim"),
    "math_equiv": math_equiv,
    "grade_answer": grade_answer,
}


def score(sample: Sample, prediction: str) -> float:
    """The score in [0, 1] of `prediction` for `sample` under the sample's own metric."""
    if sample.metric not in METRICS:
        raise ValueError(f"sample {sample.id!r} has metric={sample.metric!r}; allowed: {sorted(METRICS)}")
    return METRICS[sample.metric](prediction, sample.answers, sample)


def _finite(name: str, value) -> float:
    """`value` as a finite, non-negative float, else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def aggregate(scores: Iterable[float]) -> float:
    """Mean of per-sample scores (LongBench/RULER report 100 * this, rounded to 2 decimals)."""
    values = [_finite("scores[]", s) for s in scores]
    if not values:
        raise ValueError("scores must hold at least one score, got an empty sequence")
    return sum(values) / len(values)


def retention(score: float, dense_score: float) -> float | None:
    """100 * score / dense_score (same scale for both); None (undefined) when the dense score is 0."""
    score = _finite("score", score)
    dense_score = _finite("dense_score", dense_score)
    if dense_score == 0:
        return None
    return 100.0 * score / dense_score

"""MATH-500 (HuggingFaceH4/MATH-500): chain-of-thought reasoning under decode-time cache growth.

Data: a local jsonl in the HuggingFaceH4/MATH-500 layout, one problem per line with the keys `problem`,
`solution`, `answer`, `subject`, `level` and `unique_id`. `build` reads `{data_dir}/math500.jsonl`, or, when
that is absent, `{data_dir}/test.jsonl` (the file's name in the HF dataset repository). Nothing is downloaded.

Prompt: the paper (Appendix F) gives no prompt text, so this uses the standard instruction of the reasoning
model cards (DeepSeek-R1, Qwen3): the problem, a newline, then "Please reason step by step, and put your final
answer within \\boxed{}." The problem is `Sample.context` and the newline + instruction is `Sample.question`,
so the question-agnostic protocol compresses the problem statement and appends the instruction afterwards.

Problems (Table 10: "n=100, first 100 problems"): `build` with `num_samples=None` takes the first
`PAPER_PROBLEMS` = 100 lines of the file; `DEFAULT_SAMPLES` names that default for a runner or CLI (as
`DEFAULT_LENGTH` does for the length). Give `num_samples=500` for the whole set.

Scoring (Appendix F): each generation is scored by openai/prm800k's `grade_answer` on its last `\\boxed{}`
(metric "grade_answer", `vdjax.eval.grader`); the summary adds exact match, math_verify's `math_equiv`, and
over the k draws of a problem flex@k / exact@k / pass@k (`vdjax.eval.metrics.math_at_k`). The paper samples
k = 5 draws per problem (Qwen3.5: greedy, k = 1): the runner's `sampling` and `draws`.

Budgets (Appendix F): cache budgets are about 25% and 50% of the *average dense generation length*, i.e. the
mean number of generated tokens per dense generation (prompt excluded), averaged over all problems and all k
samples, then rounded to a clean size; `fraction_budgets` implements that rule.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from vdjax.checks import check_int
from vdjax.eval.sample import Sample, read_jsonl

TASKS = ("math500",)
DEFAULT_LENGTH = 16384  # the dense max_new_tokens of most models in the paper's Table 10
PAPER_PROBLEMS = 100  # Table 10: "n=100, first 100 problems"
DEFAULT_SAMPLES = PAPER_PROBLEMS  # problems taken when num_samples is None
METRIC = "grade_answer"  # the paper's scorer (prm800k grade_answer on the last \boxed{})
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
QUESTION = "\n" + INSTRUCTION
DATA_FILES = ("math500.jsonl", "test.jsonl")
REQUIRED_KEYS = ("problem", "answer", "unique_id")
SOURCE = "https://huggingface.co/datasets/HuggingFaceH4/MATH-500 (file test.jsonl)"

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening at text[start] == '{', or None when it never closes."""
    depth = 0
    k = start
    while k < len(text):
        c = text[k]
        if c == "\\":  # an escaped character (\{, \}, \\) never opens or closes a group
            k += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:k]
        k += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...} (nested braces kept) or \\boxed 5 in `text`, or None.

    `\\boxed{...}` takes the balanced brace group (escaped braces `\\{ \\}` do not count); the brace-less
    form `\\boxed 5` takes the run of characters up to the next whitespace, `$` or `}`. An occurrence whose
    group never closes is skipped in favour of the previous one.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}: {text!r:.80}")
    for m in reversed(list(_BOX.finditer(text))):
        j = m.end()
        while j < len(text) and text[j].isspace():
            j += 1
        if j < len(text) and text[j] == "{":
            content = _braced(text, j)
            if content is not None:
                return content
            continue
        arg = re.match(r"[^\s$}]+", text[j:])  # the lookahead in _BOX already excludes \boxedfoo
        if arg:
            return arg.group(0)
    return None


def _round_budget(value: float, rounding) -> int:
    """`value` tokens rounded per `rounding` ("pow2", "none" or a positive int multiple), at least 1."""
    if rounding == "pow2":
        low = 2 ** math.floor(math.log2(value)) if value >= 1 else 1
        high = low * 2
        return int(low if value - low < high - value else high)
    if rounding == "none":
        return max(1, int(round(value)))
    multiple = rounding
    return max(multiple, int(round(value / multiple)) * multiple)


def fraction_budgets(
    dense_lengths: Sequence[float], fractions: Sequence[float] = (0.25, 0.5), *, rounding: str | int = "pow2"
) -> dict[float, int]:
    """Cache budget per fraction: fraction x mean dense generation length, rounded (Appendix F's rule).

    `dense_lengths` are the generated-token counts of the dense run, one per generation (prompt tokens not
    included; with k samples per problem pass all of them): the paper sets budgets from the *average*
    dense generation length per model. `rounding`: "pow2" (default) rounds to the nearest power of two (ties
    up), which reproduces every budget of Appendix F / Table 3 (e.g. 1124 tokens -> 256 / 512, 1947 -> 512 /
    1024, 3708 -> 1024 / 2048); "none" rounds to the nearest integer; an int
    rounds to the nearest multiple. """
    if isinstance(dense_lengths, (str, bytes)) or not isinstance(dense_lengths, Iterable):
        raise TypeError(f"dense_lengths must be a sequence of token counts, got {dense_lengths!r:.80}")
    lengths = list(dense_lengths)
    if not lengths:
        raise ValueError("dense_lengths must hold at least one generation length, got an empty sequence")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n < 0:
            raise ValueError(f"dense_lengths must hold finite token counts >= 0, got {n!r}")
    mean = sum(lengths) / len(lengths)
    if mean <= 0:
        raise ValueError(f"dense_lengths must have a positive mean, got {mean} over {len(lengths)} lengths")
    if not (rounding in ("pow2", "none") or (isinstance(rounding, int) and not isinstance(rounding, bool)
                                              and rounding > 0)):
        raise ValueError(f"rounding must be 'pow2', 'none' or a positive int multiple, got {rounding!r}")
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, Iterable):
        raise TypeError(f"fractions must be a sequence of numbers in (0, 1], got {fractions!r:.80}")
    out: dict[float, int] = {}
    for f in fractions:
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"fractions must hold numbers in (0, 1], got {f!r}")
        out[float(f)] = _round_budget(f * mean, rounding)
    return out


def task_metric(task: str) -> str:
    """The metric of MATH-500's samples (for `vdjax rescore`)."""
    return METRIC


def budget_rule(fractions: Sequence[float], dense_lengths: Sequence[float]) -> dict[float, int]:
    """The runner's hook for budgets given as fractions: `fraction_budgets` (nearest power of two)."""
    return fraction_budgets(dense_lengths, fractions)


def data_path(data_dir) -> Path:
    """The MATH-500 jsonl in `data_dir` (math500.jsonl, else test.jsonl); FileNotFoundError naming both."""
    if data_dir is None:
        raise ValueError(f"data_dir must be the folder holding {' or '.join(DATA_FILES)}, got None")
    folder = Path(os.fspath(data_dir))
    for name in DATA_FILES:
        if (folder / name).is_file():
            return folder / name
    looked = ", ".join(str(folder / n) for n in DATA_FILES)
    raise FileNotFoundError(
        f"MATH-500 data not found: looked for {looked}. Download test.jsonl from {SOURCE} and put it in "
        f"{folder} (as test.jsonl or math500.jsonl)."
    )


def _read_rows(path: Path, limit: int | None) -> list[dict]:
    """The first `limit` (all when None) MATH-500 rows of a jsonl file, keys checked."""
    return [row for _, row in read_jsonl(path, limit, REQUIRED_KEYS,
                                         "a MATH-500 (HuggingFaceH4/MATH-500 layout)")]


def build(task: str, tokenizer=None, *, length: int, num_samples: int | None, seed: int = 0,
          data_dir) -> list[Sample]:
    """MATH-500 samples: the first `num_samples` problems of the file, `max_new_tokens = length`.

    `length` is the dense generation budget (max_new_tokens, e.g. 16384 or 32768 in Appendix F).
    `num_samples` takes the first n lines in file order; None takes the paper's first `PAPER_PROBLEMS` (100);
    more than the file holds takes all. `seed` is recorded in `extra` only. `tokenizer` is unused (no
    truncation: the prompts are short); it is accepted for the common builder signature.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    check_int("length (the dense max_new_tokens)", length)
    check_int("num_samples", num_samples, optional=True)
    path = data_path(data_dir)
    samples = []
    for row in _read_rows(path, PAPER_PROBLEMS if num_samples is None else num_samples):
        samples.append(Sample(
            id=str(row["unique_id"]),
            task=task,
            context=str(row["problem"]),
            question=QUESTION,
            answers=(str(row["answer"]),),
            max_new_tokens=length,
            metric=METRIC,
            chat_template=True,
            extra={"subject": row.get("subject"), "level": row.get("level"), "unique_id": row["unique_id"],
                   "seed": seed, "source": str(path)},
        ))
    return samples

"""LongBench v1 (THUDM/LongBench): 21 long-document tasks, prompts and truncation as the official pred.py.

Data: the official jsonl files, one JSON object per line with `input`, `context`, `answers`, `length`,
`dataset`, `language`, `all_classes` and `_id`. Get them from the THUDM/LongBench dataset on the Hugging Face
hub (https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip) and unzip so that
`{data_dir}/{task}.jsonl` exists (the archive unpacks into a `data/` folder: pass that
folder). Nothing is downloaded here.

Official protocol kept: the per-task prompt templates (`DATASET2PROMPT`, typos included), generation lengths
(`DATASET2MAXLEN`), metrics (`vdjax.eval.metrics.DATASET2METRIC`), the tasks that skip the chat template
(`NO_CHAT_TEMPLATE`) and middle truncation of over-long prompts to `length` tokens (see `truncate_middle`).
The scorer's first-line cut for trec/triviaqa/samsum/lsht lives in `vdjax.eval.metrics`. `length` is the
prompt budget of the official `model2maxlen` (e.g. 31500 for 32k models), not the KV-cache budget (the
paper's 4k / 8k) that the runner applies.
"""

from __future__ import annotations

import os
from pathlib import Path

from vdjax.checks import check_int
from vdjax.eval.metrics import DATASET2METRIC
from vdjax.eval.sample import Sample, read_jsonl

TASKS = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
    "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p",
)

# Official pred.py: "chat models are better off without build prompts on these tasks".
NO_CHAT_TEMPLATE = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
STOP_AT_NEWLINE = ("samsum",)  # pred.py: eos_token_id=[eos, id of "\n"], min_length=context_length + 1

# Official config/dataset2maxlen.json: max_new_tokens per task.
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}

# Official config/dataset2prompt.json, verbatim (typos such as "asconcisely" included); filled by
# str.format(context=..., input=...).
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. "
        "Answer the question asconcisely as you can, using a single phrase if possible. Do not "
        "provide any explanation.\n\n"
        "Story: {context}\n\n"
        "Now, answer the question based on the story asconcisely as you can, using a single "
        "phrase if possible. Do not provide any explanation.\n\n"
        "Question: {input}\n\n"
        "Answer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as "
        "you can, using a single phrase or sentence if possible. If the question cannot be "
        "answered based on the information in the article, write \"unanswerable\". If the question "
        "is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any "
        "explanation.\n\n"
        "Article: {context}\n\n"
        " Answer the question based on the above article as concisely as you can, using a single "
        "phrase or sentence if possible. If the question cannot be answered based on the "
        "information in the article, write \"unanswerable\". If the question is a yes/no question, "
        "answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\n"
        "Question: {input}\n\n"
        "Answer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n"
        "{context}\n\n"
        "Now, answer the following question based on the above text, only give me the answer and "
        "do not output any other words.\n\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n"
        "{context}\n\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n"
        "问题：{input}\n"
        "回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n\n"
        "The following are given passages.\n"
        "{context}\n\n"
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n\n"
        "The following are given passages.\n"
        "{context}\n\n"
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n\n"
        "The following are given passages.\n"
        "{context}\n\n"
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n"
        "文章：{context}\n\n"
        "请基于上述文章回答下面的问题。\n\n"
        "问题：{input}\n"
        "回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n"
        "{context}\n\n"
        "Now, write a one-page summary of the report.\n\n"
        "Summary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. "
        "Answer the query in one or more sentences.\n\n"
        "Transcript:\n"
        "{context}\n\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n\n"
        "Query: {input}\n"
        "Answer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\n"
        "News:\n"
        "{context}\n\n"
        "Now, write a one-page summary of all the news.\n\n"
        "Summary:"
    ),
    "vcsum": (
        "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n"
        "会议记录：\n"
        "{context}\n\n"
        "会议总结："
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "{context}\n"
        "{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not "
        "output any other words. The following are some examples.\n\n"
        "{context}\n\n"
        "{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
        "{context}\n\n"
        "{input}"
    ),
    "lsht": (
        "请判断给定新闻的类别，下面是一些例子。\n\n"
        "{context}\n"
        "{input}"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
        "Please carefully read these paragraphs and determine how many unique paragraphs there "
        "are after removing duplicates. In other words, how many non-repeating paragraphs are "
        "there in total?\n\n"
        "{context}\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output "
        "format should only contain the number, such as 1, 2, 3, and so on.\n\n"
        "The final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
        "paragraph the abstract is from.\n\n"
        "{context}\n\n"
        "The following is an abstract.\n\n"
        "{input}\n\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format "
        "must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\n"
        "The answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n"
        "{context}\n\n"
        "下面是一个摘要\n\n"
        "{input}\n\n"
        "请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n"
        "答案是："
    ),
    "lcc": (
        "Please complete the code given below. \n"
        "{context}Next line of code:\n"
    ),
    "repobench-p": (
        "Please complete the code given below. \n"
        "{context}{input}Next line of code:\n"
    ),
}

DATA_URL = "https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip"
REQUIRED_KEYS = ("input", "context", "answers", "_id")


def task_metric(task: str) -> str:
    """The metric of a task's samples (for `vdjax rescore` of lines that predate the `metric` field)."""
    return DATASET2METRIC[task]


def split_template(task: str) -> tuple[str, str]:
    """(template text before `{context}`, template text after it) of the task's official prompt."""
    template = DATASET2PROMPT[task]
    head, sep, tail = template.partition("{context}")
    if not sep or "{" in head or "}" in head:
        raise AssertionError(f"prompt template of {task!r} must hold one {{context}} after brace-free text")
    return head, tail


def _decode(tokenizer, ids) -> str:
    """Official pred.py decoding of a kept half: `tokenizer.decode(ids, skip_special_tokens=True)`."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def truncate_middle(tokenizer, context_part: str, question_part: str, length: int) -> tuple[str, str, dict]:
    """(context, question, info): the official middle truncation of `context_part + question_part`, split.

    The prompt (before any chat template) is tokenised without special tokens. When it has more than
    `length` tokens, pred.py keeps `decode(ids[:length // 2]) + decode(ids[-(length // 2):])`. The returned
    `context + question` is always exactly that text (or the untouched prompt when it fits); re-tokenising it
    can give a token more or less than `length` where the two halves join, as in the official code. How it
    is split, reported in `info["split"]`:

    - "verbatim": no truncation, or the kept tail ends with the whole question part as written (the usual
      case: the question lies in the kept tail and decodes to itself), so `question == question_part`;
    - "token_boundary": the question lies in the kept tail but decoding does not reproduce it verbatim
      (e.g. tokenizer clean-up of spaces); the tail is split where decoding its tokens before the question's
      first token ends (the first token starting at or after the context end, as `render_ids` splits);
    - "question_cut": the cut removed the start of the question part (or, when the head holds the whole
      context, only question text), so the question is what survives of it: tail (and head beyond the
      context end);
    - "head_tail": fallback when decoding is not prefix-consistent: context = kept head, question = kept tail.
    """
    check_int("length (prompt tokens kept by middle truncation)", length, 2)
    prompt = context_part + question_part
    enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    n = len(ids)
    info = {"truncated": False, "split": "verbatim", "prompt_tokens": n}
    if n <= length:
        return context_part, question_part, info
    half = length // 2
    head, tail = _decode(tokenizer, ids[:half]), _decode(tokenizer, ids[n - half:])
    info["truncated"] = True
    boundary = len(context_part)
    b = next((i for i, (s, e) in enumerate(offsets) if e > s and s >= boundary), n)
    if b >= n - half:  # the question's first token is in the kept tail
        if len(tail) >= len(question_part) and tail.endswith(question_part):
            cut = len(tail) - len(question_part)
            return head + tail[:cut], tail[cut:], info
        piece = _decode(tokenizer, ids[n - half:b])
        if tail.startswith(piece):
            info["split"] = "token_boundary"
            return head + piece, tail[len(piece):], info
    elif b < half:  # the whole context part is in the kept head; the cut fell inside the question
        piece = _decode(tokenizer, ids[:b])
        if head.startswith(piece):
            info["split"] = "question_cut"
            return piece, head[len(piece):] + tail, info
    else:  # the question's first token was cut away: head is all context, tail all question
        info["split"] = "question_cut"
        return head, tail, info
    info["split"] = "head_tail"
    return head, tail, info


def data_path(task: str, data_dir) -> Path:
    """`{data_dir}/{task}.jsonl`, or a FileNotFoundError saying where it was looked for and how to get it."""
    if data_dir is None:
        raise ValueError(f"data_dir must be the folder holding {task}.jsonl (unzipped data.zip), got None")
    path = Path(os.fspath(data_dir)) / f"{task}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"LongBench data for {task!r} not found at {path}. Download data.zip of the THUDM/LongBench "
            f"dataset on the Hugging Face hub ({DATA_URL}) and unzip it so that {path} exists (pass the "
            f"unzipped `data` folder as data_dir)."
        )
    return path


def _read_rows(path: Path, limit: int | None) -> list[dict]:
    """The first `limit` (all when None) LongBench rows of a jsonl file, keys and `answers` checked."""
    rows = read_jsonl(path, limit, REQUIRED_KEYS, "a LongBench (official layout)")
    for lineno, row in rows:
        if isinstance(row["answers"], str) or not isinstance(row["answers"], list):
            raise ValueError(f"{path}:{lineno}: 'answers' must be a list of strings, "
                             f"got {row['answers']!r:.80}")
    return [row for _, row in rows]


def build(task: str, tokenizer, *, length: int, num_samples: int | None, seed: int = 0,
          data_dir) -> list[Sample]:
    """LongBench samples of `task`: official prompt, middle-truncated to `length` tokens, split in two.

    `num_samples` takes the first n lines in file order (None or more than the file holds: all); `seed` is
    recorded in `extra` only (the order is the file's). Each sample: id = the official `_id`, context = the
    template up to and including the (truncated) context, question = the rest (see `truncate_middle`),
    max_new_tokens = `DATASET2MAXLEN`, chat_template = task not in `NO_CHAT_TEMPLATE`, metric =
    `DATASET2METRIC`, extra = all_classes, length, language, _id, seed, truncation info.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of the 21 LongBench tasks {TASKS}, got {task!r}")
    check_int("length (prompt tokens kept by middle truncation)", length, 2)
    check_int("num_samples", num_samples, optional=True)
    if tokenizer is None:
        raise ValueError("tokenizer must be a (fast) tokenizer: middle truncation counts tokens, got None")
    path = data_path(task, data_dir)
    head, after = split_template(task)
    samples = []
    for row in _read_rows(path, num_samples):
        prompt = DATASET2PROMPT[task].format(context=row["context"], input=row["input"])
        context_part = head + row["context"]
        question_part = prompt[len(context_part):]
        assert prompt.startswith(context_part) and question_part == after.format(input=row["input"])
        context, question, info = truncate_middle(tokenizer, context_part, question_part, length)
        samples.append(Sample(
            id=str(row["_id"]),
            task=task,
            context=context,
            question=question,
            answers=tuple(str(a) for a in row["answers"]),
            max_new_tokens=DATASET2MAXLEN[task],
            metric=DATASET2METRIC[task],
            chat_template=task not in NO_CHAT_TEMPLATE,
            # pred.py stops samsum at a newline too (eos_token_id + "\n") and, with min_length = prompt + 1,
            # never at the first token
            stop=("\n",) if task in STOP_AT_NEWLINE else (),
            min_new_tokens=1 if task in STOP_AT_NEWLINE else 0,
            extra={"all_classes": row.get("all_classes"), "length": row.get("length"),
                   "language": row.get("language"), "_id": row["_id"], "seed": seed, **info},
        ))
    return samples

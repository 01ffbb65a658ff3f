"""The predictions file: one JSON line per (sample, policy, budget, draw), crash-safe, one writer at a time.

- `read_predictions` reads it (a line torn by a crash mid-write is dropped, with `repair=True` cut off);
- `PredictionsFile` appends lines, each flushed and fsynced, under an exclusive lock (`<file>.lock`): a second
  process writing the same file gets a clear error instead of interleaved lines;
- `rescore` recomputes every score from the stored predictions (after a metric fix), in place.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

KEY_FIELDS = ("task", "sample_id", "policy", "budget", "protocol", "draw")
# what a metric may read of a sample besides its answers, stored with each line so `rescore` can call it
METRIC_EXTRA = ("all_classes",)


def record_key(record: Mapping[str, Any]) -> tuple:
    """The resume key of a prediction line: (task, sample_id, policy, budget, protocol, draw)."""
    return tuple(record.get(f, 0) if f == "draw" else record[f] for f in KEY_FIELDS)


def _parse_line(raw: bytes) -> dict | None:
    """The JSON object of one line holding every key field, or None."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or any(f not in record for f in KEY_FIELDS if f != "draw"):
        return None
    return record


def _truncate(path: Path, size: int) -> None:
    """Cut the file to `size` bytes, durably."""
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


def read_predictions(path: str | os.PathLike, *, repair: bool = False) -> list[dict]:
    """Every record of a predictions.jsonl (a torn last line, from a crash mid-write, is skipped).

    With `repair=True` the file itself is fixed: a torn last line is cut off, a complete last line missing
    its newline gets one. A bad line anywhere else is corruption:
    ValueError naming the file and line. """
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        record = _parse_line(raw)
        if record is None:
            if number == len(lines) and not tail:  # last line, newline written but content cut: torn
                if repair:
                    _truncate(path, len(data) - len(raw) - 1)
                continue
            raise ValueError(f"{path}: line {number} is not a prediction record: {raw[:80]!r}")
        records.append(record)
    if tail.strip():
        record = _parse_line(tail)
        if record is not None:
            records.append(record)
            if repair:
                with open(path, "ab") as f:
                    f.write(b"\n")
                    f.flush()
                    os.fsync(f.fileno())
        elif repair:
            _truncate(path, len(data) - len(tail))
    return records


class PredictionsFile:
    """Exclusive append access to one predictions.jsonl: `with PredictionsFile(p) as f: f.append(record)`.

    The lock is an `flock` on `<file>.lock` (released when the process ends, however it ends); it holds the
    writer's pid, named in the error a second writer gets.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock = self._file = None

    def __enter__(self) -> PredictionsFile:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(self.lock_path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise RuntimeError(f"{self.path} is being written by another process (pid {holder}, lock "
                               f"{self.lock_path}); wait for it to finish or stop it: "
                               "one writer per file") from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        self._lock = lock
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def append(self, record: dict) -> None:
        """Write one line; it is on disk (flushed and fsynced) when this returns."""
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def __exit__(self, *exc) -> None:
        self._file.close()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()


def rescore(path: str | os.PathLike, metrics: Mapping[str, Callable] | None = None,
            task_metric: Callable[[str], str] | None = None) -> tuple[int, int]:
    """Recompute every line's score from its stored prediction with today's metrics; rewrite the file.

    A line's metric is its `metric` field, else `task_metric(task)` (a benchmark's rule, for lines written
    before the field existed). Returns (lines, lines whose score changed). Holds the writer lock meanwhile;
    the new file replaces the old one atomically.
    """
    from vdjax.eval.metrics import METRICS
    from vdjax.eval.sample import Sample

    metrics = METRICS if metrics is None else metrics
    path = Path(path)
    with PredictionsFile(path):
        records = read_predictions(path, repair=True)
        changed = 0
        for number, r in enumerate(records, 1):
            name = r.get("metric") or (task_metric(r["task"]) if task_metric else None)
            if name not in metrics:
                raise ValueError(f"{path}: line {number} ({r['task']} {r['sample_id']}) has metric {name!r}; "
                                 f"known: {sorted(metrics)}")
            sample = Sample(id=r["sample_id"], task=r["task"], context="", question="",
                            answers=tuple(r["answers"]), max_new_tokens=0, metric=name,
                            extra=dict(r.get("metric_extra") or {}))
            score = float(metrics[name](r["prediction"], sample.answers, sample))
            if not 0.0 <= score <= 1.0:
                raise ValueError(f"metric {name!r} gave score {score} for line {number}; "
                                 "scores lie in [0, 1]")
            changed += score != r["score"]
            r["score"], r["metric"] = score, name
        tmp = path.with_name(path.name + ".rescore")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return len(records), changed

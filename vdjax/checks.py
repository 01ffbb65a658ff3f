"""Argument and input-file checks shared by the library: each error names the argument (or file),
the value and what is allowed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def check_int(name: str, value: Any, minimum: int = 1, *, optional: bool = False) -> int | None:
    """`value` as an int >= `minimum` (None passes when `optional`), or a ValueError naming `name`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def check_name(name: str, value: Any) -> str:
    """A non-empty string usable as one folder name, or a ValueError naming the argument."""
    if not isinstance(value, str) or not value or value in (".", "..") or "/" in value or os.sep in value:
        raise ValueError(f"{name} must be a non-empty name without path separators, got {value!r}")
    return value


def unique_list(name: str, values: Any) -> list:
    """A non-empty list from a comma-separated string or a sequence, duplicates dropped (order kept)."""
    if isinstance(values, str):
        values = [v.strip() for v in values.split(",") if v.strip()]
    if not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a list, got {type(values).__name__}: {values!r}")
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError(f"{name} must name at least one entry, got {values!r}")
    return out


def read_jsonl(path: Path, limit: int | None, required: Sequence[str], layout: str) -> list[tuple[int, dict]]:
    """(line number, object) of the first `limit` (all when None) JSON objects of a jsonl file, blank lines
    skipped; a line that is not a JSON object holding every `required` key is a ValueError naming `layout`."""
    rows: list[tuple[int, dict]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in required if k not in row]
            if missing:
                raise ValueError(f"{path}:{lineno}: missing key(s) {missing}; {layout} row needs "
                                 f"{list(required)}")
            rows.append((lineno, row))
    return rows

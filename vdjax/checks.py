"""Argument checks shared by the library: each error names the argument, the value and what is allowed."""

from __future__ import annotations

import os
from typing import Any, Iterable

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

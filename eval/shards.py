"""Evaluation sweeps across hosts: `evaluate(..., shard=(I, N))` (CLI `--shard I/N`; under `jax.distributed`
without a mesh spanning the processes, the process index and count) runs the batches k with k % N == I of
the run's (task, sample) batches, in the single-process order, into its own files
(`predictions.shard-I-of-N.jsonl`, `run.shard-I-of-N.json`: each resumable on its own); `merge` combines the
shards into the `predictions.jsonl` one process would write (its lines in its order; a missing shard named,
a duplicate refused).

A shard's unit is a whole batch of the single-process run (`runner.batches` over every sample), so every
call sees the rows it would see in one process: the same records, scores and `batch` fields.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from vdjax.eval.records import read_predictions, record_key

SHARD_FILE = re.compile(r"^predictions\.shard-(\d+)-of-(\d+)\.jsonl$")


def parse_shard(text: str) -> tuple[int, int]:
    """"I/N" -> (I, N), 0 <= I < N; ValueError naming the value otherwise."""
    i, sep, n = str(text).partition("/")
    try:
        i, n = int(i), int(n)
    except ValueError:
        i, n = -1, 0
    if not sep or n < 1 or not 0 <= i < n:
        raise ValueError(f"shard={text!r}: expected I/N with 0 <= I < N, e.g. 0/2")
    return i, n


def resolve(shard, mesh) -> tuple[int, int] | None:
    """The run's share: `shard` as given ("I/N" or (I, N)); None under `jax.distributed` without a mesh
    spanning the processes -> (process index, process count); else None (the whole run)."""
    if shard is not None:
        return parse_shard(shard) if isinstance(shard, str) else parse_shard(f"{shard[0]}/{shard[1]}")
    import jax

    from vdjax.engine.sharding import spans_processes

    if jax.process_count() > 1 and (mesh is None or not spans_processes(mesh)):
        return jax.process_index(), jax.process_count()
    return None


def writes(mesh) -> bool:
    """Whether this process writes the run's files: always, but on a mesh spanning `jax.distributed`
    processes (each runs every call, SPMD) only process 0."""
    if mesh is None:
        return True
    import jax

    from vdjax.engine.sharding import spans_processes

    return not spans_processes(mesh) or jax.process_index() == 0


def names(shard: tuple[int, int] | None) -> tuple[str, str]:
    """(predictions file, run file) of a shard (the plain names for the whole run)."""
    if shard is None:
        return "predictions.jsonl", "run.json"
    return f"predictions.shard-{shard[0]}-of-{shard[1]}.jsonl", f"run.shard-{shard[0]}-of-{shard[1]}.json"


def mine(shard: tuple[int, int] | None, index: int) -> bool:
    """Whether batch `index` of the run belongs to this shard."""
    return shard is None or index % shard[1] == shard[0]


def merge(folder: str | os.PathLike) -> Path:
    """Combine a run folder's shard files into its predictions.jsonl (and run.json); returns its path.

    Lines are ordered as one process writes them: by the run's batch (each shard's run file lists every
    batch's rows), then as the shard wrote them. Refuses a missing shard, shards of different N, a line
    found in two shards, or a predictions.jsonl that no merge wrote.
    """
    folder = Path(folder)
    found = {}
    for path in sorted(folder.glob("predictions.shard-*-of-*.jsonl")):
        m = SHARD_FILE.match(path.name)
        if m:
            found[int(m.group(1)), int(m.group(2))] = path
    if not found:
        raise ValueError(f"{folder}: no predictions.shard-I-of-N.jsonl files to merge")
    counts = sorted({n for _, n in found})
    if len(counts) > 1:
        raise ValueError(f"{folder}: shards of different counts N={counts}; merge one N at a time")
    n = counts[0]
    missing = [f"{i}/{n}" for i in range(n) if (i, n) not in found]
    if missing:
        raise ValueError(f"{folder}: shard(s) {', '.join(missing)} missing "
                         f"(predictions.shard-I-of-{n}.jsonl)")
    metas = [json.loads((folder / names((i, n))[1]).read_text()) for i in range(n)]
    order = {tuple(k): b for b, rows in enumerate(metas[0]["batches"]) for k in rows}
    lines, seen = [], {}
    for i in range(n):
        for j, r in enumerate(read_predictions(found[i, n])):
            key = record_key(r)
            if key in seen:
                raise ValueError(f"{folder}: line {key} is in shard {seen[key]}/{n} and shard {i}/{n}")
            seen[key] = i
            lines.append((order.get((r["task"], r["sample_id"], r.get("draw", 0)), len(order)), i, j, r))
    out = folder / "predictions.jsonl"
    meta_path = folder / "run.json"
    if out.exists() and not (meta_path.exists() and json.loads(meta_path.read_text()).get("merged_from")):
        raise ValueError(f"{out} exists and was not written by a merge: merge into another folder")
    tmp = out.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for *_, r in sorted(lines, key=lambda t: t[:3]):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    meta = {k: v for k, v in metas[0].items() if k not in ("batches", "shard")}
    meta["invocations"] = [dict(inv, shard=f"{i}/{n}") for i, m in enumerate(metas)
                           for inv in m["invocations"]]
    meta["merged_from"] = [found[i, n].name for i in range(n)]
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return out

"""The scale table (results/scale/): real prefill and decode programs of 4B-20B models compiled for TPU slices
on this CPU machine (`vdjax.engine.aot`), dense against evicting policies at N = 2048.

    JAX_PLATFORMS=cpu nice .venv/bin/python experiments/scale.py            # resumable: appends runs.jsonl
    .venv/bin/python experiments/scale.py --report                          # README table + figure only

Per (model, slice, policy, prompt length) one line of runs.jsonl (the `aot` report); the dense rows' longest
prompt that fits is searched over the padded lengths the programs compile to (block x the length buckets).
Configs: tests/data/configs/<model>/config.json (public values typed in, see SOURCE.md there).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "scale"
CONFIGS = ROOT / "tests" / "data" / "configs"
MODELS = ("qwen3.5-4b", "qwen3-8b", "gemma3-12b", "gpt-oss-20b")
SLICES = (("v5e-1", (1, 1), 1), ("v5e:2x2", (1, 4), 1), ("v6e:2x2", (1, 4), 1), ("v5e:4x4", (2, 8), 2))
POLICIES = ("dense", "valuediff", "snapkv", "kvzip")
LENGTHS = (8192, 32768, 131072)
BUDGET = 2048
FAR = 1 << 20  # an evicting program compiled at 1M tokens: its peak does not grow
TABLE9 = {("qwen3.5-4b", 131072): {"dense": 70.6, "valuediff": 61.5, "snapkv": 61.9},
          ("gpt-oss-20b", 65536): {"dense": 50.2, "valuediff": 34.0, "snapkv": 34.4}}


def config(name: str):
    """The ModelConfig of a typed-in public config."""
    from vdjax.models.hf_config import from_hf_config

    folder = CONFIGS / name
    gen = folder / "generation_config.json"
    return from_hf_config(json.loads((folder / "config.json").read_text()),
                          json.loads(gen.read_text()) if gen.is_file() else None)


def key(r: dict) -> tuple:
    return r["model"], r["topology"], r["policy"], r["length"]


def done() -> dict:
    """The runs recorded so far, by (model, slice, policy, length)."""
    path = OUT / "runs.jsonl"
    if not path.is_file():
        return {}
    return {key(r): r for r in map(json.loads, path.read_text().splitlines()) if r}


def record(r: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "runs.jsonl", "a") as f:
        f.write(json.dumps(r) + "\n")
    print(f"{r['model']:12s} {r['topology']:8s} {r['policy']:9s} {r['length']:>8d}: "
          f"{r['peak_bytes_per_chip'] / 2**30:6.2f} GiB/chip, "
          f"prefill {r['programs']['prefill']['roofline_s']:.3g} s "
          f"(compile {r['programs']['prefill']['compile_s']} s) {r['verdict']}", flush=True)


def one(model: str, slice_: str, mesh, batch: int, policy: str, length: int) -> dict:
    """One `aot` report, as recorded."""
    from vdjax.engine.aot import aot

    budget = None if policy == "dense" else BUDGET
    r = aot(config(model), topology_name=slice_, mesh=mesh, length=length, policy=policy, budget=budget,
            batch=batch, new_tokens=256, model=model)
    r["policy"] = policy  # the registry name ("dense", not the bound one's display name)
    return r


def candidates() -> list[int]:
    """Padded prompt lengths the programs compile to (block 128 x the length buckets), 8k .. 1M."""
    from vdjax.engine.inputs import bucket

    out, n = [], 64
    while n * 128 <= FAR:
        out.append(n * 128)
        n = bucket(n + 1)
    return out


def longest(model: str, slice_: str, mesh, batch: int, runs: dict) -> int:
    """The longest dense prompt whose prefill and decode fit the chip (binary search over `candidates`, every
    probe recorded)."""
    grid = candidates()
    lo, hi = -1, len(grid)
    for i, n in enumerate(grid):  # what is known already narrows the search
        r = runs.get((model, slice_, "dense", n))
        if r is not None:
            lo, hi = (i, hi) if r["fits"] else (lo, min(hi, i))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = (runs.get((model, slice_, "dense", grid[mid]))
             or one(model, slice_, mesh, batch, "dense", grid[mid]))
        if (model, slice_, "dense", grid[mid]) not in runs:
            record(r)
            runs[key(r)] = r
        lo, hi = (mid, hi) if r["fits"] else (lo, mid)
    return grid[lo] if lo >= 0 else 0


def order() -> list[tuple]:
    """Every run of the table, what answers "will it fit" first: dense and valuediff at 128k on every slice,
    the prompt-length sweep on v5e:2x2, snapkv and kvzip at 128k, then the rest."""
    slices = {s: (mesh, b) for s, mesh, b in SLICES}
    first = [(m, s, p, 131072) for p in ("dense", "valuediff") for m in MODELS for s in slices]
    first += [(m, "v5e:2x2", p, n) for p in ("dense", "valuediff") for m in MODELS for n in LENGTHS[:-1]]
    first += [(m, s, p, 131072) for p in ("snapkv", "kvzip") for m in MODELS for s in slices]
    first += [("gpt-oss-20b", "v5e-1", p, 65536) for p in ("dense", "valuediff")]
    rest = [(m, s, p, n) for p in POLICIES for m in MODELS for s in slices for n in LENGTHS]
    rest += [(m, s, "valuediff", FAR) for m in MODELS for s in slices]
    seen, out = set(), []
    for run in first + ["longest"] + rest:
        if run not in seen:
            seen.add(run)
            out.append(run if run == "longest" else (*run[:2], *slices[run[1]], *run[2:]))
    return out


def sweep() -> None:
    """Every missing run in `order`; the dense rows' longest prompt once the first block is in."""
    runs = done()
    for run in order():
        if run == "longest":
            for m in MODELS:
                for s, mesh, b in SLICES:
                    longest(m, s, mesh, b, runs)
            continue
        m, s, mesh, b, p, n = run
        if (m, s, p, n) in runs:
            continue
        try:
            r = one(m, s, mesh, b, p, n)
        except Exception as e:  # a program that cannot compile is a finding: recorded, not fatal
            r = {"model": m, "topology": s, "policy": p, "length": n,
                 "error": f"{type(e).__name__}: {e}"[:500]}
            with open(OUT / "errors.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
            print("ERROR", r, flush=True)
            continue
        record(r)
        runs[key(r)] = r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", action="store_true",
                    help="only write README.md and the figure from runs.jsonl")
    args = ap.parse_args()
    if not args.report:
        sweep()
    subprocess.run([sys.executable, str(ROOT / "experiments" / "scale_report.py")], check=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""What the adaptive-budget wrappers cost: speed and memory of adakv, criticaladakv, criticalkv and pyramidkv
around valuediff against uniform valuediff, on SmolLM2-135M fp32 (N=512, B=128).

    VDJAX_CACHE=/tmp/vdcache .venv/bin/python bench/adaptive.py    # full run, ~30-40 min, quiet 2-core box
    .venv/bin/python bench/adaptive.py --quick --out /tmp/adaptive-quick.md   # smoke run, ~5 min quiet
    .venv/bin/python bench/adaptive.py --policies valuediff,adakv:valuediff --lengths 2048

Each policy runs in a fresh worker process (its peak RSS is that policy's alone), after waiting for the
machine to go quiet. In it, all warm (the exact program ran once first; the timed calls must compile nothing):
1. prefill: evicting block prefill + first greedy token, tok/s at each of `--lengths` (best of `--reps`);
2. decode: greedy decode tok/s at batch 1 after a 2k prompt, `--new` tokens forced by `min_new_tokens`
   (`Generation.steps / Generation.decode_s`, best of `--reps`);
3. memory: `Generation.cache.nbytes()` of that decode's cache, and the worker's peak RSS (VmHWM: loading,
   every prefill length and the decode included).
Every number also as a ratio to uniform valuediff measured in the same run (always measured, first). Prints
one Markdown table and writes it to `--out` (default results/adaptive/bench.md), the raw numbers beside it
(.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench as B  # noqa: E402  (machine facts, corpus, load measurement, timing helpers)

BASELINE = "valuediff"
POLICIES = (BASELINE, "adakv:valuediff", "criticaladakv:valuediff", "criticalkv:valuediff",
            "pyramidkv:valuediff")


# ---- worker: one policy in a fresh process ---------------------------------------------------------------
def _log(text: str) -> None:
    """A progress line on stderr."""
    print(text, file=sys.stderr, flush=True)


def _best(a, measure, seconds):
    """`a.reps` timed calls, the fastest kept; measured again (bench.best_of) while others kept cores busy."""
    def one_rep():
        """The fastest of `a.reps` calls of `measure`."""
        runs = [measure() for _ in range(a.reps)]
        return min(runs, key=seconds) | {"compiled": sum(r["compiled"] for r in runs),
                                         "runs_s": [seconds(r) for r in runs]}

    return B.best_of(one_rep, seconds, lambda r: r["other_load"], a.retries, a.max_wait, _log)


def prefill_measure(a, params, ids) -> dict:
    """Warm evicting prefill of `ids` + the first greedy token: first-call seconds, then the best timed."""
    import jax.numpy as jnp

    import vdjax

    t = time.perf_counter()
    cache, logits = vdjax.prefill(params, ids, a.policy, a.budget, a.block)
    int(jnp.argmax(logits[0]))
    first_s = time.perf_counter() - t
    nbytes = cache.nbytes()
    del cache, logits
    best = _best(a, lambda: B.timed_prefill(params, ids, a.policy, a.budget, a.block), lambda r: r["s"])
    return best | {"first_call_s": first_s, "cache_bytes": nbytes}


def decode_measure(a, params, ids) -> dict:
    """Warm greedy decode at batch 1 after `ids`: `a.new` tokens forced, tok/s over the decode steps."""
    import vdjax
    from vdjax.engine.timing import count_compiles

    kw = dict(block_size=a.block, max_new_tokens=a.new, min_new_tokens=a.new)
    t = time.perf_counter()
    vdjax.run(params, ids, a.policy, a.budget, **kw)  # compiles the prefill and decode programs
    first_s = time.perf_counter() - t

    def once() -> dict:
        """One timed `vdjax.run`."""
        with B.OtherLoad() as ol, count_compiles() as compiled:
            g = vdjax.run(params, ids, a.policy, a.budget, **kw)
        assert g.tokens.shape == (1, a.new), g.tokens.shape
        return {"tok_s": g.steps / g.decode_s, "decode_s": g.decode_s, "steps": g.steps,
                "ttft_s": g.prefill_s, "compiled": compiled.value, "other_load": ol.cores,
                "cache_bytes": g.cache.nbytes(), "slots": list(g.slots),
                "layer_budgets": None if g.layer_budgets is None else list(g.layer_budgets)}

    return _best(a, once, lambda r: r["decode_s"]) | {"first_call_s": first_s}


def worker(a) -> dict:
    """Everything measured for one policy: prefill per length, decode, cache bytes, peak RSS."""
    import jax
    import psutil

    import vdjax

    params = vdjax.load(a.model)
    out = {"policy": a.policy, "backend": jax.default_backend(), "jax": jax.__version__,
           "rss_load_mb": B.peak_rss_mb(), "rss_loaded_mb": psutil.Process().memory_info().rss / 2**20,
           "prefill": {}}
    tokens = np.load(a.tokens)
    for n in a.length_list:
        _log(f"  {a.policy}: prefill {n} ...")
        out["prefill"][str(n)] = prefill_measure(a, params, tokens[:n])
        _log(f"    {out['prefill'][str(n)]['tok_s']:.0f} tok/s")
    _log(f"  {a.policy}: decode after {a.prompt} ...")
    out["decode"] = decode_measure(a, params, tokens[:a.prompt][None])
    _log(f"    {out['decode']['tok_s']:.1f} tok/s")
    out["rss_peak_mb"] = B.peak_rss_mb()
    return out


def run_worker(a, policy: str, tok_file: Path) -> dict:
    """`worker` for `policy` in a fresh interpreter (same settings); its RESULT line, or {"error": ...}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--policy", policy, "--tokens",
           str(tok_file), "--model", a.model, "--lengths", ",".join(map(str, a.length_list)),
           "--prompt", str(a.prompt), "--new", str(a.new), "--budget", str(a.budget), "--block", str(a.block),
           "--reps", str(a.reps), "--retries", str(a.retries), "--max-wait", str(a.max_wait)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=os.environ.copy())
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        return {"policy": policy, "error": f"worker exited {proc.returncode}"}
    return json.loads(found[-1][7:]) | {"worker_s": time.perf_counter() - t}


# ---- the table -----------------------------------------------------------------------------------------
def _cell(x, base, fmt: str) -> str:
    """`x` formatted, with its ratio to the baseline's `base`."""
    if x is None:
        return "—"
    r = B.ratio(x, base)
    return f"{x:{fmt}}" + ("" if r is None else f" ({r:.2f}x)")


def _get(res: dict, *path):
    """res[path[0]][path[1]]... or None where missing (a failed worker)."""
    for p in path:
        if not isinstance(res, dict) or p not in res:
            return None
        res = res[p]
    return res


def table(a, results: dict[str, dict]) -> str:
    """One Markdown row per policy, every value with its ratio to the baseline's."""
    base = results.get(a.baseline, {})
    cols = [(f"prefill {B.klabel(n)} tok/s", ("prefill", str(n), "tok_s"), ",.0f") for n in a.length_list]
    dec = f"decode tok/s (batch 1, {B.klabel(a.prompt)} prompt, {a.new} new)"
    cols += [(dec, ("decode", "tok_s"), ",.1f"),
             ("cache MiB", ("decode", "cache_bytes"), ",.2f"), ("peak RSS MiB", ("rss_peak_mb",), ",.0f")]
    rows = []
    for pol, res in results.items():
        if "error" in res:
            rows.append([f"`{pol}`"] + [res["error"]] + [""] * (len(cols) + 1))
            continue
        row = [f"`{pol}`"]
        for _, path, fmt in cols:
            x, b = _get(res, *path), _get(base, *path)
            x = x / 2**20 if path[-1] == "cache_bytes" and x is not None else x
            b = b / 2**20 if path[-1] == "cache_bytes" and b is not None else b
            row.append(_cell(x, b, fmt))
        timed = list(res["prefill"].values()) + [res["decode"]]
        row += [f"{max(t['other_load'] for t in timed):.2f}", str(sum(t["compiled"] for t in timed))]
        rows.append(row)
    return B.md_table(["policy"] + [c[0] for c in cols] + ["max other load", "compiles in timed calls"], rows)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (the worker's hidden ones included)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated; the baseline (the ratios' base) is added first if missing")
    ap.add_argument("--baseline", default=BASELINE,
                    help=f"the policy every ratio is taken against (default {BASELINE}; e.g. streaming, the "
                         "cheapest, for the scorers' speed goal)")
    ap.add_argument("--lengths", help="prefill lengths (default 2048,8192; --quick 512)")
    ap.add_argument("--prompt", type=int, help="decode prompt length (default 2048; --quick 512)")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--new", type=int, help="decoded tokens (default 64; --quick 8)")
    ap.add_argument("--reps", type=int, help="timed calls per measurement, the fastest counts (default 3; "
                                             "--quick 2)")
    ap.add_argument("--retries", type=int, default=1,
                    help=f"measure again (keeping the fastest) when other processes used > {B.BUSY} cores")
    ap.add_argument("--max-wait", type=float, default=120.0,
                    help="seconds to wait for other processes to go idle before each policy and retry")
    ap.add_argument("--quick", action="store_true", help="smoke run: 512-token prompts, 8 new tokens")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "adaptive" / "bench.md"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    default = [512] if a.quick else [2048, 8192]
    a.length_list = [int(x) for x in a.lengths.split(",")] if a.lengths else default
    a.prompt = a.prompt or (512 if a.quick else 2048)
    a.new = a.new or (8 if a.quick else 64)
    a.reps = a.reps or (2 if a.quick else 3)
    return a


def main(argv=None) -> int:
    """Run the workers (or be one) and write the table and the raw numbers."""
    a = parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(worker(a)), flush=True)
        return 0
    import vdjax

    t_start = time.perf_counter()
    command = shlex.join([".venv/bin/python", os.path.relpath(Path(__file__).resolve(), Path.cwd())]
                         + sys.argv[1:])
    policies = [p for p in a.policies.split(",") if p]
    policies = [a.baseline] + [p for p in policies if p != a.baseline]
    ids, corpus_n = B.corpus_tokens(vdjax.load_tokenizer(a.model), max(a.length_list + [a.prompt]))
    tok_file = Path(tempfile.mkdtemp(prefix="vdadaptive-")) / "tokens.npy"
    np.save(tok_file, ids)
    results: dict[str, dict] = {}
    for pol in policies:
        _log(f"[{pol}] waiting for a quiet machine, then a fresh worker ...")
        B.wait_idle(a.max_wait, log=_log)
        results[pol] = run_worker(a, pol, tok_file)
        _log(f"[{pol}] done in {results[pol].get('worker_s', 0):.0f} s")
    tok_file.unlink()
    tok_file.parent.rmdir()
    first = next((r for r in results.values() if "error" not in r), {})
    lines = [
        f"# vdjax adaptive budgets: speed and memory — {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        "",
        f"- host: {platform.node()}, {B.cpu_model()}, {B.n_cores()} cores, "
        f"{B.mem_total_available_gb()[0]:.1f} GiB RAM; jax {first.get('jax', '?')} "
        f"(backend {first.get('backend', '?')})",
        f"- vdjax tree: {B.git_state()}",
        f"- command: `{command}`",
        f"- model `{a.model}` (fp32), N={a.budget}, B={a.block}; prompts: the first T tokens of CPython's "
        f"pydoc topics ({corpus_n} tokens{', repeated' if corpus_n < len(ids) else ''}); every policy in a "
        f"fresh process; warm, best of {a.reps} timed calls; (x) = ratio to `{a.baseline}` of this run",
        "",
        table(a, results),
        "",
        f"Prefill: T / seconds of `vdjax.prefill` + the first greedy token. Decode: `Generation.steps / "
        f"decode_s` of `vdjax.run` ({a.new} new tokens, `min_new_tokens={a.new}`). Cache MiB: "
        f"`Generation.cache.nbytes()` after that decode. Peak RSS: the worker's VmHWM (model loading, every "
        f"prefill length and the decode included). Max other load: cores other processes kept busy during "
        f"the kept timed calls (above {B.BUSY} the number is pessimistic). Total wall time "
        f"{(time.perf_counter() - t_start) / 60:.1f} min.",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    settings = {k: getattr(a, k) for k in ("model", "budget", "block", "length_list", "prompt", "new", "reps",
                                           "retries", "max_wait", "quick")}
    raw = {"command": command, "settings": settings, "host": platform.node(), "cores": B.n_cores(),
           "cpu": B.cpu_model(), "git": B.git_state(), "results": results}
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=B._jsonable))
    _log(f"wrote {out} and {out.with_suffix('.json')}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

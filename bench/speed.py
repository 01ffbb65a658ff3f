#!/usr/bin/env python
"""Where users feel speed: compile time per program, dense and short-prompt
prefill vs HF, decode vs its ceiling.

    VDJAX_CACHE=/tmp/vdcache .venv/bin/python bench/speed.py              # SmolLM2-135M fp32, ~8 min quiet
    .venv/bin/python bench/speed.py --sections compile,decode --out results/speed/speed.md

Sections (each a Markdown table, all measured in this one run, warm unless it says compile):
1. compile: seconds to compile the prefill + decode programs of one new (policy, budget, length bucket), per
   policy, in a fresh process with the persistent compile cache off (`vdjax.engine.timing.count_compiles` /
   `timed_run`'s compile spans).
2. prefill: dense and valuediff (N=512, B=128) prefill tok/s at 1k, 2k, 4k, 8k against one dense HF sdpa
   forward (`logits_to_keep=1`, torch on the same cores).
3. decode: valuediff N=512 greedy decode tok/s at batch 1, 4, 16 after a 1k prompt, against the
   weight-streaming ceiling rows x bandwidth / (weight bytes + KV bytes read per step), bandwidth measured
   here (jax.jit sum over 1 GiB), and against the matvec floor: one jitted program of nothing but the model's
   weight products for `batch` rows (every layer matrix and the LM head, no attention, no cache), i.e. what
   XLA's own dots reach on these shapes.
4. layer scan (with `--sections scan`, or in the default set): valuediff compile s, 2k prefill tok/s and
   batch-1 decode tok/s with the layers unrolled and with `layer_scan=True`, in this one run.
Uses only the public API, so the same script times an older checkout (run it from that checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import bench as B  # noqa: E402  (machine facts, corpus, HF wrapper, load measurement)

POLICIES = ("dense", "streaming", "tova", "snapkv", "keynorm", "keydiff", "valuediff")


def _params(model: str):
    import vdjax

    return vdjax.load(model)  # fp32 on CPU (the default, before and after dtype-from-checkpoint)


def _scan_kw(scan: bool) -> dict:
    """`layer_scan=True` where asked (older checkouts without the argument only run unrolled)."""
    return {"layer_scan": True} if scan else {}


def compile_worker(model: str, policy: str, length: int, budget: int, scan: bool) -> dict:
    """One policy's first call in a fresh process: compile seconds of prefill + decode (compile cache off),
    and the same call again warm (first call wall - warm wall is what compiling cost the user)."""
    import vdjax  # noqa: F401
    from vdjax.engine.timing import timed_run

    params = _params(model)
    tok = vdjax.load_tokenizer(model)
    ids, _ = B.corpus_tokens(tok, length)
    kw = dict(block_size=128, max_new_tokens=16, eos_token_id=[], **_scan_kw(scan))
    budget = None if policy == "dense" else budget
    t = time.perf_counter()
    compile_s = timed_run(params, ids, policy, budget, **kw)[3]
    wall = time.perf_counter() - t
    t = time.perf_counter()
    timed_run(params, ids, policy, budget, **kw)
    return {"policy": policy, "compile_s": compile_s, "wall_s": wall, "warm_s": time.perf_counter() - t}


_COMPILED: dict[tuple, dict | str] = {}  # (model, policy, scan) -> the worker's result: sections share it


def _compile_run(a, policy: str, scan: bool) -> dict | str:
    """`compile_worker` in a fresh process (once per model, policy and layer form in this run)."""
    key = (a.model, policy, scan)
    if key not in _COMPILED:
        cmd = [sys.executable, __file__, "--worker", "compile", "--model", a.model, "--policy", policy]
        proc = subprocess.run(cmd + (["--layer-scan"] if scan else []), capture_output=True, text=True,
                              env=os.environ | {"VDJAX_COMPILE_CACHE": "0"})
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        _COMPILED[key] = (json.loads(found[0][7:]) if found
                          else "failed: " + " | ".join(proc.stderr.strip().splitlines()[-2:]))
    return _COMPILED[key]


def compile_section(a) -> list[str]:
    rows = []
    modes = (False, True) if a.scan_modes == "both" else (a.scan_modes == "scan",)
    for policy in a.policies.split(","):
        row = [policy]
        for scan in modes:
            r = _compile_run(a, policy, scan)
            if isinstance(r, str):
                row += [r, ""]
                continue
            print(f"compile {policy} {'scan' if scan else 'unrolled'}: {r['compile_s']:.1f} s", flush=True)
            row += [f"{r['compile_s']:.1f}", f"{r['wall_s'] - r['warm_s']:.1f}"]
        rows.append(row)
    head = ["policy"]
    for scan in modes:
        m = "layer scan" if scan else "unrolled"
        head += [f"{m}: compile s", f"{m}: first - warm call s"]
    return ["## 1. Compile seconds of a new (policy, N=512, 2k bucket): prefill + decode programs, cold "
            "(target <= 5)", "", B.md_table(head, rows)]


def _best(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def prefill_section(a, params, tok, hf) -> list[str]:
    import jax.numpy as jnp

    import vdjax

    rows = []
    for n in [int(x) for x in a.lengths.split(",")]:
        ids, _ = B.corpus_tokens(tok, n)
        out = {}
        for policy, budget in (("dense", None), ("valuediff", a.budget)):
            def go(policy=policy, budget=budget, ids=ids):
                _, logits = vdjax.prefill(params, ids, policy, budget, 128)
                int(jnp.argmax(logits[0]))
            go()  # compile
            out[policy] = n / _best(go, 2 if n > 4096 else 3)
        hf_s = min(hf.forward_s("sdpa", ids)[0] for _ in range(2 if n > 4096 else 3))
        out["hf"] = n / hf_s
        print(f"prefill {n}: dense {out['dense']:.0f}, valuediff {out['valuediff']:.0f}, "
              f"HF {out['hf']:.0f} tok/s", flush=True)
        rows.append([n, f"{out['dense']:.0f}", f"{out['valuediff']:.0f}", f"{out['hf']:.0f}",
                     f"{out['dense'] / out['hf']:.2f}", f"{out['valuediff'] / out['hf']:.2f}"])
    return ["## 2. Prefill tok/s (warm, best of 2-3): vdjax dense and valuediff N=512 B=128 vs one HF sdpa "
            "forward",
            "", B.md_table(["T", "vdjax dense", "vdjax valuediff", "HF sdpa", "dense / HF (target >= 1.0)",
                            "valuediff / HF (target >= 0.9 at 1k-2k)"], rows)]


def bandwidth_gbs() -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.ones(2**28, jnp.float32)
    s = jax.jit(jnp.sum)
    s(x).block_until_ready()
    return x.nbytes / _best(lambda: s(x).block_until_ready(), 5) / 1e9


def _matrix(w):
    """A weight as the [in, out] matrix its product reads: [H, n, d] -> [H, n*d], [n, d, H] -> [n*d, H]."""
    if w.ndim == 3 and w.shape[0] < w.shape[-1]:
        return w.reshape(-1, w.shape[-1])
    return w.reshape(w.shape[0], -1)


def matvec_floor_s(params, rows: int) -> float:
    """Seconds of one program doing only the model's weight products for `rows` tokens: every >= 2-D layer
    weight once ([rows, in] @ [in, out], MoE expert stacks whole) and the LM head, no attention or cache. A
    layer's products run side by side, each layer waits for the one below (a real layer has 3-4 such stages,
    so this is a floor, not a target)."""
    import jax
    import jax.numpy as jnp

    layers = [[_matrix(w) for w in jax.tree.leaves(lw) if w.ndim >= 2] for lw in params.weights["layers"]]
    head = params.weights.get("lm_head", params.weights["embed"])  # [V, H]
    # real inputs as arguments: a product with constant ones folds into a reduce
    rng = np.random.default_rng(0)
    xs = {d: jnp.asarray(rng.standard_normal((rows, d)), head.dtype)
          for d in {m.shape[0] for ms in layers for m in ms} | {head.shape[1]}}

    @jax.jit
    def step(layers, head, xs):
        tot = jnp.zeros((), jnp.float32)
        for ms in layers:
            tot = tot + sum(jnp.sum((xs[m.shape[0]] + tot * 1e-30) @ m) for m in ms)
        return tot + jnp.sum(jnp.einsum("bh,vh->bv", xs[head.shape[1]] + tot * 1e-30, head))

    step(layers, head, xs).block_until_ready()
    return _best(lambda: step(layers, head, xs).block_until_ready(), 5)


def decode_section(a, params, tok) -> list[str]:
    import vdjax

    bw = bandwidth_gbs()
    weights = params.nbytes()
    rows = []
    for batch in [int(x) for x in a.batches.split(",")]:
        ids = np.stack([B.corpus_tokens(tok, 1024 * (i + 1))[0][-1024:] for i in range(batch)])
        kw = dict(block_size=128, max_new_tokens=64, eos_token_id=[])
        vdjax.run(params, ids, "valuediff", a.budget, **kw)  # compile
        best = None
        for _ in range(2):
            g = vdjax.run(params, ids, "valuediff", a.budget, **kw)
            best = g if best is None or g.decode_s < best.decode_s else best
        kv = sum(lc.k.nbytes + lc.v.nbytes for lc in (best.cache[i] for i in best.cache.attention_layers))
        ceil = batch * bw * 1e9 / (weights + kv)
        floor = batch / matvec_floor_s(params, batch)
        got = batch * best.steps / best.decode_s
        print(f"decode batch {batch}: {got:.1f} tok/s, ceiling {ceil:.1f}, matvec floor {floor:.1f}",
              flush=True)
        rows.append([batch, f"{got:.1f}", f"{ceil:.1f}", f"{got / ceil:.2f}", f"{floor:.1f}",
                     f"{got / floor:.2f}"])
    return [f"## 3. Decode tok/s, valuediff N={a.budget}, 1k prompt, 63 steps (bandwidth {bw:.1f} GB/s "
            f"measured, weights {weights / 2**20:.0f} MiB)", "",
            B.md_table(["batch", "vdjax tok/s", "ceiling tok/s", "/ ceiling (target >= 0.8 at batch 1)",
                        "matvec floor tok/s", "/ matvec floor"], rows)]


def scan_section(a, params, tok) -> list[str]:
    """valuediff with the layers unrolled vs `layer_scan=True`: compile (fresh
    process), 2k prefill, decode."""
    import vdjax

    ids, _ = B.corpus_tokens(tok, 2048)
    one, _ = B.corpus_tokens(tok, 1024)
    rows = []
    for scan in (False, True):
        c = _compile_run(a, "valuediff", scan)
        comp = c if isinstance(c, str) else f"{c['compile_s']:.1f}"
        kw = _scan_kw(scan)

        def go(kw=kw):
            _, logits = vdjax.prefill(params, ids, "valuediff", a.budget, 128, **kw)
            logits.block_until_ready()
        go()
        pre = len(ids) / _best(go, 3)
        dkw = dict(block_size=128, max_new_tokens=64, eos_token_id=[], **kw)
        vdjax.run(params, one, "valuediff", a.budget, **dkw)  # compile
        dec = max(g.steps / g.decode_s for g in (vdjax.run(params, one, "valuediff", a.budget, **dkw)
                                                  for _ in range(2)))
        print(f"{'scan' if scan else 'unrolled'}: compile {comp} s, prefill {pre:.0f} tok/s, "
              f"decode {dec:.1f}", flush=True)
        rows.append(["layer scan" if scan else "unrolled", comp, f"{pre:.0f}", f"{dec:.1f}"])
    return [f"## 4. Layer scan on this backend: valuediff N={a.budget} (compile cold in a fresh process; "
            "prefill 2k warm best of 3; decode batch 1 after 1k, best of 2)", "",
            B.md_table(["layers", "compile s", "prefill tok/s", "decode tok/s"], rows)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sections", default="compile,prefill,decode,scan")
    ap.add_argument("--scan-modes", default="both", choices=("both", "unrolled", "scan"),
                    help="compile section: layers unrolled, scanned or both (an older checkout: unrolled)")
    ap.add_argument("--layer-scan", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT.parent / "results" / "speed" / "speed.md"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "compile":
        print("RESULT " + json.dumps(compile_worker(a.model, a.policy, 2048, a.budget, a.layer_scan)))
        return 0
    import vdjax
    from vdjax.loading import registry

    sections = a.sections.split(",")
    lines = [f"# vdjax speed ({B.git_state()}; {B.cpu_model()}, {B.n_cores()} cores; {a.model} fp32)", ""]
    if "compile" in sections:
        lines += compile_section(a) + [""]
    params, tok = _params(a.model), vdjax.load_tokenizer(a.model)
    if "prefill" in sections:
        hf = B.HF(registry.resolve(a.model), B.n_cores())
        lines += prefill_section(a, params, tok, hf) + [""]
        hf.drop("sdpa")
    if "decode" in sections:
        lines += decode_section(a, params, tok) + [""]
    if "scan" in sections:
        lines += scan_section(a, params, tok) + [""]
    text = "\n".join(lines)
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

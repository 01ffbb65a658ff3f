#!/usr/bin/env python
"""A quantized cache against the unquantized one (issue 49): prefill and decode speed, cache bytes, peak RSS.

    .venv/bin/python bench/quant.py --out results/bytes/bench.md      # SmolLM2-135M fp32, 8k prompt, ~14 min

One fresh process per `kv_quant` (None, int8, int4, int4-smooth; `--group` channels per scale), each timing,
warm (the same call run once before to compile it; `vdjax.engine.timing.timed_run` takes any compile time
out), for valuediff at N = `--budget` and for dense: an 8k-token prompt of real text (bench.py's corpus)
prefilled in blocks of 128, then 64 greedy tokens (EOS off). `prefill tok/s` = T / time to first token;
`decode tok/s` = 63 steps / decode seconds; `cache MiB` = `Generation.cache_bytes` (what the carry holds:
packed integers and scales, or the compute dtype's keys and values); `dense fp32 MiB` = every token's keys and
values unquantized in the compute dtype (`Generation.dense_cache_bytes`); `peak RSS` = the process's
high-water mark (VmHWM: loading, compiling and both policies). On CPU the dequantization before attention is
extra work, measured here; on an accelerator decode streams the cache from HBM, so its bytes read per step
shrink with the cache (the `decode bytes/step` column: weights + this cache, the roofline's count).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import bench as B  # noqa: E402  (machine facts, corpus, RSS, formatting)

QUANTS = (None, "int8", "int4", "int4-smooth")


def worker(a) -> dict:
    """One kv_quant in this fresh process: warm prefill + decode of valuediff (N) and dense; peak RSS."""
    B._jax_setup()
    import vdjax
    from vdjax.engine.timing import timed_run

    params, tok = vdjax.load(a.model), vdjax.load_tokenizer(a.model)
    ids, _ = B.corpus_tokens(tok, a.tokens)
    q = None if a.kv_quant == "none" else a.kv_quant
    kw = dict(block_size=128, max_new_tokens=a.new, eos_token_id=[], kv_quant=q,
              kv_group=None if q is None else a.group)
    weight_bytes = params.nbytes()
    out = {"kv_quant": q, "rows": []}
    for policy, budget in (("valuediff", a.budget), ("dense", None)):
        timed_run(params, ids, policy, budget, **kw)  # compiles
        with B.OtherLoad() as ol:
            gen, ttft, dec, comp = timed_run(params, ids, policy, budget, **kw)
        steps = a.new - 1
        out["rows"].append({"policy": policy, "N": budget, "T": int(ids.shape[-1]), "ttft_s": ttft,
                            "decode_s": dec, "prefill_tok_s": ids.shape[-1] / ttft,
                            "decode_tok_s": steps / dec,
                            "cache_bytes": int(gen.cache_bytes), "dense_bytes": int(gen.dense_cache_bytes),
                            "compile_s_in_timed": comp, "other_load": ol.cores,
                            "weight_bytes": weight_bytes})
    out["peak_rss_mb"] = B.peak_rss_mb()
    return out


def main(argv=None) -> None:
    """Run one worker per kv_quant, print and write the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT.parent / "results" / "bytes" / "bench.md"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--kv-quant", default="none", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return
    results = []
    for q in QUANTS:
        cmd = [sys.executable, __file__, "--worker", "1", "--kv-quant", str(q).lower(), "--model", a.model,
               "--tokens", str(a.tokens), "--new", str(a.new), "--budget", str(a.budget),
               "--group", str(a.group)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"worker kv_quant={q} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"kv_quant={q}: {time.perf_counter() - t0:.0f} s", flush=True)
    base = {r["policy"]: r for r in results[0]["rows"]}
    rows = []
    for res in results:
        for r in res["rows"]:
            b = base[r["policy"]]
            step_bytes = r["weight_bytes"] + r["cache_bytes"]
            name = r["policy"] + ("" if r["N"] is None else f" N={r['N']}")
            rows.append([name, res["kv_quant"] or "none (fp32)",
                         B.f1(r["prefill_tok_s"]), B.fx(r["prefill_tok_s"] / b["prefill_tok_s"]),
                         B.f1(r["decode_tok_s"]), B.fx(r["decode_tok_s"] / b["decode_tok_s"]),
                         B.f1(r["cache_bytes"] / 2**20, 2), B.f1(r["dense_bytes"] / 2**20, 2),
                         B.fx(r["cache_bytes"] / b["cache_bytes"], 3), B.f1(step_bytes / 2**20, 1),
                         B.f1(res["peak_rss_mb"], 0), B.f1(r["other_load"], 2)])
    head = ["policy", "kv_quant", "prefill tok/s", "vs none", "decode tok/s", "vs none", "cache MiB",
            "dense fp32 MiB", "cache vs none", "decode bytes/step MiB", "peak RSS MiB", "other load"]
    text = (f"# Quantized cache vs unquantized (bench/quant.py, {a.model} fp32 weights)\n\n"
            f"T = {a.tokens} tokens of real text, B = 128, {a.new} new tokens ({a.new - 1} decode steps), "
            f"groups of {a.group} channels, bf16 scales; host: {B.cpu_model()}, {B.n_cores()} cores; "
            f"{B.git_state()}.\n\n" + B.md_table(head, rows)
            + "\n\nCommand: `.venv/bin/python bench/quant.py "
            f"--tokens {a.tokens} --budget {a.budget} --group {a.group} --out {a.out}`\n")
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    Path(a.out).with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

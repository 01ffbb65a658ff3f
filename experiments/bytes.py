"""The equal-bytes frontier (issue 49): eviction composed with a quantized cache on RULER 2048 (13 tasks x 10
samples, seed 42: the leaderboard's samples), paper protocol, B = 128, batch 10, greedy, both real models.

A cache of N slots at `kv_quant` q with per-token groups of g channels holds N * (bytes of one token at q) of
keys and values per KV head: bf16 128 B a token per tensor at D = 64, int8 g64 68 B, int4 g64 36 B
(`vdjax.engine.quant.bytes_per_token`, the same count as `Generation.cache_bytes`). Against a dense bf16 cache
of the 2048-token prompt: 25 % of the bytes is bf16 N = 512, int8 N = 1024 (26.6 % with g64), int4 N = 2048
(28.1 %); 12.5 % is int8 N = 512 (13.3 %), int4 N = 1024 (14.1 %). Every RULER 2048 prompt here has T + new
<= 2036 tokens, so int4 N = 2048 evicts nothing: that row is dense at int4, run once (`dense`).

Jobs run in the order of JOBS (the moonshot's candidates first), each one `evaluate` call into
`--out`/ruler/<model>/paper/L2048-<q>-g<g>/predictions.jsonl; rerun to resume (finished lines are skipped):

    nice -n 19 .venv/bin/python experiments/bytes.py --out results/bytes

The bf16 rows are the leaderboard's (results/leaderboard); `experiments/bytes_report.py` writes the table and
the figure from both.
"""

import argparse
import time
from pathlib import Path

import vdjax
from vdjax.eval.runner import evaluate

RESULTS = Path(__file__).resolve().parent.parent / "results"
MIXES = RESULTS / "thesis-hybrid-ruler"  # the hybrid's RULER-selected mixes (N = 512, N = 1024)
GROUP = 64  # channels per scale for both models (SmolLM2's head dim; a quarter of Gemma3's)
BEST = {"smollm2-135m": ("hybrid", "chunkkv:hybrid", "compactor"),  # the leaderboard's best three at N = 512
        "gemma3-270m": ("chunkkv:hybrid", "kvzip", "valuediff_dir")}
MODELS = ("gemma3-270m", "smollm2-135m")
EXACT_25 = 1816  # int4-smooth g64 slots at 25 % of a dense bf16 2048-token cache, D = 64 and 256 (asserted)


def jobs() -> list[tuple[str, str, str, int | None]]:
    """(model, policy, kv_quant, N) in run order: dense and each model's best policy at N = 1024 with smooth
    int4 keys, dense at int4 (= every policy at int4 N = 2048),
    each model's best policy at int8 N = 1024, the best at 12.5 % of the bytes, the best at exactly 25 % with
    int4-smooth and with int4-smooth-rot, the other policies, dense at int8, dense at int4-smooth-rot."""
    best = {m: BEST[m][0] if m == "smollm2-135m" else "chunkkv:hybrid" for m in MODELS}
    # smooth int4 keys (fixed channel centre and factor + Hadamard rotation) first: the moonshot's lever
    out = [(m, "dense", "int4-smooth", None) for m in MODELS]
    out += [(m, best[m], "int4-smooth", 1024) for m in MODELS]
    out += [(m, "dense", "int4", None) for m in MODELS]
    out += [(m, best[m], "int8", 1024) for m in MODELS]
    out += [(m, best[m], q, n) for q, n in (("int4", 1024), ("int8", 512)) for m in MODELS]
    # exactly 25 % of the bytes: int4-smooth N = 1816 (`slots_for_bytes(0.25, 2048, D, "int4-smooth", 64)`)
    out += [(m, best[m], "int4-smooth", EXACT_25) for m in MODELS]
    # the same bytes, values Hadamard-rotated too (the next lever in results/bytes/layout*.md)
    out += [(m, best[m], "int4-smooth-rot", EXACT_25) for m in MODELS]
    rest = {m: [p for p in (*BEST[m], "valuediff", "keydiff") if p != best[m]] for m in MODELS}
    for i in range(max(len(r) for r in rest.values())):
        out += [(m, rest[m][i], "int8", 1024) for m in MODELS if i < len(rest[m])]
    out += [(m, "dense", "int8", None) for m in MODELS]
    for q, n in (("int4", 1024), ("int8", 512)):
        for i in range(max(len(r) for r in rest.values())):
            out += [(m, rest[m][i], q, n) for m in MODELS if i < len(rest[m])]
    out += [(m, "dense", "int4-smooth-rot", None) for m in MODELS]
    return out


def kwargs_for(policy: str, model: str, budget: int | None) -> dict:
    """The hybrid's mix selected on RULER at the nearest budget it was selected for (512 or 1024)."""
    if budget is None or policy.split(":")[-1] != "hybrid":
        return {}
    return {"mix": str(MIXES / f"{model}-mix-N{512 if budget <= 512 else 1024}.json")}


def main() -> None:
    """Run the jobs (or the first `--limit`) in order, resumably, printing each one's wall time."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "bytes"))
    ap.add_argument("--only", help="comma-separated models")
    ap.add_argument("--list", action="store_true", help="print the jobs and exit")
    args = ap.parse_args()
    todo = [j for j in jobs() if args.only is None or j[0] in args.only.split(",")]
    if args.list:
        for j in todo:
            print(*j)
        return
    from vdjax.engine.quant import slots_for_bytes

    assert all(slots_for_bytes(0.25, 2048, d, q, GROUP) == EXACT_25 for d in (64, 256)
               for q in ("int4-smooth", "int4-smooth-rot"))
    loaded: dict = {}
    for model, policy, q, n in todo:
        if model not in loaded:
            loaded = {model: (vdjax.load(model), vdjax.load_tokenizer(model))}
        params, tok = loaded[model]
        t0 = time.perf_counter()
        evaluate(params, tok, "ruler", model_name=model, policies=[policy],
                 budgets=None if n is None else [n], length=2048, num_samples=10, seed=42, out_dir=args.out,
                 block_size=128, batch_size=10, policy_kwargs={policy: kwargs_for(policy, model, n)},
                 progress=False, kv_quant=q, kv_group=GROUP)
        print(f"{model} {policy} {q} N={n}: {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()

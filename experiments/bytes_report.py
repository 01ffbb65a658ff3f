"""The equal-bytes frontier's table and figure (issue 49) from the prediction lines: the quantized rows of
experiments/bytes.py (`results/bytes/ruler/<model>/paper/L2048-<q>-g<g>/`) beside the bf16 rows of the
leaderboard (`experiments/leaderboard_table.collect`: the same samples, seed 42, B = 128, paper protocol).

    .venv/bin/python experiments/bytes_report.py --out results/bytes/FRONTIER.md \
        --figure results/bytes/frontier.png

Score: RULER's mean over tasks of each task's mean, in points; % of dense: against dense bf16 over the same
tasks. A row with fewer than 13 finished tasks is marked partial (its tasks named) and drawn hollow. Bytes:
the row's keys and values, N slots per head, as a % of a dense bf16 cache of 2048 tokens
(`vdjax.engine.quant.bytes_per_token`, what `Generation.cache_bytes` counts: codes + bf16 scale and zero per
group); dense at q holds every token (T + new <= 2036 < 2048), counted at 2048.
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import leaderboard_table as lt  # noqa: E402

from vdjax.engine.quant import bytes_per_token, calibration_bytes, kv_quant_bits  # noqa: E402
from vdjax.eval.report import paired_difference  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "results"
HEAD_DIM = {"smollm2-135m": 64, "gemma3-270m": 256}
GROUP = 64
TASKS = 13
BF16 = {"hybrid": lt.HYBRID, "chunkkv:hybrid": "chunkkv:hybrid (moonshot)"}  # policy -> leaderboard label


def fraction(model: str, q: str | None, n: int | None) -> float:
    """Bytes of N slots at q as a fraction of a dense bf16 cache of 2048 tokens (a -smooth q: plus its keys'
    centre and factor, bf16 [D] each per head)."""
    d = HEAD_DIM[model]
    bits = kv_quant_bits(q)
    per = bytes_per_token(d, bits, None if bits is None else GROUP)
    return ((n or 2048) * 2 * per + calibration_bytes(d, q)) / (2048 * 2 * bytes_per_token(d, None))


def by_task(records) -> dict[str, list[float]]:
    """{task: [score, ...]} of an iterable of records."""
    out = defaultdict(list)
    for r in records:
        out[r["task"]].append(r["score"])
    return out


def rows(model: str) -> list[dict]:
    """Every row of `model`: bf16 from the leaderboard (N = 512, 1024), quantized from results/bytes."""
    groups: dict[tuple, list] = {}
    for n in (512, 1024):
        for label, src in lt.collect(ROOT, model, n).items():
            policy = {v: k for k, v in BF16.items()}.get(label, label)
            groups[(policy, None, None if policy == "dense" else n)] = list(src.records.values())
    for folder in sorted((ROOT / "bytes" / "ruler" / model / "paper").glob("L2048-*")):
        q = folder.name.split("-", 1)[1].rsplit("-g", 1)[0]  # L2048-<q>-g<g>, q may hold a dash
        for r in lt.read_lines(folder / "predictions.jsonl"):
            groups.setdefault((r["policy"], q, r["budget"]), []).append(r)
    dense = {t: sum(v) / len(v) for t, v in by_task(groups[("dense", None, None)]).items()}
    out = []
    for (policy, q, n), recs in groups.items():
        tasks = {t: v for t, v in by_task(recs).items() if len(v) == 10}
        if not tasks:
            continue
        score = 100 * sum(sum(v) / len(v) for v in tasks.values()) / len(tasks)
        ref = 100 * sum(dense[t] for t in tasks) / len(tasks)
        out.append({"model": model, "policy": policy, "kv_quant": q or "bf16", "N": n,
                    "bytes": 100 * fraction(model, q, n), "score": score, "retention": 100 * score / ref,
                    "tasks": sorted(tasks), "lines": len(recs),
                    "samples": {t: {r["sample_id"]: r["score"] for r in recs if r["task"] == t}
                                for t in tasks},
                    "commits": sorted({str(r.get("vdjax_commit", ""))[:7] for r in recs})})
    for r in out:  # the cost of quantizing (same policy, same N) and the gain at equal bytes (bf16 N = 512)
        for key, n in (("vs_same_n", r["N"]), ("vs_bf16_512", 512)):
            ref = next((b for b in out if b["kv_quant"] == "bf16" and b["policy"] == r["policy"]
                        and b["N"] == (None if r["policy"] == "dense" else n)), None)
            skip = r["kv_quant"] == "bf16" or ref is None or (key == "vs_bf16_512" and r["N"] is None)
            r[key] = None if skip else paired_difference(r["samples"], ref["samples"])
    return out


def _diff(d) -> str:
    """A paired difference in points with its bootstrap 95 % interval, or a dash."""
    return "–" if d is None else f"{d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]"


BEST = {"smollm2-135m": "hybrid", "gemma3-270m": "chunkkv:hybrid"}  # each model's best row at N = 512
WANTED = {"smollm2-135m": ("dense", "hybrid", "chunkkv:hybrid", "compactor", "valuediff", "keydiff"),
          "gemma3-270m": ("dense", "chunkkv:hybrid", "kvzip", "valuediff_dir", "valuediff", "keydiff")}


def markdown(all_rows: list[dict]) -> str:
    """One table per model: the issue's rows (its policies, its budgets), sorted by bytes then retention."""
    text = ["# The equal-bytes frontier (issue 49): RULER 2048, eviction x quantized cache", "",
            "13 tasks x 10 samples (seed 42, the leaderboard's), paper protocol, B = 128, batch 10, greedy; "
            f"int8 / int4 with per-token groups of {GROUP} channels, bf16 scale and zero per group "
            "(int4-smooth: keys centred and divided by fixed per-channel factors calibrated on each head's "
            "first block, Hadamard-rotated, then the same groups; values as int4; int4-smooth-rot: the same "
            "keys, values Hadamard-rotated before their groups, the same bytes); the "
            "hybrid's mix: results/thesis-hybrid-ruler's at N = 512, its N = 1024 mix for N >= 1024. "
            "bytes: % of a dense bf16 cache of 2048 tokens. % of dense: of dense bf16 over the row's "
            "finished tasks. Differences: score points, quantized row minus the bf16 row of the same policy "
            "at the same N (the cost of the quantization) and at N = 512 (the gain at about equal bytes), "
            "paired on the shared samples, bootstrap 95 % interval with samples resampled within each task "
            "(`vdjax.eval.report.paired_difference`).", ""]
    for model in WANTED:
        mine = [r for r in all_rows if r["model"] == model and r["policy"] in WANTED[model]
                and not (r["kv_quant"] == "bf16" and r["N"] not in (None, 512, 1024))]
        mine.sort(key=lambda r: (r["bytes"], -r["retention"]))
        text += [f"## {model}", "", "| bytes % | cache | N | policy | score | % of dense | vs bf16 same N "
                 "| vs bf16 N = 512 | tasks | commits |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            done = "13" if len(r["tasks"]) == TASKS else f"partial {len(r['tasks'])}: {', '.join(r['tasks'])}"
            text.append(f"| {r['bytes']:.1f} | {r['kv_quant']} | {r['N'] or 'all'} | {r['policy']} | "
                        f"{r['score']:.1f} | {r['retention']:.1f} % | {_diff(r['vs_same_n'])} | "
                        f"{_diff(r['vs_bf16_512'])} | {done} | {', '.join(r['commits'])} |")
        text.append("")
    return "\n".join(text)


def figure(all_rows: list[dict], path: Path) -> None:
    """Retention vs bytes, a panel per model, a curve per precision (the model's best policy, and dense)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colors = {"bf16": "tab:blue", "int8": "tab:orange", "int4": "tab:green", "int4-smooth": "tab:red",
              "int4-smooth-rot": "tab:purple"}
    for ax, model in zip(axes, WANTED, strict=True):
        for q, c in colors.items():
            for policy, marker in ((BEST[model], "o"), ("dense", "*")):
                pts = sorted((r["bytes"], r["retention"], len(r["tasks"]) == TASKS) for r in all_rows
                             if r["model"] == model and r["kv_quant"] == q and r["policy"] == policy)
                if not pts:
                    continue
                ls = "-" if marker == "o" else ":"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c, lw=1, ls=ls)
                for x, y, full in pts:
                    ax.scatter([x], [y], marker=marker, s=60, color=c if full else "white", edgecolors=c,
                               zorder=3)
                ax.plot([], [], color=c, marker=marker, ls=ls, label=f"{policy} {q}")
        ax.axhline(90, color="grey", lw=0.6, ls="--")
        ax.set_title(model)
        ax.set_xlabel("cache bytes, % of dense bf16 (2048 tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("RULER 2048, % of dense bf16")
    fig.suptitle(f"Eviction x quantization at equal bytes (seed 42, 13 tasks x 10; groups of {GROUP}; "
                 "hollow = partial)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    """Write the table (and the figure) and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bytes" / "FRONTIER.md"))
    ap.add_argument("--figure", default=str(ROOT / "bytes" / "frontier.png"))
    ap.add_argument("--json", help="also write every row as JSON")
    a = ap.parse_args()
    all_rows = [r for m in WANTED for r in rows(m)]
    text = markdown(all_rows)
    Path(a.out).write_text(text + "\n")
    figure(all_rows, Path(a.figure))
    if a.json:
        Path(a.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "samples"} for r in all_rows],
                                           indent=1))
    print(text)


if __name__ == "__main__":
    main()

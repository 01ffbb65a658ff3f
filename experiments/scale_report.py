"""results/scale/README.md and memory.png from results/scale/runs.jsonl (experiments/scale.py's runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from scale import BUDGET, FAR, LENGTHS, MODELS, OUT, POLICIES, SLICES, TABLE9  # noqa: E402

from vdjax.engine.roofline import CHIPS  # noqa: E402

GiB = 2**30


def runs() -> dict:
    """{(model, slice, policy, length): report}."""
    path = OUT / "runs.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x] if path.is_file() else []
    return {(r["model"], r["topology"], r["policy"], r["length"]): r for r in lines}


def cell(r: dict | None) -> str:
    """Per-chip peak in GiB, marked when it does not fit."""
    if r is None:
        return "–"
    g = f"{r['peak_bytes_per_chip'] / GiB:.1f}"
    return g if r["fits"] else f"**{g}** ✗"


def k(n: int) -> str:
    return f"{n // 1024}k" if n < 1 << 20 else f"{n >> 20}M"


def h100_ttft(r: dict) -> float:
    """The same single-chip analytic counts at an H100's published figures."""
    p = r["programs"]["prefill"]
    h = CHIPS["h100"]
    return max(p["flops"] / h.flops, p["bytes_accessed"] / h.hbm_bandwidth)


def longest_fit(rs: dict, m: str, s: str) -> str:
    fits = [n for (mm, ss, p, n), r in rs.items() if (mm, ss, p) == (m, s, "dense") and r["fits"]]
    fails = [n for (mm, ss, p, n), r in rs.items() if (mm, ss, p) == (m, s, "dense") and not r["fits"]]
    if not fits and not fails:
        return "–"
    best = max(fits, default=0)
    above = min((n for n in fails if n > best), default=None)
    if not fits:
        return f"< {k(min(fails))}"
    return k(best) + ("" if above is None else f" (not {k(above)})")


def table(rs: dict) -> list[str]:
    head = ["| model | slice (mesh) | " + " | ".join(f"dense {k(n)}" for n in LENGTHS) + " | "
            + " | ".join(f"valuediff {k(n)}" for n in LENGTHS) + " | snapkv 128k | kvzip 128k | "
            "longest dense prompt | valuediff at 1M |",
            "|---|---|" + "---|" * (2 * len(LENGTHS) + 5)]
    for m in MODELS:
        for s, mesh, b in SLICES:
            row = [m, f"{s} ({mesh[0]}x{mesh[1]}{', batch ' + str(b) if b > 1 else ''})"]
            row += [cell(rs.get((m, s, "dense", n))) for n in LENGTHS]
            row += [cell(rs.get((m, s, "valuediff", n))) for n in LENGTHS]
            row += [cell(rs.get((m, s, p, 131072))) for p in ("snapkv", "kvzip")]
            row += [longest_fit(rs, m, s), cell(rs.get((m, s, "valuediff", FAR)))]
            head.append("| " + " | ".join(row) + " |")
    return head


def speed(rs: dict) -> list[str]:
    out = ["| model | slice | policy | TTFT roofline 128k (s) | decode GB/step/chip | decode ms/step "
           "roofline | prefill compile (s) | decode compile (s) |", "|---|---|---|---|---|---|---|---|"]
    for m in MODELS:
        for s, _, _ in SLICES:
            for p in POLICIES:
                r = rs.get((m, s, p, 131072))
                if r is None:
                    continue
                pre, dec = r["programs"]["prefill"], r["programs"]["decode"]
                out.append(f"| {m} | {s} | {p} | {pre['roofline_s']:.2f} | "
                           f"{dec['bytes_per_step'] / 1e9:.2f} | {dec['roofline_s_per_step'] * 1e3:.1f} | "
                           f"{pre['compile_s']} | {dec['compile_s']} |")
    return out


def table9(rs: dict) -> list[str]:
    out = ["| model, prompt | policy | paper Table 9 TTFT, H100 (measured) | roofline TTFT, H100 figures | "
           "roofline TTFT, v5e-1 | v5e-1 per-chip peak |", "|---|---|---|---|---|---|"]
    for (m, n), paper in TABLE9.items():
        for p, t in paper.items():
            r = rs.get((m, "v5e-1", p, n))
            if r is None:
                out.append(f"| {m}, {k(n)} | {p} | {t} | – | – | – |")
                continue
            out.append(f"| {m}, {k(n)} | {p} | {t} | {h100_ttft(r):.2f} | "
                       f"{r['programs']['prefill']['roofline_s']:.2f} | {cell(r)} |")
    return out


def figure(rs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(4 * len(MODELS), 3.4), sharey=False)
    for ax, m in zip(axes, MODELS, strict=True):
        for p, style in (("dense", "-o"), ("valuediff", "-s"), ("snapkv", "--^"), ("kvzip", ":x")):
            pts = sorted((n, r["peak_bytes_per_chip"] / GiB) for (mm, s, pp, n), r in rs.items()
                         if (mm, s, pp) == (m, "v5e:2x2", p))
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=p, ms=4)
        ax.axhline(CHIPS["v5e"].hbm_bytes / GiB, color="k", lw=0.8, ls="--", label="v5e HBM")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{m}, v5e:2x2 (1x4)")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("XLA peak GiB per chip")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "memory.png", dpi=120)


def main() -> None:
    rs = runs()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    total = len(MODELS) * len(SLICES) * (2 * len(LENGTHS) + 2)
    text = [
        "# Will it fit, and how fast at best? — prefill + decode compiled for TPU slices on a CPU",
        "",
        f"`experiments/scale.py` (commit {commit}; {len(rs)} compiled calls recorded, the main table has "
        f"{total} cells): the real `prefill_program` and `decode_program` of each call, compiled by "
        "`vdjax.engine.aot` for the TPU slice with libtpu 0.0.42.1 (jax 0.10.2) from the public config alone "
        "(tests/data/configs, bf16 weights abstract, layer scan on), block 128, batch 1 (2 on the 2x8 mesh), "
        f"256 new tokens, N = {BUDGET} for the evicting policies. Memory is XLA's own per-chip figure "
        "(`memory_analysis()`: arguments + outputs − donated + temporaries; where XLA:TPU refused to "
        "compile for lack of HBM, the total it named); times are **roofline estimates** (analytic flops and "
        "HBM bytes per chip over published peak FLOP/s and bandwidth, `vdjax/engine/roofline.py`), never "
        "measurements.",
        "",
        "    JAX_PLATFORMS=cpu nice .venv/bin/python experiments/scale.py  # resumable: appends runs.jsonl",
        "    vdjax aot --model tests/data/configs/qwen3-8b --topology v5e:2x2 --mesh 1x4 --length 131072 \\",
        "        --policy valuediff --budget 2048 --json out.json                # one cell",
        "",
        "## Per-chip peak memory (GiB; ✗ = does not fit: v5e 16 GB = 14.9 GiB, v6e 32 GB = 29.8 GiB)",
        "",
        *table(rs),
        "",
        "Dense grows with the prompt (its cache holds every token); every evicting policy's peak is flat "
        "(the cache is N slots whatever the prompt: only the int32 token ids grow), up to 1M tokens. "
        "\"longest dense prompt\": the largest padded length (block x length bucket) whose prefill and "
        "decode both fit, found by compiling (binary search).",
        "",
        "![per-chip memory](memory.png)",
        "",
        "## Roofline time and decode traffic at 128k",
        "",
        *speed(rs),
        "",
        "## Against the paper's Table 9 (H100 80 GB, measured in the paper; here the same analytic counts)",
        "",
        *table9(rs),
        "",
        "The paper's TTFT is a measured PyTorch/HF run; the roofline is the bound the same work has on the "
        "card's published peak (flops and HBM traffic of weights and KV only), so the ratio says how far "
        "an implementation is from the hardware, not an error in either. Under block processing with B = 128 "
        "the layer weights are read once per block: 128 tokens x 2 flops per bf16 weight (2 bytes) = 128 "
        "flop/byte, below v5e's ridge (197e12 / 819e9 = 240) and H100's (295), so an evicting prefill is "
        "bandwidth-bound at B = 128 and larger blocks would move it to compute.",
    ]
    missing = [f"{m} {s} {p} {k(n)}" for m in MODELS for s, _, _ in SLICES for p in ("dense", "valuediff")
               for n in LENGTHS if (m, s, p, n) not in rs]
    if missing:
        text += ["", f"Not compiled yet ({len(missing)} of the dense/valuediff cells): "
                 + ", ".join(missing[:40]) + (" ..." if len(missing) > 40 else "")]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "README.md").write_text("\n".join(text) + "\n")
    if rs:
        figure(rs)
    print(f"wrote {OUT / 'README.md'} ({len(rs)} runs)")


if __name__ == "__main__":
    main()

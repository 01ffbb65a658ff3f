"""How head-adaptive budgets split a layer's pool among its KV heads, per base scorer (issue 36): AdaKV
compares the scores of different heads directly, as kvpress does, so a scorer whose scale differs by head
can hand one head nearly everything. For each base, `adakv:<base>` (and with `standardize=True`) prefills
the first `--length` tokens of RULER's essay text at N=`--budget`, B=128 on SmolLM2-135M (K=3 KV heads;
Gemma3-270M has one, where the pool is the uniform cache), and the head counts of every layer give: the
mean over layers of the largest head's share of the pool (1/K = even; 1 - (K-1) * safeguard/(K*N) is the
most the safeguard allows), the layers where it exceeds 0.8, and the smallest head count seen. Writes a
Markdown table to --out:

    VDJAX_CACHE=~/.cache/vdjax-leaderboard .venv/bin/python experiments/adakv_heads.py
"""

import argparse
from pathlib import Path

import numpy as np

import vdjax
from vdjax.analysis.data import essays

BASES = ("valuediff", "valuediff_dir", "keydiff", "keynorm", "snapkv", "tova", "h2o", "expected_attention",
         "cur", "leverage", "lagkv", "qfilter", "random")


def shares(params, ids, policy: str, budget: int, **kw) -> tuple[float, int, int, int]:
    """(mean largest-head share, layers above 0.8, layers, smallest head count) after one prefill."""
    cache, _ = vdjax.prefill(params, ids, policy, budget, block_size=128, **kw)
    counts = np.asarray(cache.valid_counts())[:, 0]  # [La, K]
    top = counts.max(axis=1) / counts.sum(axis=1)
    return float(top.mean()), int((top > 0.8).sum()), counts.shape[0], int(counts.min())


def main() -> None:
    """Measure every base with and without standardisation and write the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--bases", default=",".join(BASES))
    ap.add_argument("--out", default="results/adaptive/heads.md")
    a = ap.parse_args()
    params, tok = vdjax.load(a.model), vdjax.load_tokenizer(a.model)
    ids = tok(essays(), add_special_tokens=False)["input_ids"][: a.length]
    rows = []
    for base in a.bases.split(","):
        if not vdjax.POLICIES[base].calibrated(params.source):
            continue
        cells = []
        for std in (False, True):
            mean, high, layers, low = shares(params, ids, f"adakv:{base}", a.budget, standardize=std)
            cells.append(f"{mean:.2f} / {high} of {layers} / {low}")
        rows.append(f"| `{base}` | {cells[0]} | {cells[1]} |")
        print(rows[-1], flush=True)
    k = params.config.num_kv_heads
    text = "\n".join([
        f"# AdaKV's head shares on {a.model} (K = {k} KV heads), N = {a.budget}, B = 128, {a.length} tokens "
        "of RULER's essay text",
        "",
        f"Each cell: mean over layers of the largest head's share of the K·N pool (even = {1 / k:.2f}) / "
        "layers where it exceeds 0.8 / the smallest head count (the safeguard keeps at least "
        f"{max(1, int(0.2 * a.budget))}). Command: `python experiments/adakv_heads.py --model {a.model} "
        f"--length {a.length} --budget {a.budget}`.",
        "",
        "| base | adakv (kvpress: scores compared as they are) | adakv, standardize=True |",
        "|---|---|---|",
        *rows, ""])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

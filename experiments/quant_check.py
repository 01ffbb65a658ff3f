"""A quantized cache that evicts nothing against the unquantized one on the real models (issue 49).

Prompts: one RULER sample of each of the 13 tasks (1024 tokens, seed 42, sample 0), the eval's prompt
(`render_split`: chat template where the tokenizer has one) + answer prefix. Per model and `kv_quant`:
`vdjax.prefill` (dense: N = T, blocks of 128, each block attending to the cache as stored) for the
last-position logits, and `vdjax.generate` (dense, N = T + new) for `--new` greedy tokens with EOS off,
against the same calls unquantized. Reports the prompts whose tokens are all equal, the first position
where they differ, and the logit error (max |dl| / max |l| of the last prompt position, and whether its
argmax agrees). Writes a Markdown table:

    JAX_PLATFORMS=cpu .venv/bin/python experiments/quant_check.py --out results/bytes/equality.md
"""

import argparse
import subprocess
import time
from pathlib import Path

import numpy as np

import vdjax
from vdjax.eval import ruler
from vdjax.text.prompt import render_split

MODELS = ("smollm2-135m", "gemma3-270m")


def prompts(tok, length: int) -> list[tuple[str, np.ndarray]]:
    """(task, ids) of sample 0 of each RULER task at `length` tokens, seed 42."""
    out = []
    for task in ruler.TASKS:
        s = ruler.build(task, tok, length=length, num_samples=1, seed=42)[0]
        ctx, q = render_split(tok, s.context, s.question, answer_prefix=s.answer_prefix)
        ids = ctx + q
        out.append((task, np.asarray(ids, np.int32)))
    return out


QUANTS = ("int8", "int4", "int8-smooth", "int4-smooth", "int8-smooth-rot", "int4-smooth-rot")


def check(model: str, length: int, new: int, group: int, quants=QUANTS) -> list[list]:
    """One table row per kv_quant: prompts with equal tokens, mean first difference, logit errors."""
    params, tok = vdjax.load(model), vdjax.load_tokenizer(model)
    ps = prompts(tok, length)
    base = {}
    for task, ids in ps:
        _, logits = vdjax.prefill(params, ids, "dense", None, 128)
        gen = vdjax.generate(params, ids, policy="dense", max_new_tokens=new, eos_token_id=[])
        base[task] = (np.asarray(logits[0], np.float64), np.asarray(gen[0]))
    rows = []
    for q in quants:
        equal, first, rel, agree = 0, [], [], 0
        t0 = time.perf_counter()
        for task, ids in ps:
            _, logits = vdjax.prefill(params, ids, "dense", None, 128, kv_quant=q, kv_group=group)
            gen = vdjax.generate(params, ids, policy="dense", max_new_tokens=new, eos_token_id=[], kv_quant=q,
                                 kv_group=group)
            lb, tb = base[task]
            lq, tq = np.asarray(logits[0], np.float64), np.asarray(gen[0])
            rel.append(np.abs(lq - lb).max() / np.abs(lb).max())
            agree += int(lq.argmax() == lb.argmax())
            diff = np.flatnonzero(tq != tb)
            equal += int(diff.size == 0)
            first.append(new if diff.size == 0 else int(diff[0]))
        rows.append([model, q, group, f"{equal} / {len(ps)}", f"{np.mean(first):.1f}", f"{agree} / {len(ps)}",
                     f"{np.mean(rel):.4f}", f"{np.max(rel):.4f}", f"{time.perf_counter() - t0:.0f}"])
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    """Check both models and write the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--quants", default=",".join(QUANTS), help="comma-separated kv_quant names")
    ap.add_argument("--out", default="results/bytes/equality.md")
    a = ap.parse_args()
    quants = a.quants.split(",")
    rows = [r for m in MODELS for r in check(m, a.length, a.new, a.group, quants)]
    head = ["model", "kv_quant", "group", "prompts with all tokens equal",
            f"mean first difference (of {a.new})",
            "last-position argmax equal", "logit error mean", "logit error max", "s"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    text = ("# A quantized cache that evicts nothing vs the unquantized cache "
            "(experiments/quant_check.py)\n\n"
            f"One RULER sample per task (13 prompts, {a.length} tokens, seed 42, sample 0; the eval's "
            f"prompt + answer prefix), fp32 weights, dense, blocks of 128, {a.new} greedy tokens, EOS off; "
            f"groups of {a.group} channels, bf16 scales; commit {commit}. Logit error: max |dl| / max |l| "
            f"over the vocabulary at the last prompt position (mean and max over prompts).\n\n"
            + "| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
            + "".join("| " + " | ".join(str(c) for c in r) + " |\n" for r in rows)
            + "\nCommand: `JAX_PLATFORMS=cpu .venv/bin/python experiments/quant_check.py "
              f"--quants {a.quants} --out {a.out}`\n")
    print(text)
    Path(a.out).write_text(text)


if __name__ == "__main__":
    main()

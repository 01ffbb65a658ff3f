"""Tokens and kept positions of every policy on both real models: a record to compare two commits by.

    python experiments/behaviour.py --out before.json            # on one commit
    python experiments/behaviour.py --out after.json             # on another
    python experiments/behaviour.py --compare before.json after.json

Only the public API is used (`vdjax.load`, `vdjax.load_tokenizer`, `vdjax.run`), so the script runs unchanged
on any commit whose API has them. The prompt is the first T tokens of CPython's `pydoc_data/topics.py` (always
present); every policy of the registry runs at budget N with blocks of B, and
the hybrid with an even mix. """

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

POLICIES = ("dense", "valuediff", "valuediff_dir", "valuediff_norm", "keydiff", "keynorm", "manifoldkv",
            "streaming", "tova", "snapkv", "h2o", "fastcaote", "hybrid")


def prompt_ids(tok, t: int) -> list[int]:
    """The first `t` tokens of pydoc's topics text."""
    import pydoc_data.topics as topics

    text = Path(topics.__file__).read_text(encoding="utf-8")
    ids = tok(text[: 40 * t])["input_ids"]
    if len(ids) < t:
        raise SystemExit(f"the topics text gave {len(ids)} tokens, fewer than {t}")
    return list(ids[:t])


def record(model: str, t: int, budget: int, block: int, new: int) -> dict:
    """{policy: {"tokens": [...], "kept": per layer [K][sorted positions]}} for one model."""
    import vdjax

    params, tok = vdjax.load(model), vdjax.load_tokenizer(model)
    ids = prompt_ids(tok, t)
    out = {}
    for name in POLICIES:
        kw = {"mix": 0.5} if name == "hybrid" else {}
        start = time.time()
        gen = vdjax.run(params, ids, name, None if name == "dense" else budget, block, new, **kw)
        kept = []
        for lc in gen.cache.layers:
            pos = getattr(lc, "pos", None)
            if pos is None:  # a layer without a KV cache
                kept.append(None)
                continue
            pos = np.asarray(pos)[0]  # [K, N]
            kept.append([sorted(int(p) for p in head if p >= 0) for head in pos])
        out[name] = {"tokens": np.asarray(gen.tokens)[0].tolist(), "kept": kept}
        print(f"{model} {name}: {time.time() - start:.1f} s, tokens {out[name]['tokens'][:8]}...", flush=True)
    return out


def compare(a_path: str, b_path: str) -> int:
    """Print per (model, policy) whether tokens and kept positions are identical; 1 if any differs."""
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    bad = 0
    for model in a["models"]:
        for name, rec in a["models"][model].items():
            other = b["models"].get(model, {}).get(name)
            same_tok = other is not None and other["tokens"] == rec["tokens"]
            same_kept = other is not None and other["kept"] == rec["kept"]
            bad += not (same_tok and same_kept)
            print(f"{model:14s} {name:15s} tokens {'same' if same_tok else 'DIFFER'}  "
                  f"kept {'same' if same_kept else 'DIFFER'}")
    print(f"{bad} of {sum(len(m) for m in a['models'].values())} differ")
    return int(bad > 0)


def main(argv=None) -> int:
    """Record (--out) or compare (--compare A B)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("give --out FILE or --compare A B")
    models = {m: record(m, args.tokens, args.budget, args.block, args.new) for m in args.models.split(",")}
    setup = {k: getattr(args, k) for k in ("tokens", "budget", "block", "new")}
    Path(args.out).write_text(json.dumps({"setup": setup, "models": models}))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

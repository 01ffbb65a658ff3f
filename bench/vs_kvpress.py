#!/usr/bin/env python
"""vdjax vs kvpress (NVIDIA's PyTorch KV-cache compression library) on CPU: same checkpoint, same threads.

    VDJAX_CACHE=/tmp/vdcache .venv/bin/python bench/vs_kvpress.py        # 4k + 8k, five presses
    .venv/bin/python bench/vs_kvpress.py --lengths 1024 --presses keydiff,streaming --out /tmp/x.md

For each kvpress press and its vdjax policy (KeyDiffPress/keydiff, KnormPress/keynorm,
StreamingLLMPress/streaming, TOVAPress/tova, SnapKVPress/snapkv) and each prompt length T it measures the wall
time of compressing the prompt to N kept tokens (prefill + compression) and generating --new tokens greedily
(warm on both sides), and how far the two libraries agree on which positions layer 0 keeps (per KV head).

kvpress 0.5.5 needs transformers < 5.3, so it runs in its own virtual environment (--kvpress-python, default
.venv-kvpress/bin/python), as a subprocess worker; the vdjax side runs in a worker of this interpreter. Both
use fp32 weights of the same HF folder and torch.set_num_threads / XLA:CPU on the same cores. Prints a
Markdown table and writes it to --out (default results/vs_kvpress/vs_kvpress.md) plus the raw numbers (.json).
See bench/README.md ("vs_kvpress.py") for the columns and the differences between the libraries.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"
INSTALL_HINT = "python -m venv .venv-kvpress && .venv-kvpress/bin/pip install torch==2.13.0 kvpress==0.5.5"

# vdjax policy -> (kvpress press class, wrapped in BlockPress?)
PAIRS = {
    "keydiff": ("KeyDiffPress", True),
    "keynorm": ("KnormPress", True),
    "streaming": ("StreamingLLMPress", False),
    "tova": ("TOVAPress", False),
    "snapkv": ("SnapKVPress", False),
}


def _load_bench():
    """bench/bench.py as a module (its helpers: OtherLoad, best_of, corpus_tokens, tables). It imports only
    the standard library and numpy at the top, so the kvpress interpreter can load it too."""
    spec = importlib.util.spec_from_file_location("_vdjax_bench", Path(__file__).with_name("bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


B = _load_bench()


def log(text: str):
    print(text, file=sys.stderr, flush=True)


def kv_ratio(t: int, n: int, n_kept=None) -> float:
    """kvpress compression_ratio that keeps exactly n of t tokens (kvpress: n_kept = int(t * (1 - ratio)))."""
    n_kept = n_kept or (lambda k, r: max(1, int(k * (1 - r))))
    for r in (1 - n / t, 1 - (n + 0.5) / t):
        if 0 <= r < 1 and n_kept(t, r) == n:
            return r
    raise ValueError(f"no compression_ratio keeps exactly {n} of {t} tokens")


def vd_kwargs(policy: str, a) -> dict:
    """The vdjax hyper-parameters matched to kvpress's press settings."""
    if policy == "streaming":
        return {"n_sink": a.n_sink}
    if policy == "snapkv":
        return {"window": a.snapkv_window, "kernel": a.snapkv_kernel}
    if policy == "tova":
        return {"per_kv_head": False}  # kvpress TOVAPress: mean over all query heads, same for every KV head
    return {}


def press_label(policy: str, a) -> str:
    cls, block = PAIRS[policy]
    args = {"streaming": f"n_sink={a.n_sink}",
            "snapkv": f"window_size={a.snapkv_window}, kernel_size={a.snapkv_kernel}"}.get(policy, "")
    inner = f"{cls}({args})" if args else cls
    return f"BlockPress({inner}, {a.block})" if block else inner


def vd_label(policy: str, a) -> str:
    kw = vd_kwargs(policy, a)
    return policy + (f"({', '.join(f'{k}={v}' for k, v in kw.items())})" if kw else "")


NOTES = {
    "keydiff": "BlockPress: blocks simulated over one dense forward (same keys as vdjax only at layer 0)",
    "keynorm": "BlockPress: blocks simulated over one dense forward (same keys as vdjax only at layer 0); a "
               "repeated token has the same key norm at every position (RoPE rotates): kvpress's top-k "
               "breaks such ties arbitrarily, vdjax keeps the earlier position",
    "streaming": "plain press, which keeps exactly what blocks would (first n_sink + most recent); "
                 "BlockPress(StreamingLLMPress) scores by index in its top-k-ordered array and loses the "
                 "sinks",
    "tova": "plain press: compressed once after the full prefill (vdjax: after every block); kvpress "
            "protects the last token",
    "snapkv": "plain press: compressed once after the full prefill (vdjax: after every block); kvpress "
              "avg-pools, vdjax max-pools",
}


# ---- kvpress worker (runs under --kvpress-python) -------------------------------------------------------
def match_rows(full: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Positions [K, n] of the kept key rows kept [K, n, D] among full [K, T, D] (exact equality: the press
    gathers rows unchanged); -1 where a row is not found."""
    out = np.full(kept.shape[:2], -1, np.int64)
    for h in range(full.shape[0]):
        index: dict[bytes, int] = {}
        for i, row in enumerate(full[h]):
            index.setdefault(row.tobytes(), i)
        out[h] = [index.get(row.tobytes(), -1) for row in kept[h]]
    return out


def measure(once, a) -> tuple[dict, list[float]]:
    """The fastest of best_of (retried under load) and a.reps - 1 more runs of
    `once`, and every run's seconds."""
    res = B.best_of(once, lambda r: r["s"], lambda r: r["other_load"], a.retries, a.max_wait, log)
    runs = [res["s"]]
    for _ in range(a.reps - 1):
        r = once()
        runs.append(r["s"])
        res = min(res, r, key=lambda r: r["s"])
    return res, runs


def worker_kvpress(a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import dataclasses

    import kvpress
    from kvpress.presses.base_press import BasePress
    from kvpress.utils import compute_n_kept

    @dataclasses.dataclass
    class KeptRecorder(BasePress):
        """Runs `press` and records, per layer, the prompt positions of the rows it kept."""

        press: BasePress = None
        kept: dict = dataclasses.field(default_factory=dict)

        def post_init_from_model(self, model):
            self.press.post_init_from_model(model)

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            k2, v2 = self.press.compress(module, hidden_states, keys, values, attentions, kwargs)
            self.kept[module.layer_idx] = match_rows(keys[0].float().numpy(), k2[0].float().numpy())
            return k2, v2

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    ids = np.load(a.tokens)[: a.T]
    x = torch.as_tensor(ids[None].astype(np.int64))
    ratio = kv_ratio(a.T, a.budget, compute_n_kept)
    assert compute_n_kept(a.T, ratio) == a.budget

    def make_press(policy: str):
        cls_name, block = PAIRS[policy]
        cls = getattr(kvpress, cls_name)
        kw = {"streaming": {"n_sink": a.n_sink},
              "snapkv": {"window_size": a.snapkv_window, "kernel_size": a.snapkv_kernel}}.get(policy, {})
        press = cls(compression_ratio=ratio, **kw)
        return kvpress.BlockPress(press=press, block_size=a.block) if block else press

    def generate(press) -> dict:
        """Prefill under the press (compression inside the forward's hooks), then greedy decoding as kvpress's
        pipeline does it (explicit position_ids continuing after the prompt; the cache grows, no eviction)."""
        t = x.shape[1]
        with torch.inference_mode(), B.OtherLoad() as ol:
            t0 = time.perf_counter()
            cache = DynamicCache()
            with press(model):
                out = model(input_ids=x, past_key_values=cache, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1)
            toks = [int(tok)]
            t1 = time.perf_counter()
            kept_len = cache.get_seq_length()
            for i in range(a.new - 1):
                out = model(input_ids=tok[:, None], past_key_values=cache,
                            position_ids=torch.tensor([[t + i]]))
                tok = out.logits[:, -1].argmax(-1)
                toks.append(int(tok))
            t2 = time.perf_counter()
        assert kept_len == a.budget, f"kvpress kept {kept_len} tokens, expected {a.budget}"
        return {"s": t2 - t0, "prefill_s": t1 - t0, "decode_s": t2 - t1, "other_load": ol.cores,
                "tokens": toks, "cache_after_prefill": kept_len, "cache_at_end": cache.get_seq_length()}

    out = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "kvpress": importlib.metadata.version("kvpress")},
           "threads": torch.get_num_threads(), "ratio": ratio}
    for policy in a.presses.split(","):
        press = make_press(policy)
        rec = KeptRecorder(press=press)
        warm = generate(rec)  # untimed: first-call overheads + the kept positions
        kept = np.stack([rec.kept[i] for i in sorted(rec.kept)])  # [L, K, N]
        np.save(Path(a.save) / f"kvpress-{policy}-{a.T}.npy", kept)

        def once(press=press):
            return generate(press)

        res, runs = measure(once, a)
        out[policy] = res | {"runs_s": runs, "warm_s": warm["s"], "press": repr(press),
                             "unmatched": int((kept < 0).sum()), "tokens_warm": warm["tokens"]}
        log(f"  kvpress {policy:9s} T={a.T}: {res['s']:.2f} s (prefill {res['prefill_s']:.2f} + decode "
            f"{res['decode_s']:.2f}), other load {res['other_load']:.2f}")
    return out


# ---- vdjax worker (runs under this interpreter) ---------------------------------------------------------
def worker_vdjax(a) -> dict:
    B._jax_setup()
    import jax

    import vdjax
    from vdjax.engine.timing import count_compiles

    params = vdjax.load(a.model)
    ids = np.load(a.tokens)[: a.T]
    out = {"versions": {"jax": jax.__version__, "backend": jax.default_backend()}}
    for policy in a.presses.split(","):
        kw = vd_kwargs(policy, a)
        gen_kw = dict(block_size=a.block, max_new_tokens=a.new, eos_token_id=[], **kw)
        cache, _ = vdjax.prefill(params, ids, policy, a.budget, a.block, **kw)  # compiles the prefill program
        pos = np.stack([np.asarray(lc.pos[0]) for lc in cache.layers])  # [L, K, N]
        np.save(Path(a.save) / f"vdjax-{policy}-{a.T}.npy", pos)
        del cache
        t0 = time.perf_counter()
        warm = vdjax.run(params, ids, policy, a.budget, **gen_kw)  # compiles the decode program
        warm_s = time.perf_counter() - t0

        def once(policy=policy, gen_kw=gen_kw):
            with B.OtherLoad() as ol, count_compiles() as compiled:
                t0 = time.perf_counter()
                g = vdjax.run(params, ids, policy, a.budget, **gen_kw)
                dt = time.perf_counter() - t0
            return {"s": dt, "prefill_s": g.prefill_s, "decode_s": g.decode_s, "other_load": ol.cores,
                    "tokens": g.tokens[0].tolist(), "compiled": compiled.value, "slots": int(g.cache.budget)}

        res, runs = measure(once, a)
        out[policy] = res | {"runs_s": runs, "warm_s": warm_s, "tokens_warm": warm.tokens[0].tolist(),
                             "hyper": kw}
        log(f"  vdjax   {policy:9s} T={a.T}: {res['s']:.2f} s (prefill {res['prefill_s']:.2f} + decode "
            f"{res['decode_s']:.2f}), other load {res['other_load']:.2f}, compiled in timed call "
            f"{res['compiled']}")
    return out


# ---- main -----------------------------------------------------------------------------------------------
def run_worker(python: str, args: list[str], env: dict | None = None) -> dict:
    """Run this script as a worker under `python`; its stderr is shown as it comes,
    its last stdout line is JSON."""
    proc = subprocess.Popen([python, str(Path(__file__).resolve())] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy() | (env or {}))
    tail: list[str] = []

    def pump():
        for line in proc.stderr:
            tail.append(line)
            del tail[:-40]
            if line.startswith("  "):  # our own progress lines; library noise stays in the tail
                sys.stderr.write(line)

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    stdout = proc.stdout.read()
    proc.wait()
    th.join()
    if proc.returncode != 0:
        log(f"  worker failed ({python} ... {' '.join(args[:2])}):\n{''.join(tail)[-3000:]}")
        return {"error": (tail[-1].strip() if tail else f"exit {proc.returncode}")}
    return json.loads(stdout.strip().splitlines()[-1])


def agreement(kv: np.ndarray, vd: np.ndarray) -> dict:
    """Kept-position agreement of two [L, K, N] position arrays (-1 = empty), per layer and KV head."""
    overlap = np.zeros(kv.shape[:2])
    jacc = np.zeros(kv.shape[:2])
    for layer in range(kv.shape[0]):
        for h in range(kv.shape[1]):
            x, y = (set(kv[layer, h][kv[layer, h] >= 0].tolist()),
                    set(vd[layer, h][vd[layer, h] >= 0].tolist()))
            inter = len(x & y)
            overlap[layer, h] = inter / max(1, min(len(x), len(y)))
            jacc[layer, h] = inter / max(1, len(x | y))
    return {"layer0_overlap": float(overlap[0].mean()), "layer0_jaccard": float(jacc[0].mean()),
            "layer0_overlap_per_head": overlap[0].tolist(), "layer0_jaccard_per_head": jacc[0].tolist(),
            "all_layers_overlap": float(overlap.mean()), "overlap_per_layer": overlap.mean(axis=1).tolist()}


def common_prefix(x: list, y: list) -> int:
    n = 0
    for p, q in zip(x, y, strict=False):
        if p != q:
            break
        n += 1
    return n


def check_kvpress_python(path: str) -> str | None:
    """None when `path` is a Python with kvpress importable, else the reason."""
    if not Path(path).exists():
        return f"{path} does not exist"
    probe = subprocess.run([path, "-c", "import importlib.util, sys; "
                                        "sys.exit(importlib.util.find_spec('kvpress') is None or "
                                        "importlib.util.find_spec('torch') is None)"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"{path} cannot import kvpress and torch"


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="registered name or HF checkpoint folder")
    ap.add_argument("--kvpress-python", default=str(DEFAULT_KVPRESS_PYTHON),
                    help="Python of the virtual environment that has kvpress (default "
                         ".venv-kvpress/bin/python)")
    ap.add_argument("--lengths", default="4096,8192", help="comma-separated prompt lengths T")
    ap.add_argument("--budget", type=int, default=512, help="N, tokens kept per KV head")
    ap.add_argument("--block", type=int, default=128,
                    help="block size (vdjax block_size, kvpress BlockPress)")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens generated (EOS disabled)")
    ap.add_argument("--presses", default=",".join(PAIRS),
                    help=f"vdjax names of the pairs to run ({','.join(PAIRS)})")
    ap.add_argument("--n-sink", type=int, default=4, help="StreamingLLM sinks (kvpress default 4)")
    ap.add_argument("--snapkv-window", type=int, default=64, help="SnapKV window (kvpress default 64)")
    ap.add_argument("--snapkv-kernel", type=int, default=5, help="SnapKV pooling kernel (kvpress default 5)")
    ap.add_argument("--reps", type=int, default=1, help="timed runs per pair and side (the fastest counts)")
    ap.add_argument("--retries", type=int, default=1,
                    help=f"re-measure (keeping the fastest) when other processes used > {B.BUSY} cores "
                         "meanwhile")
    ap.add_argument("--max-wait", type=float, default=60.0,
                    help="seconds to wait for other processes to go idle before each worker and retry")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY for the torch worker unless already set in the environment "
                         "(default PASSIVE: torch's spinning OpenMP threads slow down many-fold when another "
                         "process holds a core; 'default' leaves the variable unset)")
    ap.add_argument("--out", default=str(ROOT / "results" / "vs_kvpress" / "vs_kvpress.md"))
    ap.add_argument("--worker", choices=["vdjax", "kvpress"], help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    ap.add_argument("--T", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    return ap, ap.parse_args(argv)


def check_settings(ap, a) -> tuple[list[str], list[int]]:
    """(policies, lengths), refusing settings kvpress cannot match (argparse error)."""
    policies = a.presses.split(",")
    unknown = [p for p in policies if p not in PAIRS]
    if unknown:
        ap.error(f"unknown --presses {unknown}; choose from {list(PAIRS)}")
    lengths = [int(x) for x in a.lengths.split(",")]
    for t in lengths:
        if t <= a.budget:
            ap.error(f"prompt length {t} must exceed the budget {a.budget} (nothing would be evicted)")
        kv_ratio(t, a.budget)  # raises when kvpress cannot keep exactly N
    if "snapkv" in policies and min(lengths) <= a.snapkv_window:
        ap.error("SnapKVPress needs prompts longer than its window")
    return policies, lengths


def measure_all(a, policies, lengths, folder, tok_file, tmp, cores, kv_env) -> tuple[list[dict], dict]:
    """Both workers per length; a row per (policy, length) with kept-set agreement and common tokens."""
    rows, versions = [], {}
    for t in lengths:
        common = ["--model", str(folder), "--tokens", str(tok_file), "--T", str(t), "--budget", str(a.budget),
                  "--block", str(a.block), "--new", str(a.new), "--presses", ",".join(policies), "--n-sink",
                  str(a.n_sink), "--snapkv-window", str(a.snapkv_window), "--snapkv-kernel",
                  str(a.snapkv_kernel), "--reps", str(a.reps), "--retries", str(a.retries), "--max-wait",
                  str(a.max_wait), "--threads", str(cores), "--save", str(tmp)]
        log(f"[T={t}] vdjax worker ...")
        B.wait_idle(a.max_wait, log=log)
        vd = run_worker(sys.executable, ["--worker", "vdjax"] + common)
        log(f"[T={t}] kvpress worker ...")
        B.wait_idle(a.max_wait, log=log)
        kv = run_worker(a.kvpress_python, ["--worker", "kvpress"] + common, kv_env)
        versions.setdefault("vdjax", vd.get("versions"))
        versions.setdefault("kvpress", kv.get("versions"))
        for policy in policies:
            v, k = vd.get(policy), kv.get(policy)
            row = {"policy": policy, "press": press_label(policy, a), "T": t, "vdjax": v, "kvpress": k,
                   "kvpress_ratio": kv.get("ratio")}
            if v and k:
                row["agreement"] = agreement(np.load(tmp / f"kvpress-{policy}-{t}.npy"),
                                             np.load(tmp / f"vdjax-{policy}-{t}.npy"))
                row["same_tokens"] = common_prefix(k["tokens"], v["tokens"])
            rows.append(row)
    return rows, versions


def result_cells(a, r: dict) -> list:
    """One table row of a (policy, length) result."""
    v, k, N, Bk = r["vdjax"], r["kvpress"], a.budget, a.block
    if not (v and k):
        err = (v or {}).get("error") or (k or {}).get("error") or "worker failed"
        return [r["press"], vd_label(r["policy"], a), B.klabel(r["T"])] + ["—"] * 7 + [f"failed: {err}"]
    ag = r["agreement"]
    note = NOTES[r["policy"]]
    if v.get("compiled"):
        note += f"; vdjax compiled {v['compiled']} program(s) in the timed call"
    if k.get("unmatched"):
        note += f"; {k['unmatched']} kvpress rows not matched to a position"
    if N % Bk:
        note += "; N % B != 0: block boundaries differ (BlockPress starts at N, vdjax at 0)"
    return [r["press"], vd_label(r["policy"], a), B.klabel(r["T"]),
            f"{k['s']:.2f} ({k['prefill_s']:.2f} + {k['decode_s']:.2f})",
            f"{v['s']:.2f} ({v['prefill_s']:.2f} + {v['decode_s']:.2f})",
            B.fx(B.ratio(k["s"], v["s"])),
            f"{100 * ag['layer0_overlap']:.1f} ({100 * ag['layer0_jaccard']:.1f})",
            f"{100 * ag['all_layers_overlap']:.1f}", r["same_tokens"],
            f"{k['other_load']:.2f} / {v['other_load']:.2f}", note]


def report(a, rows, versions, folder, cores, corpus_n, omp) -> list[str]:
    """The Markdown report lines."""
    vd_v, kv_v = versions.get("vdjax") or {}, versions.get("kvpress") or {}
    tot_gb, _ = B.mem_total_available_gb()
    N = a.budget
    md = [
        f"# vdjax vs kvpress — {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}", "",
        f"- machine: {cores} cores ({B.cpu_model()}), {tot_gb:.1f} GiB RAM, {platform.system()} "
        f"{platform.release()}",
        f"- vdjax: jax {vd_v.get('jax', '?')} (XLA:CPU on the {cores} visible cores), tree {B.git_state()}; "
        f"kvpress {kv_v.get('kvpress', '?')} with torch {kv_v.get('torch', '?')}, transformers "
        f"{kv_v.get('transformers', '?')} (`{a.kvpress_python}`), torch.set_num_threads({cores}), sdpa "
        f"attention, OMP_WAIT_POLICY={omp}",
        f"- model: `{a.model}` → `{folder}`, fp32 on both sides; prompts: CPython pydoc topics text "
        f"tokenized with the model's tokenizer ({corpus_n} tokens), no chat template, the same ids on both "
        f"sides",
        f"- budget N={N} kept tokens per KV head (kvpress compression_ratio = 1 − N/T, checked with "
        f"kvpress's `compute_n_kept` to keep exactly N), block size {a.block}, {a.new} greedy tokens (EOS "
        f"disabled)",
        f"- time = wall of prefill + compression + {a.new} tokens; warm on both sides (one untimed run "
        f"first; vdjax's timed call compiled nothing unless noted); best of {a.reps} timed run(s), "
        f"re-measured up to {a.retries} time(s) when other processes kept > {B.BUSY} cores busy; 'other "
        f"load' = cores other processes kept busy during the kept run (a high value means the number is "
        f"pessimistic)", ""]
    head = ["kvpress press", "vdjax policy", "T", "kvpress s (prefill + decode)",
            "vdjax s (prefill + decode)", "speed-up (kvpress s / vdjax s)",
            "layer-0 kept agreement: overlap % (Jaccard %)", "all-layer overlap %",
            f"same greedy tokens (of {a.new})", "other load (kvpress / vdjax)", "notes"]
    md += [B.md_table(head, [result_cells(a, r) for r in rows]), ""]
    md.append("Overlap = |kvpress kept ∩ vdjax kept| / N per KV head, averaged over the KV heads; Jaccard = "
              "|∩| / |∪|. kvpress's kept positions are recovered by matching the compressed cache's key "
              "rows to the uncompressed ones inside the press (exact equality), vdjax's are `prefill(...)` "
              "cache[l].pos. Layer 0 sees the same keys on both sides (its input is the embeddings); from "
              "layer 1 on vdjax's keys come from blocks that attended to the already-pruned cache, "
              "kvpress's from one dense forward, so the all-layer column mixes scoring differences with "
              "that true-vs-simulated block difference.")
    return md + [""]


def main(argv=None):
    ap, a = parse_args(argv)
    if a.worker:
        print(json.dumps(worker_vdjax(a) if a.worker == "vdjax" else worker_kvpress(a)))
        return
    problem = check_kvpress_python(a.kvpress_python)
    if problem:
        print(f"kvpress is not available: {problem}.\n"
              f"kvpress 0.5.5 needs transformers<5.3, so it lives in its own virtual environment. Create it "
              f"in the repository root with\n\n    {INSTALL_HINT}\n\n"
              f"(or pass --kvpress-python PATH). Nothing was measured.")
        return
    policies, lengths = check_settings(ap, a)
    t_start = time.perf_counter()
    from vdjax.loading import registry

    folder, cores = registry.resolve(a.model), B.n_cores()
    ids_all, corpus_n = B.corpus_tokens(registry.load_tokenizer(a.model), max(lengths))
    tmp = Path(tempfile.mkdtemp(prefix="vs-kvpress-"))
    np.save(tmp / "tokens.npy", ids_all)
    kv_env = {}
    if a.omp_wait_policy != "default" and "OMP_WAIT_POLICY" not in os.environ:
        kv_env["OMP_WAIT_POLICY"] = a.omp_wait_policy
    omp = (os.environ.get("OMP_WAIT_POLICY") or kv_env.get("OMP_WAIT_POLICY")
           or "unset (libgomp default: spin)")
    rows, versions = measure_all(a, policies, lengths, folder, tmp / "tokens.npy", tmp, cores, kv_env)
    md = report(a, rows, versions, folder, cores, corpus_n, omp)
    md.append(f"Total wall time: {(time.perf_counter() - t_start) / 60:.1f} min.")
    print("\n".join(md), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md) + "\n")
    settings = {k: v for k, v in vars(a).items() if k not in ("worker", "tokens", "T", "threads", "save")}
    raw = {"settings": settings, "results": rows, "versions": versions}
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str))
    log(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()

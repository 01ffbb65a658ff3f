#!/usr/bin/env python
"""vdjax benchmark: block prefill, decode, peak memory, TTFT and compile counts against HF transformers.

    VDJAX_CACHE=/tmp/vdcache .venv/bin/python bench/bench.py            # full run (~16-20 min on a quiet
    2-core box) .venv/bin/python bench/bench.py --quick                              # smoke run (small
    lengths, ~5 min) .venv/bin/python bench/bench.py --lengths 1024,4096 --out /tmp/x.md

A script, not a test: it prints Markdown tables (header, sections 1-6, targets with PASS/FAIL) and writes them
to --out. Every vdjax prefill length runs in a fresh subprocess (its peak RSS is that length's alone); HF
transformers runs in the main process with torch.set_num_threads equal to the cores XLA:CPU uses.
See bench/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FULL_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (256, 512, 1024)
HF_TIME_LIMIT_S = 180.0  # skip an HF length predicted to take longer than this


# ---- machine facts --------------------------------------------------------------------------------------
def n_cores() -> int:
    """Cores this process may run on (XLA:CPU sizes its intra-op thread pool to this)."""
    return len(os.sched_getaffinity(0))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total_available_gb() -> tuple[float, float]:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, val = line.split(":", 1)
        info[key] = int(val.split()[0]) * 1024
    return info["MemTotal"] / 2**30, info["MemAvailable"] / 2**30


def git_state() -> str:
    """Commit of the vdjax checkout and how many tracked files differ from it (the
    library is benchmarked as is)."""
    try:
        def run(*c):
            return subprocess.run(["git", "-C", str(ROOT), *c], capture_output=True, text=True).stdout.strip()

        dirty = [ln for ln in run("status", "--porcelain", "--untracked-files=no").splitlines() if ln]
        return (f"commit {run('rev-parse', '--short', 'HEAD')}"
                + (f" + {len(dirty)} modified files" if dirty else ""))
    except OSError:
        return "unknown (no git)"


def peak_rss_mb() -> float:
    """Peak resident set size of this process image so far: VmHWM from /proc/self/status. (ru_maxrss is not
    used: a forked child starts with its parent's high-water mark and keeps it across exec.)"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _busy_s() -> float:
    """CPU-seconds all processes have spent busy (user+nice+system+irq+softirq), from /proc/stat."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _mine_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """Measures how many cores *other* processes kept busy during a block (children of ours count as ours)."""

    def __enter__(self):
        self.t, self.busy, self.mine = time.perf_counter(), _busy_s(), _mine_s()
        return self

    def __exit__(self, *exc):
        wall = max(time.perf_counter() - self.t, 1e-9)
        self.cores = max(0.0, (_busy_s() - self.busy) - (_mine_s() - self.mine)) / wall
        return False


BUSY = 0.3  # other processes' load (cores) above which a measurement is retried


def best_of(measure, seconds, load, retries: int, max_wait: float, log):
    """Run measure(); while other processes kept > BUSY cores busy during it, wait for quiet and measure again
    (at most `retries` times). Keeps the fastest result (contention only slows a run down)."""
    res = measure()
    for _ in range(retries):
        if load(res) <= BUSY:
            break
        log(f"  (other load {load(res):.2f} cores: measuring again)")
        wait_idle(max_wait, log=log)
        res = min(res, measure(), key=seconds)
    return res


def wait_idle(max_wait: float, threshold: float = BUSY, log=print) -> float:
    """Wait (up to max_wait s) until other processes use < threshold cores over a 2 s
    window; returns their load."""
    start = time.perf_counter()
    while True:
        with OtherLoad() as ol:
            time.sleep(2.0)
        if ol.cores < threshold or time.perf_counter() - start >= max_wait:
            if time.perf_counter() - start > 3:
                log(f"  (waited {time.perf_counter() - start:.0f} s for other processes; their load now "
                    f"{ol.cores:.2f} cores)")
            return ol.cores


# ---- prompts --------------------------------------------------------------------------------------------
def corpus_tokens(tokenizer, n: int) -> tuple[np.ndarray, int]:
    """n token ids of real English/technical prose (CPython's pydoc topics, always installed; repeated if
    shorter), and the corpus's own length in tokens."""
    import pydoc_data.topics as topics

    text = "\n\n".join(str(v) for v in topics.topics.values())
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
    total = len(ids)
    if total < n:
        ids = np.tile(ids, -(-n // total))
    return ids[:n], total


# ---- vdjax helpers (used in workers and in the main process) -------------------------------------------
def _jax_setup():
    import jax

    jax.config.update("jax_platforms", "cpu")
    return jax


def warm_prefill(params, ids, policy: str, budget: int | None, block: int) -> str:
    """Compile the program a prefill of `ids` uses without running it (`vdjax.engine.api.compile_prefill`)."""
    from vdjax.engine.api import compile_prefill

    compile_prefill(params, ids, policy, budget, block)
    return "compiled ahead of time (compile_prefill)"


def timed_prefill(params, ids, policy: str, budget: int | None, block: int) -> dict:
    """Time one (warm) prefill + the first greedy token on the host (= time to first token)."""
    import jax.numpy as jnp

    import vdjax
    from vdjax.engine.timing import count_compiles

    with OtherLoad() as ol, count_compiles() as compiled:
        t0 = time.perf_counter()
        _, logits = vdjax.prefill(params, ids, policy, budget, block)
        int(np.asarray(jnp.argmax(logits[0])))
        dt = time.perf_counter() - t0
    n = int(np.asarray(ids).shape[-1])
    return {"s": dt, "tok_s": n / dt, "compiled": compiled.value, "other_load": ol.cores}


# ---- subprocess workers ---------------------------------------------------------------------------------
class RssSampler:
    """Highest current RSS seen by a background thread polling every `interval` s (psutil)."""

    def __init__(self, interval: float = 0.01):
        import threading

        import psutil

        self.proc, self.interval, self.peak = psutil.Process(), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        return False


def worker_prefill(a) -> dict:
    """One prompt length in a fresh process: warm + timed prefill for each policy; memory of the first."""
    _jax_setup()
    import psutil

    import vdjax

    params = vdjax.load(a.model)
    out = {"T": a.T, "rss_load_mb": peak_rss_mb(),
           "rss_loaded_mb": psutil.Process().memory_info().rss / 2**20}
    ids = np.load(a.tokens)[: a.T]
    pols = a.policies.split(",")
    for i, pol in enumerate(pols):
        with RssSampler() as rs:
            warm = warm_prefill(params, ids, pol, a.budget, a.block)
            out[pol] = timed_prefill(params, ids, pol, a.budget, a.block) | {"warm": warm}
        out[pol]["runs_s"] = [out[pol]["s"]]
        if i == 0:
            out["rss_peak_mb"] = peak_rss_mb()  # VmHWM: whole process, loading included
            out["rss_prefill_peak_mb"] = rs.peak / 2**20  # sampled max RSS during compile + prefill
    for _ in range(a.reps - 1):  # policies alternate, so a slow spell of the machine hits both
        for pol in pols:
            r = timed_prefill(params, ids, pol, a.budget, a.block)
            runs = out[pol]["runs_s"] + [r["s"]]
            if r["s"] < out[pol]["s"]:
                out[pol] = r | {"warm": out[pol]["warm"]}
            out[pol]["runs_s"] = runs
    return out


def worker_compile(a) -> dict:
    """Prefill at `count` random lengths in [lo, hi] in a fresh process: programs compiled and wall time."""
    _jax_setup()
    import vdjax
    from vdjax.engine.timing import count_compiles

    params = vdjax.load(a.model)
    ids = np.load(a.tokens)
    rng = np.random.default_rng(a.seed)
    lengths = [int(x) for x in rng.integers(a.lo, a.hi + 1, a.count)]
    calls = []
    with OtherLoad() as ol:
        t0 = time.perf_counter()
        for n in lengths:
            s0 = time.perf_counter()
            with count_compiles() as compiled:
                _, lg = vdjax.prefill(params, ids[:n], "valuediff", a.budget, a.block)
                lg.block_until_ready()
            calls.append({"T": n, "s": time.perf_counter() - s0, "compiled": compiled.value})
        wall = time.perf_counter() - t0
    return {"lengths": lengths, "compiled": sum(c["compiled"] for c in calls), "wall_s": wall, "calls": calls,
            "tokens": sum(lengths), "other_load": ol.cores}


def run_worker(args: list[str], log) -> dict:
    """Run `bench.py --worker ...` in a fresh interpreter; its last stdout line is a JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve())] + args
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        log(f"  worker failed ({' '.join(args)}):\n{proc.stderr[-3000:]}")
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- HF transformers ------------------------------------------------------------------------------------
class HF:
    def __init__(self, folder: Path, threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch, self.tf, self.folder = torch, transformers, folder
        self.models = {}

    def model(self, impl: str):
        if impl not in self.models:
            m = self.tf.AutoModelForCausalLM.from_pretrained(str(self.folder), dtype=self.torch.float32,
                                                             attn_implementation=impl)
            self.models[impl] = m.eval()
        return self.models[impl]

    def drop(self, impl: str):
        self.models.pop(impl, None)

    def forward_s(self, impl: str, ids: np.ndarray) -> tuple[float, float]:
        """Seconds of one dense forward (last logits only, the cache built as a prefill does); other load."""
        torch, m = self.torch, self.model(impl)
        x = torch.as_tensor(np.atleast_2d(ids).astype(np.int64))
        with torch.inference_mode(), OtherLoad() as ol:
            t0 = time.perf_counter()
            out = m(input_ids=x, attention_mask=torch.ones_like(x), logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            dt = time.perf_counter() - t0
        del out
        return dt, ol.cores

    def generate_s(self, ids: np.ndarray, new: int) -> tuple[float, float]:
        """Seconds of greedy `generate` producing exactly `new` tokens per row (sdpa model)."""
        torch, m = self.torch, self.model("sdpa")
        x = torch.as_tensor(np.atleast_2d(ids).astype(np.int64))
        with torch.inference_mode(), OtherLoad() as ol:
            t0 = time.perf_counter()
            out = m.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
            dt = time.perf_counter() - t0
        assert out.shape[1] == x.shape[1] + new, out.shape
        return dt, ol.cores


# ---- resumable results ----------------------------------------------------------------------------------
class Store:
    """Measurements saved to a JSON file as they finish, so an interrupted run can go on with --resume
    (only when the settings that shape the measurements are the same)."""

    def __init__(self, path: Path, settings: dict, resume: bool, log):
        self.path, self.settings, self.data, self.reused = path, settings, {}, 0
        if resume and path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("settings") == settings:
                self.data = saved["data"]
                self.reused = len(self.data)
                log(f"resuming: {len(self.data)} measurements from {path}")
            else:
                log(f"not resuming: {path} was made with other settings")

    def get(self, key: str, measure):
        if key not in self.data:
            res = measure()
            if isinstance(res, dict) and "error" in res:
                return res  # not saved: a resumed run tries again
            self.data[key] = res
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"settings": self.settings, "data": self.data},
                                            default=_jsonable))
        return self.data[key]


def _jsonable(x):
    return x.tolist() if isinstance(x, np.ndarray) else str(x)


# ---- formatting -----------------------------------------------------------------------------------------
def md_table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def f1(x, nd=1):
    return "—" if x is None else f"{x:,.{nd}f}"


def fx(x, nd=2):
    return "—" if x is None else f"{x:,.{nd}f}x"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def klabel(t: int) -> str:
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


# ---- the run --------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="registered name or HF checkpoint folder")
    ap.add_argument("--quick", action="store_true", help="small lengths: a smoke run of every section")
    ap.add_argument("--lengths", help="comma-separated prefill lengths (default 1k..32k; --quick 256,512,1k)")
    ap.add_argument("--ttft-lengths",
                    help="comma-separated TTFT lengths (default 4096,8192; --quick 512,1024)")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench" / "bench.md"))
    ap.add_argument("--max-wait", type=float, default=120.0,
                    help="seconds to wait, before each timed section, for other processes to go idle")
    ap.add_argument("--ttft-reps", type=int, default=3,
                    help="timed prefills per policy at the TTFT lengths (alternating policies; the best "
                         "counts)")
    ap.add_argument("--retries", type=int, default=1,
                    help=f"re-measure (keeping the fastest) when other processes used > {BUSY} cores "
                         "meanwhile")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the measurements an interrupted run with the same settings saved "
                         "(<out>.partial.json)")
    ap.add_argument("--skip-hf-eager", action="store_true", help="do not run HF eager attention")
    # worker mode (internal)
    ap.add_argument("--worker", choices=["prefill", "compile"], help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    ap.add_argument("--T", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--policies", default="valuediff", help=argparse.SUPPRESS)
    ap.add_argument("--lo", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--hi", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=1, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


class Run:
    """One benchmark run: its arguments, sizes, prompt tokens, resumable store and the Markdown it emits."""

    def __init__(self, a: argparse.Namespace):
        self.a, self.t_start, self.md = a, time.perf_counter(), []
        self.lengths = ([int(x) for x in a.lengths.split(",")] if a.lengths
                        else list(QUICK_LENGTHS if a.quick else FULL_LENGTHS))
        self.ttft_lengths = ([int(x) for x in a.ttft_lengths.split(",")] if a.ttft_lengths
                             else ([512, 1024] if a.quick else [4096, 8192]))
        self.dec_prompt, self.dec_new, self.dec_batch = (256, 16, 4) if a.quick else (1024, 64, 4)
        self.cc_lo, self.cc_hi, self.cc_count = (200, 700, 5) if a.quick else (1000, 4000, 20)
        self.B, self.N = a.block, a.budget
        self.jax = _jax_setup()
        from vdjax.loading import registry

        self.folder = registry.resolve(a.model)
        self.cores = n_cores()
        tokenizer = registry.load_tokenizer(a.model)
        self.need = max(self.lengths + self.ttft_lengths + [self.cc_hi, self.dec_prompt * self.dec_batch])
        self.ids_all, self.corpus_n = corpus_tokens(tokenizer, self.need)
        self.tok_file = Path(tempfile.mkdtemp(prefix="vdbench-")) / "tokens.npy"
        np.save(self.tok_file, self.ids_all)
        settings = {"model": str(a.model), "quick": a.quick, "lengths": self.lengths,
                    "ttft": self.ttft_lengths, "B": a.block, "N": a.budget, "eager": not a.skip_hf_eager,
                    "tokens": int(self.ids_all.sum() % 1000003)}
        self.store = Store(Path(a.out).with_suffix(".partial.json"), settings, a.resume, self.log)

    def emit(self, text: str = ""):
        print(text, flush=True)
        self.md.append(text)

    def log(self, text: str):
        print(text, file=sys.stderr, flush=True)

    def wait(self):
        wait_idle(self.a.max_wait, log=self.log)

    def best(self, measure, seconds, load, retries=None):
        return best_of(measure, seconds, load, self.a.retries if retries is None else retries,
                       self.a.max_wait, self.log)


def header(r: Run) -> None:
    """Machine, versions, model and settings."""
    import torch
    import transformers

    jax, a, cores = r.jax, r.a, r.cores
    tot_gb, avail_gb = mem_total_available_gb()
    r.emit(f"# vdjax benchmark — {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}")
    r.emit()
    r.emit(f"- machine: {cores} cores ({cpu_model()}), {tot_gb:.1f} GiB RAM ({avail_gb:.1f} available at "
           f"start), {platform.system()} {platform.release()}, Python {platform.python_version()}")
    r.emit(f"- versions: jax {jax.__version__} (backend {jax.default_backend()}, {jax.device_count()} "
           f"device), torch {torch.__version__}, transformers {transformers.__version__}, "
           f"numpy {np.__version__}")
    r.emit(f"- vdjax tree: {git_state()}")
    r.emit(f"- model: `{a.model}` → `{r.folder}` (fp32); prompts: CPython pydoc topics text tokenized with "
           f"the model's tokenizer ({r.corpus_n} tokens; "
           f"{'repeated to reach' if r.corpus_n < r.need else 'enough for'} the {r.need} needed)")
    r.emit(f"- threads: XLA:CPU sizes its intra-op pool to the {cores} visible cores; HF runs with "
           f"torch.set_num_threads({cores})")
    r.emit(f"- vdjax settings: block B={r.B}, budget N={r.N}; all vdjax timings warm (program compiled "
           f"first, checked: the timed call compiled nothing unless noted)")
    r.emit(f"- mode: {'--quick' if a.quick else 'full'}; 'other load' = cores kept busy by *other* processes "
           f"during a measurement (the machine is shared; above {BUSY} a measurement is repeated up to "
           f"{a.retries} time(s) after waiting for quiet, keeping the fastest; a remaining high value means "
           f"the number is pessimistic)")
    r.emit()


def bandwidth(r: Run) -> dict:
    """Section 6's measurement, made first: host read bandwidth over a 1 GiB fp32 array."""
    jax = r.jax

    def measure() -> dict:
        r.log("[6] host memory bandwidth ...")
        r.wait()
        arr = np.ones(2**28, np.float32)  # 1 GiB
        jarr = jax.numpy.asarray(arr)
        jsum = jax.jit(jax.numpy.sum)
        jsum(jarr).block_until_ready()
        fns = {"numpy sum, 1 thread": arr.sum, "numpy max, 1 thread": arr.max,
               f"jax.jit(jnp.sum), XLA on {r.cores} cores": lambda: jsum(jarr).block_until_ready()}
        out = {}
        for name, fn in fns.items():
            best = 1e9
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out[name] = arr.nbytes / best / 1e9
        return out

    return r.store.get("bandwidth", measure)


def vdjax_prefill(r: Run) -> dict[int, dict]:
    """Block prefill per length, one fresh process each (valuediff; + streaming at the TTFT lengths)."""
    a = r.a
    r.log("[1,3,4] vdjax block prefill, one fresh process per length ...")
    pf: dict[int, dict] = {}
    for T in sorted(set(r.lengths) | set(r.ttft_lengths)):
        pols = "valuediff,streaming" if T in r.ttft_lengths else "valuediff"
        reps = a.ttft_reps if T in r.ttft_lengths else 1
        t0 = time.perf_counter()
        argv = ["--worker", "prefill", "--model", str(a.model), "--tokens", str(r.tok_file), "--T", str(T),
                "--policies", pols, "--block", str(r.B), "--budget", str(r.N), "--reps", str(reps)]

        def measure(argv=argv, pols=pols):
            r.wait()
            return r.best(lambda: run_worker(argv, r.log),
                          lambda x: x.get("valuediff", {}).get("s", math.inf),
                          lambda x: max((x[p_]["other_load"] for p_ in pols.split(",") if p_ in x),
                                        default=0.0))

        res = r.store.get(f"prefill:{T}:{pols}" + (f":x{reps}" if reps > 1 else ""), measure)
        pf[T] = res
        vd = res.get("valuediff", {})
        r.log(f"  T={T}: {f1(vd.get('tok_s'))} tok/s, peak RSS {f1(res.get('rss_prefill_peak_mb'), 0)} MB, "
              f"process {time.perf_counter() - t0:.0f} s"
              + (f", streaming {f1(res['streaming']['tok_s'])} tok/s" if "streaming" in res else ""))
    return pf


def hf_prefill(r: Run, hf: HF, heads: int) -> dict[str, dict[int, tuple]]:
    """HF's dense forward (last logits only) per length and attention implementation: (seconds, other
    load), or (None, why skipped)."""
    r.log("[1] HF transformers dense forward ...")
    out: dict[str, dict[int, tuple]] = {}
    for impl in r.impls:
        out[impl] = {}
        warmed = False
        done: list[tuple[int, float]] = []
        for T in sorted(r.lengths):

            def measure(T=T, impl=impl, done=done):
                nonlocal warmed
                _, avail = mem_total_available_gb()
                attn_gb = heads * T * T * 4 / 2**30
                if impl == "eager" and 3 * attn_gb > 0.6 * avail:
                    return (None, f"skipped (eager materializes [{heads}, T, T] fp32 attention: "
                                  f"{attn_gb:.1f} GiB x ~3 copies vs {avail:.1f} GiB available: OOM risk)")
                if done:
                    (t1, s1) = done[-1]
                    # attention's share grows with T: assume at least T^1.5 growth (measured exponent,
                    # clipped)
                    e = 1.5
                    if len(done) >= 2:
                        e = min(2.0, max(1.5, math.log(s1 / done[-2][1]) / math.log(t1 / done[-2][0])))
                    pred = s1 * (T / t1) ** e
                    if pred > HF_TIME_LIMIT_S:
                        return (None, f"skipped (predicted {pred:.0f} s > {HF_TIME_LIMIT_S:.0f} s limit)")
                r.wait()
                if not warmed:
                    hf.forward_s(impl, r.ids_all[:256])  # first-call overheads
                    warmed = True
                s, ol = r.best(lambda: hf.forward_s(impl, r.ids_all[:T]), lambda x: x[0], lambda x: x[1],
                               r.a.retries if T <= 8192 else 0)
                r.log(f"  {impl} T={T}: {T / s:.1f} tok/s ({s:.1f} s, other load {ol:.2f})")
                return (s, ol)

            out[impl][T] = r.store.get(f"hf:{impl}:{T}", measure)
            if out[impl][T][0] is not None:
                done.append((T, out[impl][T][0]))
        if impl == "eager":
            hf.drop("eager")
    return out


def prefill_table(r: Run, pf: dict, hf_pf: dict) -> None:
    """Section 1: block prefill tok/s against HF."""
    r.emit("## 1. Block prefill throughput (tokens/s, warm)")
    r.emit()
    r.emit(f"vdjax `prefill(policy='valuediff', budget={r.N}, block_size={r.B})` vs HF `model(ids, "
           f"logits_to_keep=1)` (dense, fp32, {r.cores} threads). Ratio = vdjax / HF sdpa (HF's fastest "
           f"path).")
    r.emit()
    rows = []
    for T in sorted(r.lengths):
        vd = pf[T].get("valuediff", {})
        cells = [klabel(T), f1(vd.get("tok_s")), f1(vd.get("s"), 2)]
        for impl in r.impls:
            s, info = hf_pf[impl][T]
            cells.append(f1(T / s) if s else info)
        hs = hf_pf["sdpa"][T][0]
        cells.append(fx(ratio(vd.get("tok_s"), T / hs if hs else None)))
        ol = [vd.get("other_load")] + [hf_pf[i][T][1] for i in r.impls if hf_pf[i][T][0]]
        cells.append(" / ".join(f1(x, 2) for x in ol if x is not None))
        cells.append(vd.get("compiled", "?") if vd else pf[T].get("error", "?"))
        rows.append(cells)
    r.emit(md_table(["T", "vdjax tok/s", "vdjax s", "HF sdpa tok/s"]
                    + (["HF eager tok/s"] if "eager" in r.impls else [])
                    + ["vdjax / HF sdpa", "other load (vdjax / HF)", "compiles in timed call"], rows))
    warm_how = {pf[T].get("valuediff", {}).get("warm", "?") for T in r.lengths}
    r.emit()
    r.emit(f"Warm-up: {'; '.join(sorted(warm_how))}. Lengths also in section 4 show the best of "
           f"{r.a.ttft_reps} timed runs, the others one run.")
    r.emit()


def vdjax_decode(r: Run) -> dict:
    """Decode tok/s of vdjax: valuediff at N, dense, valuediff at the dense cache size, a batch."""
    import vdjax

    r.log("[2] decode ...")
    params = vdjax.load(r.a.model)
    p1 = r.ids_all[:r.dec_prompt]
    pb = np.stack([r.ids_all[i * r.dec_prompt:(i + 1) * r.dec_prompt] for i in range(r.dec_batch)])

    def measure(ids, policy, budget):
        kw = dict(block_size=r.B, max_new_tokens=r.dec_new, eos_token_id=[])
        rows_ = np.atleast_2d(ids).shape[0]

        def once():
            with OtherLoad() as ol:
                g = vdjax.run(params, ids, policy, budget, **kw)
            assert g.tokens.shape == (rows_, r.dec_new), g.tokens.shape
            return {"tok_s": rows_ * g.steps / g.decode_s, "decode_s": g.decode_s, "steps": g.steps,
                    "ttft_s": g.prefill_s, "slots": int(g.cache.budget), "other_load": ol.cores,
                    "tokens": g.tokens}

        def go():
            r.wait()
            vdjax.run(params, ids, policy, budget, **kw)  # compile prefill + decode programs
            return r.best(once, lambda x: x["decode_s"], lambda x: x["other_load"])
        return go

    dec = {"vd": r.store.get("decode:vd", measure(p1, "valuediff", r.N)),
           "dense": r.store.get("decode:dense", measure(p1, "dense", None))}
    dec["vd_same"] = r.store.get("decode:vd_same", measure(p1, "valuediff", dec["dense"]["slots"]))
    dec["vd_b"] = r.store.get("decode:vd_b", measure(pb, "valuediff", r.N))
    for k, v in dec.items():
        r.log(f"  vdjax {k}: {v['tok_s']:.2f} tok/s (slots {v['slots']}, other load {v['other_load']:.2f})")
    return dec


def hf_decode(r: Run, hf: HF) -> dict:
    """HF `generate` decode tok/s at batch 1 and the decode batch."""
    p1 = r.ids_all[:r.dec_prompt]
    pb = np.stack([r.ids_all[i * r.dec_prompt:(i + 1) * r.dec_prompt] for i in range(r.dec_batch)])
    out, warm = {}, []
    for name, ids in (("b1", p1), ("b4", pb)):
        rows_ = np.atleast_2d(ids).shape[0]

        def once(ids=ids, rows_=rows_):
            if not warm:
                hf.generate_s(r.ids_all[:64], 4)  # first-call overheads
                warm.append(True)
            s1, o1 = hf.generate_s(ids, 1)
            sn, on = hf.generate_s(ids, r.dec_new)
            return {"tok_s": rows_ * (r.dec_new - 1) / (sn - s1), "ttft_s": s1, "total_s": sn,
                    "other_load": max(o1, on)}

        def measure(once=once):
            r.wait()
            return r.best(once, lambda x: -x["tok_s"], lambda x: x["other_load"])

        out[name] = r.store.get(f"hf_generate:{name}", measure)
        r.log(f"  HF generate {name}: {out[name]['tok_s']:.2f} tok/s")
    return out


def decode_table(r: Run, dec: dict, hf_dec: dict, ceil) -> None:
    """Section 2: decode tok/s against HF and the bandwidth ceiling."""
    N, new, prompt, batch = r.N, r.dec_new, r.dec_prompt, r.dec_batch
    dense_slots = dec["dense"]["slots"]
    r.emit("## 2. Decode throughput (tokens/s, greedy, EOS disabled, warm)")
    r.emit()
    r.emit(f"Prompt {prompt} tokens, {new} new tokens = {new - 1} decode steps (the first token comes "
           f"from the prefill logits, as in HF). vdjax: `Generation.steps / decode_s`; HF `generate` "
           f"(sdpa, min_new_tokens={new}): (rows x {new - 1}) / (t({new} new) - t(1 new)). "
           f"Ceiling = rows x bandwidth / (weight bytes + KV bytes read per step), bandwidth from section 6.")
    r.emit()

    def row(label, d, rows, ref):
        return [label, rows, d["slots"], f1(d["tok_s"], 2), f1(ceil(d["slots"], rows)),
                fx(ratio(d["tok_s"], ref["tok_s"])), f1(d["ttft_s"], 2), f1(d["other_load"], 2)]

    def hf_row(d, rows):
        return ["HF generate (dense, sdpa)", rows, f"{prompt}+{new}", f1(d["tok_s"], 2),
                f1(ceil(prompt + new, rows)), "1.0x", f1(d["ttft_s"], 2), f1(d["other_load"], 2)]

    rows = [row(f"vdjax valuediff N={N}", dec["vd"], 1, hf_dec["b1"]),
            row("vdjax dense (cache = padded prompt + new)", dec["dense"], 1, hf_dec["b1"]),
            row(f"vdjax valuediff N={dense_slots} (>= T+new: no eviction)", dec["vd_same"], 1, hf_dec["b1"]),
            hf_row(hf_dec["b1"], 1),
            row(f"vdjax valuediff N={N}", dec["vd_b"], batch, hf_dec["b4"]),
            hf_row(hf_dec["b4"], batch)]
    r.emit(md_table(["engine", "batch", "cache slots/head", "decode tok/s (all rows)",
                     "bandwidth ceiling tok/s", "vs HF (same batch)", "TTFT s", "other load"], rows))
    r.emit()
    same_tokens = bool(np.array_equal(dec["vd_same"]["tokens"], dec["dense"]["tokens"]))
    r.emit(f"- valuediff N={N} / dense: {f1(ratio(dec['vd']['tok_s'], dec['dense']['tok_s']), 2)}x; "
           f"valuediff N={dense_slots} / dense (same cache size): "
           f"{f1(ratio(dec['vd_same']['tok_s'], dec['dense']['tok_s']), 2)}x; "
           f"valuediff N={dense_slots} tokens == dense tokens: {same_tokens}")
    r.emit()


def rss_table(r: Run, pf: dict) -> float | None:
    """Section 3: peak RSS per prefill length; returns RSS(longest) / RSS(4k or shortest)."""
    r.emit("## 3. Peak RSS of a vdjax block prefill (fresh process per T)")
    r.emit()
    r.emit(f"One process per T loads the model, compiles and prefills T tokens (valuediff, N={r.N}, "
           f"B={r.B}). 'peak' columns are the process's own high-water mark (VmHWM; `ru_maxrss` would "
           "include the parent's RSS at fork), loading included; 'sampled peak' is the highest RSS a 10 ms "
           "psutil poller saw during compile + prefill, the number the ratio uses (loading can peak higher "
           "and hide the prefill).")
    r.emit()
    rows = []
    ref_rss = pf[min(r.lengths)].get("rss_prefill_peak_mb")
    for T in sorted(r.lengths):
        x = pf[T]
        inc = None if x.get("rss_prefill_peak_mb") is None else x["rss_prefill_peak_mb"] - x["rss_loaded_mb"]
        rows.append([klabel(T), f1(x.get("rss_load_mb"), 0), f1(x.get("rss_loaded_mb"), 0),
                     f1(x.get("rss_prefill_peak_mb"), 0), f1(inc, 0), f1(x.get("rss_peak_mb"), 0),
                     fx(ratio(x.get("rss_prefill_peak_mb"), ref_rss), 3)])
    r.emit(md_table(["T", "peak after load MB", "RSS after load MB", "sampled peak during prefill MB",
                     "prefill increment MB", "peak at end MB", f"sampled peak vs T={klabel(min(r.lengths))}"],
                    rows))
    r.rss_hi = max(r.lengths)
    r.rss_lo = 4096 if 4096 in r.lengths and 4096 < r.rss_hi else min(r.lengths)
    rss_ratio = ratio(pf[r.rss_hi].get("rss_prefill_peak_mb"), pf[r.rss_lo].get("rss_prefill_peak_mb"))
    rss_ratio_ru = ratio(pf[r.rss_hi].get("rss_peak_mb"), pf[r.rss_lo].get("rss_peak_mb"))
    r.emit()
    r.emit(f"RSS({klabel(r.rss_hi)}) / RSS({klabel(r.rss_lo)}) = {fx(rss_ratio, 3)} (sampled peak), "
           f"{fx(rss_ratio_ru, 3)} (process peak, VmHWM)")
    r.emit()
    return rss_ratio


def ttft_table(r: Run, pf: dict) -> dict[int, float | None]:
    """Section 4: valuediff vs streaming time to first token; returns their ratio per length."""
    r.emit("## 4. Time to first token: ValueDiff vs StreamingLLM (warm, same process, same prompt)")
    r.emit()
    r.emit(f"Prefill + greedy first token, B={r.B}, N={r.N}; best of {r.a.ttft_reps} timed runs per policy, "
           f"the policies alternating (all runs listed).")
    r.emit()
    rows, ratios = [], {}
    for T in r.ttft_lengths:
        vd, st = pf[T].get("valuediff", {}), pf[T].get("streaming", {})
        ratios[T] = ratio(vd.get("s"), st.get("s"))
        runs = lambda d: ", ".join(f"{x:.2f}" for x in d.get("runs_s", []))  # noqa: E731
        rows.append([klabel(T), f1(vd.get("s"), 2), f1(st.get("s"), 2), fx(ratios[T], 3),
                     f"{runs(vd)} / {runs(st)}",
                     f"{f1(vd.get('other_load'), 2)} / {f1(st.get('other_load'), 2)}"])
    r.emit(md_table(["T", "valuediff s", "streaming s", "valuediff / streaming", "all runs s (vd / st)",
                     "other load of the best (vd / st)"], rows))
    r.emit()
    return ratios


def compile_section(r: Run) -> dict:
    """Section 5: programs compiled over random prompt lengths (a fresh process)."""
    r.log("[5] compile count over random lengths (fresh process) ...")

    def measure():
        r.wait()
        return run_worker(["--worker", "compile", "--model", str(r.a.model), "--tokens", str(r.tok_file),
                           "--lo", str(r.cc_lo), "--hi", str(r.cc_hi), "--count", str(r.cc_count), "--block",
                           str(r.B), "--budget", str(r.N)], r.log)

    cc = r.store.get("compile", measure)
    r.emit(f"## 5. Compiled programs over {r.cc_count} random prompt lengths in [{r.cc_lo}, {r.cc_hi}]")
    r.emit()
    if "error" in cc:
        r.emit(f"failed: {cc['error']}")
    else:
        comp_s = sum(c["s"] for c in cc["calls"] if c["compiled"])
        r.emit(f"prefill(valuediff, N={r.N}, B={r.B}) in a fresh process, programs counted with "
               "`vdjax.engine.timing.count_compiles`.")
        r.emit()
        fast = [c for c in cc["calls"] if not c["compiled"]]
        r.emit(md_table(["calls", "programs compiled", "total wall s", "calls that compiled: s",
                         "other calls: tok/s", "other load"],
                        [[r.cc_count, cc["compiled"], f1(cc["wall_s"]), f1(comp_s),
                          f1(sum(c["T"] for c in fast) / max(1e-9, sum(c["s"] for c in fast))),
                          f1(cc["other_load"], 2)]]))
        r.emit()
        r.emit("lengths in call order: " + ", ".join(
            f"{c['T']}{'*' if c['compiled'] else ''}" for c in cc["calls"]) + "  (* = compiled a program)")
    r.emit()
    return cc


def bandwidth_table(r: Run, bws: dict, weight_bytes: int, kv_bytes, ceil, dense_slots: int,
                    hf_dec: dict) -> None:
    """Section 6: the numbers the ceilings come from."""
    N, batch = r.N, r.dec_batch
    r.emit("## 6. Memory-bandwidth context")
    r.emit()
    r.emit(md_table(["quantity", "value"], [
        *[[f"host read bandwidth over a 1 GiB fp32 array: {k}", f"{v:.1f} GB/s"] for k, v in bws.items()],
        ["bandwidth used for the ceilings (best of the above)", f"{max(bws.values()):.1f} GB/s"],
        ["weight bytes (fp32, all params; the tied LM head reads the embedding every step)",
         f"{weight_bytes / 1e6:.0f} MB"],
        [f"KV cache bytes read per step, N={N} / dense {dense_slots} slots",
         f"{kv_bytes(N) / 1e6:.1f} MB / {kv_bytes(dense_slots) / 1e6:.1f} MB"],
        [f"decode ceiling, batch 1 (bandwidth / (weights + KV N={N}))", f"{ceil(N):.1f} tok/s"],
        [f"decode ceiling, batch {batch}", f"{ceil(N, batch):.1f} tok/s"],
        ["HF generate batch 1 as a fraction of that ceiling",
         f"{hf_dec['b1']['tok_s'] / ceil(r.dec_prompt + r.dec_new):.0%}"],
    ]))
    r.emit()


def targets_table(r: Run, pf, hf_pf, dec, hf_dec, rss_ratio, ttft_ratios) -> None:
    """The targets with PASS/FAIL."""
    def verdict(ok):
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    t_pf = 8192 if 8192 in r.lengths else max(r.lengths)
    hs = hf_pf["sdpa"][t_pf][0]
    pf_ratio = ratio(pf[t_pf].get("valuediff", {}).get("tok_s"), t_pf / hs if hs else None)
    dec_hf = ratio(dec["vd"]["tok_s"], hf_dec["b1"]["tok_s"])
    dec_dense = ratio(dec["vd_same"]["tok_s"], dec["dense"]["tok_s"])
    dense_slots = dec["dense"]["slots"]
    targets = [
        [f"block prefill at {klabel(t_pf)} >= 2x HF dense (sdpa)", fx(pf_ratio),
         verdict(None if pf_ratio is None else pf_ratio >= 2)],
        [f"decode (valuediff N={r.N}) >= 3x HF generate", fx(dec_hf), verdict(dec_hf >= 3)],
        [f"decode >= 0.85x vdjax dense at the same cache size ({dense_slots} slots)", fx(dec_dense),
         verdict(dec_dense >= 0.85)],
        [f"RSS at {klabel(r.rss_hi)} <= 1.1x RSS at {klabel(r.rss_lo)}", fx(rss_ratio, 3),
         verdict(None if rss_ratio is None else rss_ratio <= 1.1)],
    ]
    for T in r.ttft_lengths:
        x = ttft_ratios[T]
        targets.append([f"ValueDiff TTFT <= 1.03x streaming at {klabel(T)}", fx(x, 3),
                        verdict(None if x is None else x <= 1.03)])
    r.emit("## Targets")
    r.emit()
    r.emit(md_table(["target", "measured", "verdict"], targets))
    r.emit()


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        print(json.dumps(worker_prefill(a) if a.worker == "prefill" else worker_compile(a)))
        return
    r = Run(a)
    header(r)
    bws = bandwidth(r)
    bw = max(bws.values())
    import vdjax

    params = vdjax.load(a.model)
    cfg, weight_bytes = params.config, params.nbytes()
    del params  # the workers and HF load their own copies
    kv_bytes = lambda slots, rows=1: 2 * cfg.num_layers * rows * cfg.num_kv_heads * slots * cfg.head_dim * 4  # noqa
    ceil = lambda slots, rows=1: rows * bw * 1e9 / (weight_bytes + kv_bytes(slots, rows))  # noqa: E731
    r.impls = ["sdpa"] + ([] if a.skip_hf_eager else ["eager"])
    pf = vdjax_prefill(r)
    hf = HF(r.folder, r.cores)
    hf_pf = hf_prefill(r, hf, cfg.num_heads)
    prefill_table(r, pf, hf_pf)
    dec = vdjax_decode(r)
    hf_dec = hf_decode(r, hf)
    decode_table(r, dec, hf_dec, ceil)
    rss_ratio = rss_table(r, pf)
    ttft_ratios = ttft_table(r, pf)
    cc = compile_section(r)
    bandwidth_table(r, bws, weight_bytes, kv_bytes, ceil, dec["dense"]["slots"], hf_dec)
    targets_table(r, pf, hf_pf, dec, hf_dec, rss_ratio, ttft_ratios)
    r.emit(f"Total wall time: {(time.perf_counter() - r.t_start) / 60:.1f} min"
           + (f" (this invocation; {r.store.reused} measurements reused from an earlier run via --resume)."
              if r.store.reused else "."))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(r.md) + "\n")
    raw = {"prefill": {str(k): v for k, v in pf.items()},
           "hf_prefill": {i: {str(t): v for t, v in d.items()} for i, d in hf_pf.items()},
           "decode": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in dec.items()},
           "hf_decode": hf_dec, "compile": cc, "bandwidth": bws | {"weights": weight_bytes}}
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str))
    r.log(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()

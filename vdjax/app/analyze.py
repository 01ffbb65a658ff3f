"""`vdjax analyze`: KV-geometry tables and figures of one model, hybrid mixes, and the all-models scatter.

Writes under OUT/<model>/: geometry.json (every per-head statistic), layers.csv, heads.csv, summary.md,
sigma_per_layer.png, sink_rate_per_layer.png, ratio_per_layer.png, bos_cos_per_layer.png,
jaccard_per_layer.png, hybrid-geometry.json (and hybrid-fitted.json with --fit); and under OUT/:
models.md, models.csv and figure1.png (sink rate vs sigma_v/sigma_k of every model analysed into OUT so far,
next to the paper's Table 4 models).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vdjax.analysis import geometry as G
from vdjax.analysis import hybrid as HY
from vdjax.checks import check_int

AGG_COLUMNS = ("sink_rate", "learned_sink", "sigma_k", "sigma_v", "ratio", "bos_attn", "bos_cos", "w_ratio",
               "s1_ratio", "jaccard", "jaccard_std")
LAYER_COLUMNS = ("sigma_k", "sigma_k_std", "sigma_v", "sigma_v_std", "ratio", "sink_rate", "learned_sink",
                 "bos_attn", "bos_cos", "w_ratio", "s1_ratio", "jaccard")
LABELS = {"sink_rate": "sink rate", "sigma_k": "σK", "sigma_v": "σV", "ratio": "σV/σK", "bos_attn": "ᾱ_BOS",
           "bos_cos": "BOS key cos", "w_ratio": "‖W_V‖/‖W_K‖", "s1_ratio": "σ1(V)/σ1(K)",
           "jaccard": "top-k Jaccard", "jaccard_std": "Jaccard std (layers)",
          "learned_sink": "learned-sink mass"}


def fmt(x: Any, digits: int = 3) -> str:
    """A number for a table (blank for missing)."""
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return ""
    return f"{x:.{digits}f}" if isinstance(x, (float, np.floating)) else str(x)


def interleave(prompts: Sequence) -> list:
    """Prompts reordered round-robin over their categories (so any prefix spans every category)."""
    groups: dict[str, list] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    out, i = [], 0
    while len(out) < len(prompts):
        out.extend(g[i] for g in groups.values() if i < len(g))
        i += 1
    return out


def slug(model: str) -> str:
    """A folder name for a model given as a registered name or a path."""
    return Path(str(model).rstrip("/")).name or "model"


# ---- files of one model ---------------------------------------------------------------------------------
def write_model(geo: G.Geometry, folder: Path, extra_md: str = "") -> dict[str, Path]:
    """Write geometry.json, layers.csv, heads.csv, summary.md and the per-layer figures into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "geometry.json", "layers": folder / "layers.csv", "heads": folder / "heads.csv",
             "md": folder / "summary.md"}
    paths["json"].write_text(json.dumps(geo.to_json(), indent=1))
    pl = geo.per_layer()
    with open(paths["layers"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("layer", "window") + LAYER_COLUMNS)
        for i in range(len(geo.windows)):
            w.writerow([i, geo.windows[i] or ""] + [fmt(float(pl[c][i]), 6) for c in LAYER_COLUMNS])
    with open(paths["heads"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("layer", "kind", "head", "statistic", "value"))
        for name, arr in geo.heads.items():
            kind = "kv" if name in G.HEAD_FIELDS else "query"
            for i, row in enumerate(arr):
                for h, x in enumerate(row):
                    w.writerow([i, kind, h, name, fmt(float(x), 6)])
    agg = geo.aggregate()
    lines = [f"# KV geometry: {geo.model}", "",
             f"{len(geo.prompts)} prompts ({', '.join(sorted({p['category'] for p in geo.prompts}))}), "
             f"{min(p['tokens'] for p in geo.prompts)}-{max(p['tokens'] for p in geo.prompts)} tokens; "
             f"τ = {geo.settings['tau']}, top-{geo.settings['topk']} Jaccard over "
             f"{geo.settings['n_queries']} query positions on {geo.settings['jaccard_prompts']} prompts."
             + ("" if all(geo.measured(i) for i in range(len(geo.windows))) else
                f" Statistics over the {sum(geo.measured(i) for i in range(len(geo.windows)))} attention "
                f"layers only: the Gated DeltaNet layers have no keys, no attention and no KV cache."), "",
             "| " + " | ".join(LABELS[c] for c in AGG_COLUMNS) + " |",
             "|" + "---|" * len(AGG_COLUMNS),
             "| " + " | ".join(fmt(agg[c]) for c in AGG_COLUMNS) + " |", "",
             "## Per layer", "",
             "| layer | window | σK | σV | σV/σK | sink rate | learned-sink mass | ᾱ_BOS | BOS key cos | "
             "‖W_V‖/‖W_K‖ | σ1(V)/σ1(K) | Jaccard |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i in range(len(geo.windows)):
        cells = [pl[c][i] for c in ("sigma_k", "sigma_v", "ratio", "sink_rate", "learned_sink", "bos_attn",
                                    "bos_cos", "w_ratio", "s1_ratio", "jaccard")]
        kind = (geo.windows[i] or "global") if geo.measured(i) else "Gated DeltaNet (no KV cache)"
        lines.append(f"| {i} | {kind} | " + " | ".join(fmt(float(x)) for x in cells) + " |")
    paths["md"].write_text("\n".join(lines) + "\n" + extra_md)
    paths.update(_layer_figures(geo, folder))
    return paths


def _layer_figures(geo: G.Geometry, folder: Path) -> dict[str, Path]:
    """Per-layer PNGs: sigma_k/sigma_v (head-std error bars), sink rate, sigma_v/sigma_k, BOS cos, Jaccard."""
    from matplotlib.figure import Figure  # no pyplot: a library call never switches the user's backend

    pl, x = geo.per_layer(), np.arange(len(geo.windows))
    out = {}

    def figure(name, draw, ylabel, hline=None):
        fig = Figure(figsize=(7, 3.2))
        ax = fig.subplots()
        draw(ax)
        if hline is not None:
            ax.axhline(hline, color="k", ls="--", lw=0.8)
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{geo.model}: {ylabel} per layer", fontsize=10)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=120)
        out[name] = path

    def sigmas(ax):
        ax.errorbar(x, pl["sigma_k"], yerr=pl["sigma_k_std"], fmt="o-", color="grey", ms=3, capsize=2,
                    label="σK")
        ax.errorbar(x, pl["sigma_v"], yerr=pl["sigma_v_std"], fmt="o-", color="C0", ms=3, capsize=2,
                    label="σV")
        ax.legend(fontsize=8)

    figure("sigma_per_layer", sigmas, "σK, σV")
    figure("sink_rate_per_layer", lambda ax: ax.plot(x, pl["sink_rate"], "o-", ms=3),
           f"sink rate (τ={geo.settings['tau']})")
    figure("ratio_per_layer", lambda ax: ax.plot(x, pl["ratio"], "o-", ms=3), "σV/σK", hline=1.0)
    figure("bos_cos_per_layer", lambda ax: ax.plot(x, pl["bos_cos"], "o-", ms=3), "BOS key cosine", hline=0.0)
    if np.isfinite(pl["jaccard"]).any():
        figure("jaccard_per_layer", lambda ax: ax.plot(x, pl["jaccard"], "o-", ms=3),
               f"top-{geo.settings['topk']} Jaccard")
    return out


# ---- every model analysed so far ------------------------------------------------------------------------
def collect(out: Path) -> list[G.Geometry]:
    """Every OUT/*/geometry.json, sorted by model name."""
    found = []
    for path in sorted(Path(out).glob("*/geometry.json")):
        try:
            found.append(G.Geometry.from_json(json.loads(path.read_text())))
        except (ValueError, KeyError, json.JSONDecodeError):
            continue  # not ours, or half-written by a crashed run: skip it
    return found


def write_models(out: Path, paper: bool = True) -> dict[str, Path]:
    """OUT/models.md, models.csv (every analysed model, then the paper's rows) and figure1.png."""
    out = Path(out)
    geos = collect(out)
    rows = [{"model": g.model, "source": "vdjax", **g.aggregate()} for g in geos]
    if paper:
        for name, values in G.PAPER.items():
            rec = dict(zip(G.PAPER_COLUMNS, values, strict=True))
            rows.append({"model": name, "source": "paper",
                         **{k: (np.nan if v is None else v) for k, v in rec.items()}})
    paths = {"csv": out / "models.csv", "md": out / "models.md", "png": out / "figure1.png"}
    cols = ("model", "source", "mechanism") + AGG_COLUMNS
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            w.writerow([fmt(r.get(c)) for c in cols])
    md = ["| model | source | " + " | ".join(LABELS[c] for c in AGG_COLUMNS) + " |",
          "|---|---|" + "---|" * len(AGG_COLUMNS)]
    md += ["| " + " | ".join([r["model"], r["source"]] + [fmt(r.get(c)) for c in AGG_COLUMNS]) + " |"
           for r in rows]
    paths["md"].write_text("\n".join(md) + "\n")
    _scatter(rows, paths["png"])
    return paths


def _scatter(rows: list[dict], path: Path) -> None:
    """Figure 1: sink rate (x) vs sigma_v/sigma_k (y), the value-dominant region (y > 1) shaded."""
    from matplotlib.figure import Figure  # no pyplot: a library call never switches the user's backend

    fig = Figure(figsize=(6, 4.2))
    ax = fig.subplots()
    ax.axhspan(1.0, 10, color="C2", alpha=0.08, lw=0)
    ax.axhline(1.0, color="k", ls="--", lw=0.8)
    for r in rows:
        ours = r["source"] == "vdjax"
        ax.scatter(r["sink_rate"], r["ratio"], s=46 if ours else 30, marker="o" if ours else "s",
                   facecolors="C3" if ours else "none", edgecolors="C3" if ours else "grey", zorder=3)
        ax.annotate(r["model"], (r["sink_rate"], r["ratio"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points", color="k" if ours else "grey")
    top = max([1.8] + [r["ratio"] + 0.2 for r in rows if np.isfinite(r["ratio"])])
    ax.set_ylim(0, top)
    ax.set_xlim(-0.05, 1.0)
    ax.set_xlabel("sink rate (τ = 0.3)")
    ax.set_ylabel("σV / σK")
    ax.set_title("Sink rate vs σV/σK (filled: measured by vdjax; grey squares: paper, Table 4)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# ---- selection on held-out RULER samples -------------------------------------------------------------------
SELECT_ON = ("retrieval", "ruler")  # the end-to-end selection objectives of `analyze_model`
VALIDATION_SEED = 1  # not RULER's 42: other needles, chains and word lists than the scored samples


def validation_tasks() -> tuple[str, ...]:
    """RULER's tasks but qa_1/qa_2: their questions go by sample index whatever the seed, so held-out seeds
    would re-ask the scored questions."""
    from vdjax.eval import ruler

    return tuple(t for t in ruler.TASKS if not t.startswith("qa"))


def selection_objective(prior: str | None, level: float = 0.95) -> str:
    """`select_on_ruler`'s objective in words, as the mix JSON records it."""
    return "mean RULER score (greedy, paper protocol)" + (
        "" if prior is None
        else f"; {prior} unless beaten beyond the paired {100 * level:g} % bootstrap interval")


def select_on_ruler(params, tokenizer, candidates: dict[str, Any], *, model_name: str, budget: int, out_dir,
                    block: int = 128, length: int = 2048, samples: int = 2, seed: int = VALIDATION_SEED,
                    tasks: Sequence[str] | None = None, batch_size: int = 10, prior: str | None = None,
                    level: float = 0.95, allow_mixed: bool = False,
                    progress: bool = False) -> tuple[str, dict[str, float], dict[str, Any]]:
    """The candidate mix [L, K] that wins on held-out RULER samples (`samples` per task of `tasks`, default
    `validation_tasks()`, drawn with `seed`, paper protocol, greedy, block eviction at `budget`) -> (name,
    {name: mean score}, detail). Each candidate's generations are a resumable run under out_dir/<name>/
    (`vdjax.eval.runner.evaluate`, policy hybrid with that mix); a candidate with the same weights as
    an earlier one shares its run.

    The winner is the highest mean score (ties: the first candidate). With `prior` (a candidate's name, e.g.
    the geometry rule) that candidate stays unless the highest beats it on the same samples beyond their
    noise: the lower end of the paired bootstrap `level` interval of (highest - prior)
    (`report.paired_difference`, samples resampled within each task) must lie above 0. A few dozen samples a
    task cannot separate candidates a point or two apart (Gemma3-270M at N=1024: ValueDiff 0.190, KeyDiff
    0.190), and picking the noise is no fit. detail: {"highest", "prior", "difference": [points, low, high] of
    highest - prior or None, "level"}. `allow_mixed` resumes onto lines of another fingerprint
    (`runner.evaluate`)."""
    from vdjax.eval import records, ruler, runner
    from vdjax.eval.report import paired_difference

    if not candidates:
        raise ValueError("select_on_ruler needs at least one candidate mix")
    if seed == ruler.SEED:
        raise ValueError(f"seed={seed} is the seed RULER scores with; the selection needs held-out samples")
    if prior is not None and prior not in candidates:
        raise ValueError(f"prior={prior!r} is not a candidate; candidates: {list(candidates)}")
    tasks = tuple(validation_tasks() if tasks is None else tasks)
    scores, by_sample, runs = {}, {}, {}
    for name, w in candidates.items():
        mix = np.asarray(w, np.float64).tolist()
        key = json.dumps(mix)
        # the same weights as an earlier candidate (Gemma3's geometry rule is ValueDiff): same run
        if key in runs:
            scores[name], by_sample[name] = scores[runs[key]], by_sample[runs[key]]
            continue
        runs[key] = name
        path = runner.evaluate(params, tokenizer, "ruler", model_name=model_name, policies=["hybrid"],
                               budgets=[budget], length=length, num_samples=samples,
                               out_dir=Path(out_dir) / name, tasks=tasks, seed=seed, block_size=block,
                               batch_size=batch_size, policy_kwargs={"hybrid": {"mix": mix}},
                               allow_mixed=allow_mixed, progress=progress)
        rows = [r for r in records.read_predictions(path) if r["budget"] == budget and r["task"] in tasks]
        if len(rows) != samples * len(tasks):
            raise ValueError(f"{path} holds {len(rows)} lines at budget {budget} for {len(tasks)} tasks x "
                             f"{samples} samples; expected {samples * len(tasks)}")
        scores[name] = float(np.mean([r["score"] for r in rows]))
        by_sample[name] = {}
        for r in rows:
            by_sample[name].setdefault(r["task"], {})[r["sample_id"]] = float(r["score"])
    best = highest = max(candidates, key=lambda n: scores[n])
    diff = None
    if prior is not None and highest != prior:
        diff = paired_difference(by_sample[highest], by_sample[prior], level=level)
        if diff[1] <= 0:  # not beaten beyond the noise: the prior stays
            best = prior
    detail = {"highest": highest, "prior": prior, "difference": None if diff is None else list(diff),
              "level": level}
    return best, scores, detail


# ---- the command ----------------------------------------------------------------------------------------
def _select_on_ruler_text(params, tok, candidates, *, name: str, folder: Path, budget: int, block_size: int,
                          length: int, samples: int, prior: str | None, say, progress: bool):
    """`analyze_model`'s RULER selection: (chosen, score per mix, fit_meta entries, Markdown)."""
    tasks = validation_tasks()
    say(f"select the mix end to end: mean RULER score of {samples} held-out samples (seed "
        f"{VALIDATION_SEED}) of {len(tasks)} tasks at N={budget} for {', '.join(candidates)}")
    chosen, score, detail = select_on_ruler(params, tok, candidates, model_name=name, budget=budget,
                                            out_dir=folder / f"selection-N{budget}", block=block_size,
                                            length=length, samples=samples, prior=prior, progress=progress)
    meta = {"selection": {"benchmark": "ruler", "seed": VALIDATION_SEED, "tasks": list(tasks),
                          "samples": samples, "objective": selection_objective(prior), "score": score,
                          **detail},
            "selected": chosen}
    text = (f"\nEnd-to-end selection at N={budget}: mean RULER score of {samples} held-out "
            f"samples (seed {VALIDATION_SEED}) of {len(tasks)} tasks; highest "
            f"**{detail['highest']}**, kept **{chosen}**"
            + ("" if prior is None else f" ({prior} stays unless beaten beyond "
                                        "the paired 95 % bootstrap interval)")
            + ":\n\n| mix | score |\n|---|---|\n"
            + "".join(f"| {k} | {v:.4f} |\n" for k, v in score.items()))
    return chosen, score, meta, text


def _select_on_probes_text(params, tok, candidates, *, length: int, n_probes: int, budget: int,
                           block_size: int, say):
    """`analyze_model`'s retrieval-probe selection: (chosen, NLL per mix, fit_meta entries, Markdown)."""
    from vdjax.analysis.calibration import retrieval_probes

    probes = retrieval_probes(tok, length, n_probes)
    say(f"select the mix end to end: answer NLL of {len(probes)} retrieval probes under eviction at "
        f"N={budget} for {', '.join(candidates)}")
    chosen, nll = HY.select(params, probes, candidates, budget=budget, block=block_size)
    meta = {"selection": {"probes": [p.name for p in probes],
                          "objective": "answer NLL, nats per token (teacher-forced, "
                                       "per-token eviction)", "nll": nll},
            "selected": chosen}
    text = (f"\nEnd-to-end selection at N={budget}: answer NLL (nats per token) of {len(probes)} "
            f"retrieval probes; kept **{chosen}**:\n\n| mix | NLL |\n|---|---|\n"
            + "".join(f"| {k} | {v:.4f} |\n" for k, v in nll.items()))
    return chosen, nll, meta, text


def _fit_mix(params, tok, prompts, w_geo, *, name: str, folder: Path, length: int, budget: int,
             block_size: int, per_head: bool, fit_prompts: int, fit_steps: int, select_probes: int,
             select_on: str, select_samples: int, select_prior: str | None, say, progress: bool):
    """`analyze_model`'s --fit: the per-layer fit, its held-out error, then the end-to-end selection among
    `HY.candidate_mixes`. Returns (hybrid entries, the fitted mix's metadata, Markdown)."""
    ids = [list(p.ids) for p in prompts]
    if len(ids) < 2:
        raise ValueError("--fit needs at least 2 prompts (fitting ones plus one held out)")
    n_fit = min(fit_prompts, len(ids) - 1)
    held = ids[n_fit]  # the next prompt (another category when built in) is held out
    say(f"fit the hybrid mix on {n_fit} prompts (N={budget}, B={block_size}, {fit_steps} Adam steps "
        "per layer)")
    w_fit, fit_info = HY.fit(params, ids[:n_fit], budget=budget, block=block_size, per_head=per_head,
                             w0=w_geo, steps=fit_steps, progress=progress)
    candidates = HY.candidate_mixes(w_fit, w_geo)
    errors = HY.held_out_error(params, [held], candidates, budget=budget, block=block_size)
    hyb: dict[str, Any] = {"held_out_error": {k: float(np.nanmean(v)) for k, v in errors.items()}}
    fit_meta = {"per_head": per_head, "budget": budget, "block_size": block_size, "steps": fit_steps,
                "fit_prompts": [p.name for p in prompts[:n_fit]], "held_out": prompts[n_fit].name,
                "held_out_error_per_layer": {k: [None if not np.isfinite(x) else float(x) for x in v]
                                             for k, v in errors.items()}, "layers": fit_info,
                "per_layer_fit": w_fit.tolist()}
    extra = (f"\nper-layer fit (N={budget}, B={block_size}, on {n_fit} prompts): "
             f"{HY.describe(w_fit)}\n\n"
             f"Attention-output error of block eviction on the held-out prompt {prompts[n_fit].name!r} "
             f"(relative, mean over layers):\n\n| mix | error |\n|---|---|\n"
             + "".join(f"| {k} | {v:.4f} |\n" for k, v in hyb["held_out_error"].items()))
    chosen = "fitted"
    if select_probes:
        if select_on == "ruler":
            chosen, score, meta, text = _select_on_ruler_text(
                params, tok, candidates, name=name, folder=folder, budget=budget, block_size=block_size,
                length=length, samples=select_samples, prior=select_prior, say=say, progress=progress)
        else:
            chosen, score, meta, text = _select_on_probes_text(
                params, tok, candidates, length=length, n_probes=select_probes, budget=budget,
                block_size=block_size, say=say)
        hyb["selection"] = score
        fit_meta.update(meta)
        extra += text
    hyb["fitted"] = candidates[chosen]
    fit_meta["chosen"] = chosen
    return hyb, fit_meta, extra


def _save_beside_model(params, hyb: dict, paths: dict, budget: int, say) -> dict:
    """Copy the hybrid mixes next to the checkpoint (where `policy="hybrid"` finds them): {"model-<method>":
    path}; a read-only checkpoint folder is said and skipped."""
    saved = {}
    for method in hyb.keys() & set(HY.METHODS):
        # the fitted mix: for every budget (the fallback) and for the one it was fitted and selected at
        targets = [HY.mix_path(params, method)] + ([HY.mix_path(params, method, budget)]
                                                   if method == "fitted" else [])
        try:
            for target in targets:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(paths[f"hybrid-{method}"], target)
            saved[f"model-{method}"] = targets[-1]
        except OSError as e:  # a read-only checkpoint folder: the copy under OUT still works by path
            say(f"could not save the {method} mix next to the model ({e}); "
                f"use mix={paths[f'hybrid-{method}']}")
    return saved


def analyze_model(model: str, out: str | os.PathLike, *, prompts_file: str | None = None, length: int = 2048,
        per_category: int = 4, tau: float = G.TAU, topk: int = G.TOPK, n_queries: int = G.N_QUERIES,
        jaccard_prompts: int = 8, fit: bool = False, budget: int = 256, block_size: int = 128,
        fit_prompts: int = 4, fit_steps: int = 60, per_head: bool = False, select_probes: int = 8,
        select_on: str = "retrieval", select_samples: int = 2, select_prior: str | None = "geometry",
        save_to_model: bool = True,
        console=None, dtype=None, revision: str | None = None) -> dict[str, Any]:
    """Analyse `model` into OUT/<model>/, write hybrid mixes (geometry rule; fitted with `fit`), refresh
    OUT's all-models table and scatter. Returns {"geometry": Geometry, "paths": {...}, "hybrid": {...}}.

    With `fit`, the saved mix is the candidate (`hybrid.candidate_mixes`) that wins end to end at `budget`:
    `select_on="retrieval"` the lowest answer NLL on `select_probes` retrieval probes (`hybrid.select`),
    `"ruler"` the highest mean score on `select_samples` held-out RULER samples per task (`select_on_ruler`,
    runs under OUT/<model>/selection-N<budget>/), where `select_prior` (default the geometry rule; None: off)
    stays unless beaten beyond the samples' noise; `select_probes=0` keeps the per-layer fit."""
    if select_on not in SELECT_ON:
        raise ValueError(f"select_on={select_on!r} is unknown; allowed: {list(SELECT_ON)}")
    check_int("select_samples", select_samples, 1)
    import vdjax
    from vdjax.analysis.calibration import calibration_prompts, prompts_from_file

    say = console.print if console is not None else (lambda *a, **k: None)
    params, tok = vdjax.load(model, dtype, revision), vdjax.load_tokenizer(model, revision)
    cfg = params.config
    limit = getattr(cfg, "max_position_embeddings", None) or length
    length = min(length, limit)
    if prompts_file:
        prompts = prompts_from_file(prompts_file, tok, length)
    else:
        prompts = interleave(calibration_prompts(tok, length=length, per_category=per_category))
    name = slug(model)
    folder = Path(out) / name
    say(f"analyse {name}: {len(prompts)} prompts of {length} tokens, Jaccard on {jaccard_prompts} -> "
        f"{folder}")
    geo = G.analyze(params, prompts, model=name, tau=tau, topk=topk, n_queries=n_queries,
                    jaccard_prompts=jaccard_prompts, progress=console is not None)
    hyb: dict[str, Any] = {}
    w_geo = HY.geometry_mix(geo, per_head=per_head)
    hyb["geometry"] = w_geo
    info = {"per_head": per_head, "rule": "w = 1 - (1 - clip((r - 0.5) / 0.5)) * clip(bos_cos / -0.3)"}
    paths = {"hybrid-geometry": HY.save_mix(folder / "hybrid-geometry.json", w_geo, method="geometry",
                                                model=name, info=info)}
    extra = (f"\n## Hybrid mix\n\ngeometry rule ({'per head' if per_head else 'per layer'}): "
             f"{HY.describe(w_geo)}\n")
    if fit:
        fitted, fit_meta, text = _fit_mix(
            params, tok, prompts, w_geo, name=name, folder=folder, length=length, budget=budget,
            block_size=block_size, per_head=per_head, fit_prompts=fit_prompts, fit_steps=fit_steps,
            select_probes=select_probes, select_on=select_on, select_samples=select_samples,
            select_prior=select_prior, say=say, progress=console is not None)
        hyb.update(fitted)
        extra += text
        paths["hybrid-fitted"] = HY.save_mix(folder / "hybrid-fitted.json", hyb["fitted"], method="fitted",
                                             model=name, info=fit_meta)
    if save_to_model and params.source is not None:
        paths.update(_save_beside_model(params, hyb, paths, budget, say))
    paths.update(write_model(geo, folder, extra))
    paths.update({f"all-{k}": v for k, v in write_models(Path(out)).items()})
    return {"geometry": geo, "paths": paths, "hybrid": hyb}


def qfilters_for_model(model: str, *, prompts_file: str | None = None, length: int = 2048,
                       per_category: int = 4, dtype: str | None = None, revision: str | None = None,
                       console=None) -> dict:
    """Fit Q-filters on the calibration prompts (`vdjax.analysis.qfilters`), save them beside the checkpoint
    (found by `policy="qfilter"`) and report how well they are oriented on the held-out last prompt: the
    share of KV heads whose top quarter by -<f, k> receives more attention than the rest (BOS left out)."""
    import vdjax
    from vdjax.analysis.calibration import calibration_prompts, prompts_from_file
    from vdjax.analysis.qfilters import fit_qfilters, orientation
    from vdjax.engine.qfilters import save_qfilters

    say = console.print if console is not None else (lambda *a, **k: None)
    params, tok = vdjax.load(model, dtype, revision), vdjax.load_tokenizer(model, revision)
    length = min(length, getattr(params.config, "max_position_embeddings", None) or length)
    prompts = (prompts_from_file(prompts_file, tok, length) if prompts_file
               else interleave(calibration_prompts(tok, length=length, per_category=per_category)))
    if len(prompts) < 2:
        raise ValueError("--qfilters needs at least 2 prompts (fitting ones plus one held out)")
    ids = [p.ids for p in prompts]
    say(f"Q-filters of {slug(model)}: {len(ids) - 1} prompts of {length} tokens, 1 held out")
    filters = fit_qfilters(params, ids[:-1])
    share = orientation(params, filters, ids[-1])
    path = save_qfilters(params.source, filters, model=slug(model),
                         info={"prompts": len(ids) - 1, "length": length, "held_out_oriented": share})
    return {"path": path, "held_out_oriented": share}

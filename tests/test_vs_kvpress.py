"""vdjax against kvpress 0.5.5 (its own interpreter, .venv-kvpress: git-ignored, built by .ci/install).

bench/vs_kvpress.py says plainly how to create the kvpress environment when it is missing, and a tiny
KeyDiff run (54 s on 2 cores with other jobs holding about one of them) agrees at layer 0, where BlockPress's
simulated blocks equal vdjax's true ones. The adaptive budgets (adakv:, criticalkv:, criticaladakv:,
pyramidkv, chunkkv:), the query-agnostic scorers expected_attention, cur, random, lagkv, leverage and
qfilter, and compactor keep, in full-prefill mode (one block of the whole prompt), the positions kvpress's
presses keep, layer by layer and KV head by KV head (bench/kvpress_reference.py records kvpress's side; one
model load for all presses). RandomPress ranks vdjax's draw there (`random_draws`), LeverageScorePress and
CompactorPress's leverage part project on vdjax's sketch (`leverage_sketches`) and QFilterPress scores with
the filters vdjax is given (`qfilter_filters`): the comparison checks which numbers the engine draws and how
it scores and cuts. CompactorPress's non-causal attention pads a partial last tile (zero queries, which then
attend to the whole padded tile; padded keys at logit -1e-9, not -inf); vdjax attends it exactly and does not
reproduce that, so compactor is compared at a prompt of whole tiles (T_COMPACTOR), and at T = 512 against
kvpress with its partial tile attended exactly (test_compactor_partial_last_tile). kvzip: `adakv:kvzip` with
alpha_safeguard 0 keeps the positions of KVzipPress(layerwise=True) (one pool of K * N per layer), both sides
replaying the ids kvpress replayed (kvpress's tokenizer without its chat template: every prompt token
replayed, none left unscored as the template's prefix would be; test_kvzip_keeps_what_kvpress_keeps);
kvpress's default layerwise=False (one top-k over every layer) vdjax does not offer.
test_kvzip_keeps_the_budget runs kvzip and adakv:kvzip without kvpress."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "vs_kvpress.py"
REFERENCE = ROOT / "bench" / "kvpress_reference.py"
KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"
# not "optional:": CI builds .venv-kvpress (.ci/install), so under VDJAX_STRICT=1 a missing one fails
needs_kvpress = pytest.mark.skipif(not KVPRESS_PYTHON.exists(),
                                   reason="no .venv-kvpress: .ci/install builds it (see bench/README.md)")


def test_says_how_to_create_the_kvpress_venv(tmp_path):
    md = tmp_path / "vs.md"
    out = subprocess.run([sys.executable, str(SCRIPT), "--kvpress-python",
                          str(tmp_path / "none" / "python"), "--out", str(md)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("python -m venv .venv-kvpress && .venv-kvpress/bin/pip install torch==2.13.0 kvpress==0.5.5"
            in out.stdout)
    assert "Nothing was measured" in out.stdout and not md.exists()


@needs_kvpress
def test_tiny_keydiff_run_agrees_at_layer_0(tmp_path, smollm2_dir):
    md = tmp_path / "vs.md"
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", str(smollm2_dir), "--lengths", "384",
                          "--budget", "256", "--new", "2", "--presses", "keydiff", "--retries", "0",
                          "--max-wait", "0", "--out", str(md)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {r["policy"]: r for r in json.loads(md.with_suffix(".json").read_text())["results"]}
    r = rows["keydiff"]
    assert r["kvpress"]["cache_after_prefill"] == 256 and r["kvpress"]["unmatched"] == 0
    assert r["vdjax"]["compiled"] == 0 and r["vdjax"]["s"] > 0 and r["kvpress"]["s"] > 0
    # layer 0 sees the same keys on both sides: BlockPress(KeyDiffPress) simulates vdjax's true blocks exactly
    assert r["agreement"]["layer0_overlap"] >= 0.99
    assert "| BlockPress(KeyDiffPress, 128) | keydiff | 384 |" in md.read_text()


# ---- adaptive budgets against kvpress's presses, full prefill -------------------------------------------
T, N = 512, 128  # kvpress's compression_ratio 0.75: n_kept = T * (1 - ratio) = N exactly, and CriticalKV's
# stage-1 budget int((1 - ratio) * T * 0.5) = vdjax's int(0.5 * N)
PYRAMID_WINDOW = 4  # PyramidKV's pyramid needs N / beta >= window_size (else every layer gets N): 6.4 >= 4
# test id -> (vdjax policy, keywords: vdjax's, given to kvpress's base press too)
PRESSES = {"keydiff": ("keydiff", {}), "adakv:keydiff": ("adakv:keydiff", {}),
           "adakv:keynorm": ("adakv:keynorm", {}), "criticalkv:keydiff": ("criticalkv:keydiff", {}),
           "criticaladakv:keydiff": ("criticaladakv:keydiff", {}), "pyramidkv": ("pyramidkv", {}),
           # ExpectedAttentionPress() as it comes: use_vnorm, n_sink 4, 512 future positions, covariance
           "expected_attention": ("expected_attention", {}),
           "adakv:expected_attention": ("adakv:expected_attention", {}),
           # kvpress warns that use_vnorm should be off under CriticalAdaKV (its ||W_o v||_1 replaces it)
           "criticaladakv:expected_attention[use_vnorm=False]": ("criticaladakv:expected_attention",
                                                                 {"use_vnorm": False}),
           "cur": ("cur", {}),  # CURPress(): kv_product, windows of 16, 4 sinks
           "random": ("random", {}),  # RandomPress ranking vdjax's draw (`random_draws`)
           # LagKVPress(): 4 sinks, partitions of 128, ranks (at N, below)
           "lagkv": ("lagkv", {}), "lagkv[N=128]": ("lagkv", {}),
           "leverage": ("leverage", {}),  # LeverageScorePress(): a sketch of 48 (vdjax's draw), ridge 1e-2
           "qfilter": ("qfilter", {}),  # QFilterPress with `qfilter_filters` (vdjax: filters=)
           # CompactorPress(): blending None (= compression_ratio = 1 - N / T, as vdjax's), its leverage on
           # vdjax's sketch; sinks 8 + 4, non-causal tiles of 256 (whole tiles at T_COMPACTOR, below)
           "compactor": ("compactor", {}),
           "chunkkv:keydiff": ("chunkkv:keydiff", {})}  # ChunkKVPress(KeyDiffPress), chunks of 20
HEAD_ADAPTIVE = ("adakv:", "criticaladakv:")
# LagKVPress's scores are 1.0 for the 4 sinks and the newest 252 positions (the newest complete partition
# and the incomplete rest of T = 512: 260 .. 511) and rank / 128 in the two partitions scored (4 .. 259), each
# rank once per partition: at N = 4 + 252 + 2 * 32 = 320 no tie straddles the cut, and the positions agree
# up to none. At N = 128 the cut falls inside the 256 ties of 1.0: vdjax keeps the earliest (the sinks and
# 260 .. 383, its tie rule), kvpress whichever torch's topk returns (it drops the sinks): 360 of 11,520 kept
# positions differ, all of them ties (`_compare_up_to_ties`).
# ChunkKVPress keeps max(1, int(n_chunks * (1 - ratio))) whole chunks, n_chunks counting a remainder chunk:
# T = 520 is 26 chunks of 20, N = 120 six of them (kvpress's n_kept 120 too), so both keep N per head.
T_CHUNK = 520
# CompactorPress tiles the prompt less its 8 + 4 sinks (T - 12 positions) into non-causal attention tiles of
# 256; a partial last tile kvpress pads (zero queries, which then attend to the whole padded tile, and zero
# keys at logit -1e-9 instead of -inf), vdjax masks exactly and does not reproduce the padding. T = 524 is two
# whole tiles; N = 131 makes kvpress's compression_ratio exactly 0.75 (n_kept 131).
T_COMPACTOR, N_COMPACTOR = 524, 131
OWN = {"lagkv": {"budget": 320, "scores": True}, "lagkv[N=128]": {"scores": True},
       "chunkkv:keydiff": {"T": T_CHUNK, "budget": 120},
       "compactor": {"T": T_COMPACTOR, "budget": N_COMPACTOR}}  # press -> its own T, budget, kvpress's scores
# kvpress only, for test_compactor_partial_last_tile: at T = 512 the last tile has 244 positions (264 .. 507)
KVPRESS_ONLY = {"compactor[T=512]": ("compactor", {}),
                "compactor[T=512, exact last tile]": ("compactor", {"exact_last_tile": True})}
# KVzipPress(layerwise=True) = vdjax's adakv:kvzip at alpha_safeguard 0 (test_kvzip_keeps_what_kvpress_keeps)
KVZIP = "adakv:kvzip"
# Measured on SmolLM2-135M (random ids, seed 0): 0 of 11,520 kept positions differ for every press (the
# expected_attention ones included; lagkv: 0 of 28,800 at N = 320, and at N = 128 none beyond the ties above;
# leverage, qfilter: 0 of 11,520; chunkkv:keydiff 0 of 10,800; compactor 0 of 11,790), per-head counts and
# PyramidKV's layer budgets equal. The allowance is for ties and fp32 rounding (torch vs XLA) at the cut on
# other CPUs: 0.1 % of positions, 11 here; an off-by-one budget or a wrong score moves far more (vdjax's
# expected_attention without its covariance term: 1,192; use_vnorm off: 705; cur's kv_avg for kv_product: 225;
# random from another seed: 8,666; lagkv with cross_scoring: 244, lag_size 64: 6,118; leverage from seed 1:
# 2,044, ridge 1: 308; the filters negated: 11,520; chunkkv's chunks of 10: 2,370, keydiff unchunked: 5,777;
# compactor from seed 1: 1,621, ridge 1: 248, blending 0.5: 665, blending 0: 5,728, tiles of 128: 1,394).
# adakv:kvzip: 0 of 11,520 (its layer-0 scores within 1.5e-7 of kvpress's, fp32); with vdjax's default ids
# (the chat template's suffix, 6 ids, for kvpress's "\n"): 1,478; the suffix "\n\n": 928; alpha_safeguard 0.2:
# 274; n_sink 0: 145; against kvpress with the chat template (its 24 prefix positions not replayed): 1,877.
MAX_DIFFERING = 0.001


def _setting(press: str) -> tuple[int, int]:
    """(T, N) of a press's prefill."""
    own = OWN.get(press, {})
    return own.get("T", T), own.get("budget", N)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir):
    """{t: t random but fixed token ids of SmolLM2's vocabulary} for the prompt lengths of the presses."""
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    return {t: np.random.default_rng(0).integers(0, vocab, t).astype(np.int32)
            for t in (T, T_CHUNK, T_COMPACTOR)}


def random_draws(config: dict, seed: int = 0) -> np.ndarray:
    """vdjax's random scores of the prompt's positions in a full prefill, [L, K, T]: the registered policy's
    score called as the engine calls it there (layer l, the block's queries at 0 .. T - 1, the candidates the
    N empty cache slots and then the T prompt tokens, `evict._candidates`'s layout). If the engine drew other
    numbers the kept sets would share about N / T of their positions, not all."""
    import jax.numpy as jnp

    import vdjax
    from vdjax.engine.scores import AttnInfo

    kh = config["num_key_value_heads"]
    cand = jnp.concatenate([jnp.full(N, -1), jnp.arange(T)]).astype(jnp.int32)
    pos = jnp.broadcast_to(cand, (1, kh, N + T))
    q_pos = jnp.arange(T, dtype=jnp.int32)[None]
    pol = vdjax.get_policy("random")
    return np.stack([np.asarray(pol(None, None, AttnInfo(None, q_pos, None, layer=layer), pos, slots=N,
                                    seed=seed))[0, :, N:] for layer in range(config["num_hidden_layers"])])


def leverage_sketches(config: dict, seed: int = 0, sketch_dimension: int = 48) -> np.ndarray:
    """The standard normal draws [L, K, D, m] of vdjax's leverage sketch per layer (`scores.leverage` divides
    them by sqrt(m), as kvpress does its own)."""
    import jax

    shape = (config["num_key_value_heads"], config["head_dim"], sketch_dimension)
    return np.stack([np.asarray(jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(seed), layer), shape))
                     for layer in range(config["num_hidden_layers"])])


def qfilter_filters(config: dict) -> np.ndarray:
    """Random but fixed Q-filters [L, K, D] (float32) that both sides score with."""
    shape = (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"])
    return np.random.default_rng(1).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def config(smollm2_dir):
    """SmolLM2's HF config.json."""
    return json.loads((smollm2_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def kvpress_kept(tmp_path_factory, smollm2_dir, prompt_ids, config):
    """kvpress's kept positions for every press (bench/kvpress_reference.py, one subprocess). Started at once,
    read on first use: it runs while the vdjax side compiles."""
    if not KVPRESS_PYTHON.exists():
        yield None  # the tests skip on needs_kvpress first
        return
    d = tmp_path_factory.mktemp("kvpress_reference")
    for t, ids in prompt_ids.items():
        (d / f"ids{t}.json").write_text(json.dumps(ids.tolist()))
    np.save(d / "sketch.npy", leverage_sketches(config))
    np.save(d / "filters.npy", qfilter_filters(config))
    arrays = {"leverage": {"sketch": str(d / "sketch.npy")}, "compactor": {"sketch": str(d / "sketch.npy")},
              "qfilter": {"filters": str(d / "filters.npy")}}
    presses = {}
    for name, (policy, kw) in {**PRESSES, **KVPRESS_ONLY}.items():
        own = OWN.get(name, {})
        t, _ = _setting(name)
        presses[name] = {"policy": policy, "kwargs": kw, **{k: v for k, v in own.items() if k != "T"},
                         **({"ids": str(d / f"ids{t}.json")} if t != T else {}),
                         **({"arrays": arrays[policy]} if policy in arrays else {})}
    presses[KVZIP] = {"policy": KVZIP, "scores": True}  # KVzipPress(layerwise=True), no chat template
    (d / "presses.json").write_text(json.dumps(presses))
    np.save(d / "random.npy", random_draws(config))
    proc = subprocess.Popen([str(KVPRESS_PYTHON), str(REFERENCE), "--model", str(smollm2_dir), "--ids",
                             str(d / f"ids{T}.json"), "--presses", str(d / "presses.json"), "--random-scores",
                             str(d / "random.npy"), "--budget", str(N), "--window-size", str(PYRAMID_WINDOW),
                             "--threads", "1", "--out", str(d / "kept.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = {}

    def get():
        if not result:
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, out
            result.update(json.loads((d / "kept.json").read_text()))
        return result

    yield get
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def params(smollm2_dir):
    """SmolLM2-135M's vdjax params in fp32 (kvpress's side runs in fp32 too)."""
    import vdjax

    return vdjax.load(smollm2_dir, dtype="float32")


def _compare(vd, ref) -> tuple[int, int, list[str]]:
    """(positions kvpress keeps, positions vdjax keeps that kvpress does not, per-head count mismatches) over
    every layer and KV head: vd [layer][head] int arrays, ref [layer][head] lists."""
    total = differ = 0
    counts = []
    for layer, (vd_heads, ref_heads) in enumerate(zip(vd, ref, strict=True)):
        for head, (a, b) in enumerate(zip(vd_heads, ref_heads, strict=True)):
            a, b = set(a.tolist()), set(b)
            total += len(b)
            differ += len(a - b)
            if len(a) != len(b):
                counts.append(f"layer {layer} head {head}: vdjax keeps {len(a)}, kvpress {len(b)}")
    return total, differ, counts


def _compare_up_to_ties(vd, ref, scores) -> tuple[int, int]:
    """(positions vdjax keeps that kvpress does not, those of them tied with kvpress's cut): per layer and KV
    head, a position kvpress's score (scores [layer][head][T]) ranks exactly at the head's cut (its n-th
    highest score, n what kvpress keeps) may go either way; ties at the cut are why such a pair differs."""
    differ = tied = 0
    for vd_heads, ref_heads, score_heads in zip(vd, ref, scores, strict=True):
        for a, b, s in zip(vd_heads, ref_heads, score_heads, strict=True):
            s = np.asarray(s)
            cut = np.sort(s)[::-1][len(b) - 1]
            only = set(a.tolist()) - set(b)
            differ += len(only)
            tied += sum(s[j] == cut for j in only)
    return differ, tied


def _first_difference(vd, ref) -> str:
    """Where the two first disagree, for the failure message."""
    for layer, (vd_heads, ref_heads) in enumerate(zip(vd, ref, strict=True)):
        for head, (a, b) in enumerate(zip(vd_heads, ref_heads, strict=True)):
            a, b = set(a.tolist()), set(b)
            if a != b:
                return (f"first difference: layer {layer} head {head}: only vdjax keeps "
                        f"{sorted(a - b)[:12]}, only kvpress keeps {sorted(b - a)[:12]}")
    return "no difference"


@needs_kvpress
@pytest.mark.parametrize("press", PRESSES)
def test_full_prefill_keeps_what_kvpress_keeps(press, params, prompt_ids, kvpress_kept, config):
    import vdjax

    policy, kw = PRESSES[press]
    t, n = _setting(press)
    kw = {"window_size": PYRAMID_WINDOW, **kw} if policy == "pyramidkv" else kw
    kw = {"filters": qfilter_filters(config).tolist(), **kw} if policy == "qfilter" else kw
    # one scan step for every layer compiles much faster; PyramidKV's layer budgets need the unrolled layers
    scan = policy != "pyramidkv"
    cache, _ = vdjax.prefill(params, prompt_ids[t][None], policy, n, block_size=t, layer_scan=scan, **kw)
    vd = [layer[0] for layer in vdjax.kept_positions(cache)]  # row 0: [layer][head]
    ref = kvpress_kept()["presses"][press]
    assert kvpress_kept()["T"] == T and kvpress_kept()["budget"] == N
    assert ref["T"] == t and ref["budget"] == n

    total, differ, counts = _compare(vd, ref["kept"])
    kh = params.config.num_kv_heads
    assert total == params.config.num_layers * kh * n  # the same memory: L * K * N in all
    tied = 0
    if ref["scores"] is not None:  # differences where kvpress's scores tie at the cut are no difference
        differ, tied = _compare_up_to_ties(vd, ref["kept"], ref["scores"])
    assert differ - tied <= MAX_DIFFERING * total, (f"{press}: {differ} of {total} kept positions differ "
                                                    f"({tied} tied at kvpress's cut); "
                                                    + _first_difference(vd, ref["kept"]))
    if policy.startswith(HEAD_ADAPTIVE):
        # kvpress's head budgets: the per-head counts, unequal (else the test would not test the pooling)
        assert not counts, f"{press}: per-head counts differ: {counts[:5]}"
        assert any(len({len(h) for h in layer}) > 1 for layer in ref["kept"])
    else:
        assert all(len(h) == n for layer, n in zip(vd, ref["layer_budgets"], strict=True) for h in layer)
    if policy == "random":  # a new draw per layer: layers keep different positions
        assert len(set(ref["kept"][0][0]) & set(ref["kept"][1][0])) < N // 2
    if policy == "pyramidkv":
        budgets = ref["layer_budgets"]
        assert len(set(budgets)) > 1 and budgets[0] > N > budgets[-1], budgets  # the pyramid is active
        assert [len(layer[0]) for layer in vd] == budgets
        assert sum(budgets) == params.config.num_layers * N
    if policy == "lagkv":
        scores = np.asarray(ref["scores"])  # [L, K, T]
        ones = np.r_[0:4, 260:T]  # the sinks, the newest complete partition and the rest
        assert np.all(scores[..., ones] == 1) and np.all(scores[..., 4:260] < 1)
        if n == N:  # every kept position a tie of 1.0: vdjax keeps the earliest of them
            assert all(h.tolist() == list(range(4)) + list(range(260, 260 + n - 4)) for layer in vd
                       for h in layer)
            assert tied == differ  # nothing differs but the ties' order
        else:  # the 256 ones kept, the rest by rank (0 differ measured, within MAX_DIFFERING elsewhere)
            assert all(set(ones) <= set(h.tolist()) for layer in vd for h in layer)
    if policy.startswith("chunkkv:"):  # six whole chunks of 20, the same in every head
        for layer in vd:
            chunks = {p // 20 for p in layer[0].tolist()}
            assert len(chunks) == n // 20 and all(h.tolist() == layer[0].tolist() for h in layer)
    if policy == "compactor":  # the 8 + 4 sinks kept in every head
        sinks = set(range(8)) | set(range(t - 4, t))
        assert all(sinks <= set(h) for layer in ref["kept"] for h in layer)


@needs_kvpress
def test_compactor_partial_last_tile(params, prompt_ids, kvpress_kept):
    """At T = 512 the non-causal attention's last tile is partial (244 of 256 positions): vdjax attends it
    exactly, kvpress pads it. With kvpress's partial tile attended exactly too (the keyword exact_last_tile of
    bench/kvpress_reference.py's GivenSketchCompactorPress, the rest kvpress's own) the two keep the same
    positions (measured: 0 of 11,520 differ); with kvpress's padding they differ (131), through that tile's
    attention only, which the z-score over all positions passes on to the others (of the 262 positions the
    padding swaps, 138 lie in the last tile)."""
    import vdjax

    cache, _ = vdjax.prefill(params, prompt_ids[T][None], "compactor", N, block_size=T, layer_scan=True)
    vd = [layer[0] for layer in vdjax.kept_positions(cache)]
    exact = kvpress_kept()["presses"]["compactor[T=512, exact last tile]"]["kept"]
    padded = kvpress_kept()["presses"]["compactor[T=512]"]["kept"]
    total, differ, counts = _compare(vd, exact)
    assert total == params.config.num_layers * params.config.num_kv_heads * N and not counts
    assert differ <= MAX_DIFFERING * total, f"{differ} of {total} differ; " + _first_difference(vd, exact)
    _, differ_padded, _ = _compare(vd, padded)
    assert differ_padded > 10 * max(differ, 1), (differ_padded, differ)


def _pool_ties(vd, ref, scores) -> int:
    """Of the positions vdjax keeps that kvpress does not, those tied at kvpress's cut of a layer pool (the
    layer's K * N-th highest score over every head, scores [layer][head][T])."""
    tied = 0
    for vd_heads, ref_heads, s in zip(vd, ref, scores, strict=True):
        s = np.asarray(s)
        cut = np.sort(s.ravel())[::-1][sum(len(h) for h in ref_heads) - 1]
        tied += sum(int(s[h, j] == cut) for h, (a, b) in enumerate(zip(vd_heads, ref_heads, strict=True))
                    for j in set(a.tolist()) - set(b))
    return tied


@needs_kvpress
def test_kvzip_keeps_what_kvpress_keeps(params, prompt_ids, kvpress_kept):
    """adakv:kvzip (alpha_safeguard 0: KVzip has no safeguard) keeps the positions of KVzipPress(layerwise=
    True): one replay of the whole prompt after kvpress's repeat prompt and suffix (the ids it recorded, given
    to vdjax), at positions T onward, its softmax over the prompt and the replay only (no sink keys before the
    first chunk), the max over the replay and the GQA group, the 4 sinks protected, the best K * N of each
    layer across heads."""
    import vdjax
    from vdjax.engine.replay import replay_stream

    ref = kvpress_kept()["presses"][KVZIP]
    rp = ref["replay"]
    ids = prompt_ids[T]
    # kvpress saw no chat template: suffix "\n", nothing left out as the template's prefix, one chunk of T
    assert rp["prefix_length"] == 0 and rp["chunk_lengths"] == [T] and rp["prompts"] == [rp["repeat_ids"]]
    r = len(rp["repeat_ids"]) + len(rp["suffix_ids"]) + T
    assert rp["chunks"] == [{"start": 0, "end": T, "sink": 0, "positions": [T, T + r - 1, r],
                             "contiguous": True}]
    given = {name: rp[name] for name in ("repeat_ids", "continue_ids", "suffix_ids")}
    # vdjax's replay: the same ids at the same positions (T .. T + r - 1)
    hyper = {**given, "n_sink": 4, "kvzip_plus_normalization": False}
    q_pos = np.arange(T, dtype=np.int32)[None]
    _, r_pos = replay_stream(params, hyper, ids[None], q_pos)
    assert np.asarray(r_pos)[0].tolist() == list(range(T, T + r))

    cache, _ = vdjax.prefill(params, ids[None], KVZIP, N, block_size=T, layer_scan=True, alpha_safeguard=0.0,
                             **given)
    vd = [layer[0] for layer in vdjax.kept_positions(cache)]
    total, differ, counts = _compare(vd, ref["kept"])
    kh = params.config.num_kv_heads
    assert total == params.config.num_layers * kh * N and not counts, counts[:5]
    assert any(len({len(h) for h in layer}) > 1 for layer in ref["kept"])  # the pool is active
    tied = _pool_ties(vd, ref["kept"], ref["scores"])
    assert differ - tied <= MAX_DIFFERING * total, (f"{differ} of {total} kept positions differ ({tied} "
                                                    f"tied at kvpress's cut); "
                                                    + _first_difference(vd, ref["kept"]))
    scores = np.asarray(ref["scores"])  # [L, K, T]: kvpress's sinks at (the max over every layer) + 1
    assert np.all(scores[..., :4] == scores.max()) and np.all(scores[..., 4:] < scores.max() - 0.5)
    assert all(set(range(4)) <= set(h.tolist()) for layer in vd for h in layer)


def test_kvzip_keeps_the_budget(params, prompt_ids):
    """kvpress-free: with block_size = T, kvzip keeps N per head and adakv:kvzip K * N per layer (at least 1 a
    head), the 4 sinks in every head; the replay ids are the checkpoint tokenizer's (`bind_kvzip`)."""
    import vdjax

    kh = params.config.num_kv_heads
    for policy, kw in (("kvzip", {}), (KVZIP, {"alpha_safeguard": 0.0})):
        cache, logits = vdjax.prefill(params, prompt_ids[T][None], policy, N, block_size=T, layer_scan=True,
                                      **kw)
        vd = [layer[0] for layer in vdjax.kept_positions(cache)]
        assert len(vd) == params.config.num_layers and np.all(np.isfinite(np.asarray(logits)))
        for layer in vd:
            sizes = [len(h) for h in layer]
            assert len(sizes) == kh and all(set(range(4)) <= set(h.tolist()) for h in layer), policy
            assert all(len(set(h.tolist())) == len(h) and h.max() < T for h in layer), policy
            if policy == "kvzip":
                assert sizes == [N] * kh
            else:
                assert sum(sizes) == kh * N and min(sizes) >= 1

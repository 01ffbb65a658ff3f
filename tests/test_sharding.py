"""Multi-device inference (vdjax.engine.sharding): a ("data", "model") mesh gives the
single-device tokens and cache.

JAX fixes its device count when it first starts, and this process already has 1 CPU device, so the mesh
runs happen in two child processes with 8 forced host devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`), started at once and run while this process computes
the single-device references (on its CPU, as the children). Each child prints one JSON object (tokens, kept
positions per head, sharding specs); the tests compare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import vdjax
from vdjax.engine import sharding, timing

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from helpers import random_ids, random_params, tiny_config  # noqa: E402

POLICIES = {  # policy -> keywords; snapkv reads attention probs, h2o accumulates them
    "valuediff": dict(budget=12),
    "snapkv": dict(budget=12, window=4),
    "h2o": dict(budget=12),
    "dense": dict(budget=None),
}
LENGTHS = (37, 20, 45, 9, 30, 26)  # 6 ragged rows: 2x4 splits them 3 + 3, 8x1 pads them to 8
RUN = dict(block_size=8, max_new_tokens=10)
# question-agnostic protocol (the question is padded too) and sampling (padding rows must not move real rows'
# random draws); run on 8x1, where 6 rows become 8
# kv_quant, kv_group on the mesh (tests/test_kv_quant.py: the rest)
QUANT = (("int8", None), ("int4", 4), ("int4-smooth", 4))
EXTRA = dict(policy="valuediff", budget=12, question=[5, 9, 14, 3, 22], temperature=0.8, top_k=20)


def _model(kv_heads: int):
    """The tiny model (8 query heads, `kv_heads` KV heads) and the ragged batch.

    No row starts with a repeated token: positions 0 and 1 would then hold the same token in the same context,
    so equal keys and values in every layer, an exact tie that float rounding breaks. XLA:CPU rounds a row
    differently with the number of rows it computes at once (already on one device: such a row alone vs in
    a batch), which the "data" axis changes, so such a tie could flip either way.
    """
    cfg = tiny_config(num_heads=8, num_kv_heads=kv_heads)
    ids = [random_ids(n, cfg.vocab_size, seed=100 + n).tolist() for n in LENGTHS]
    assert all(row[0] != row[1] for row in ids)
    return random_params(cfg, seed=1), ids


def _kept(cache) -> list:
    """Kept positions of every attention layer as sorted lists per (row, head): [La][B][K][N]."""
    return np.sort(np.asarray(cache.pos), axis=-1).tolist()


def _summary(gen) -> dict:
    """What a run must reproduce: tokens, kept positions, and the returned cache's rows."""
    rows = int(gen.cache.pos.shape[1])
    return {"tokens": gen.tokens.tolist(), "kept": _kept(gen.cache), "rows": rows}


def _qwen3_5():
    """A tiny random Qwen3.5 (3 Gated DeltaNet layers, 1 gated attention layer) and the ragged batch."""
    from vdjax.models.config import ModelConfig
    from vdjax.models.weights import init_params

    cfg = ModelConfig(family="qwen3_5", vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, norm_offset=1.0,
                      qk_norm=True, attn_gate=True, rotary_dim=4,
                      layer_types=("linear_attention",) * 3 + ("full_attention",),
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel=4)
    return init_params(cfg, 3), _model(4)[1]


def _qwen3_5_run(mesh=None, layer_scan=None) -> dict:
    """Tokens, kept positions and DeltaNet states of a Qwen3.5 run on the ragged batch."""
    params, ids = _qwen3_5()
    gen = vdjax.run(params, ids, "valuediff", mesh=mesh, layer_scan=layer_scan, **RUN, budget=12)
    rec = [np.asarray(gen.cache[i].rec).tolist() for i in range(3)]
    out = _summary(gen) | {"rec": rec}
    if mesh is not None:
        lw = gen.cache[0]
        out["specs"] = {"rec": _spec(lw.rec), "conv": _spec(lw.conv)} | {
            name: _spec(sharding.shard_params(params, mesh).weights["layers"][0][name])
            for name in ("w_z", "w_out", "A_log", "w_qkv")}
    return out


def _gpt_oss():
    """A tiny random GPT-OSS (sliding and full layers, sinks, 4 experts top 2, YaRN) and the ragged batch."""
    from vdjax.models.config import ModelConfig
    from vdjax.models.weights import init_params

    yarn = (("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 4.0),
            ("original_max_position_embeddings", 32), ("rope_type", "yarn"), ("truncate", False))
    cfg = ModelConfig(family="gpt_oss", vocab_size=61, hidden_size=32, intermediate_size=16, num_layers=2,
                      num_heads=8, num_kv_heads=4, head_dim=8, rope_theta=150000.0, rope_scaling=yarn,
                      layer_types=("sliding_attention", "full_attention"), sliding_window=8, qkv_bias=True,
                      o_bias=True, sinks=True, num_experts=4, experts_per_token=2)
    return init_params(cfg, 4), _model(4)[1]


def _gpt_oss_run(mesh=None) -> dict:
    """Tokens and kept positions of a GPT-OSS run on the ragged batch (and, on a mesh, the expert specs)."""
    params, ids = _gpt_oss()
    out = _summary(vdjax.run(params, ids, "tova", mesh=mesh, **RUN, budget=12))
    if mesh is not None:
        lw = sharding.shard_params(params, mesh).weights["layers"][0]
        out["specs"] = {name: _spec(lw[name])
                        for name in ("moe_gate_up", "moe_down", "moe_down_b", "router_w", "sinks")}
    return out


def _runs(kv_heads: int, policies, mesh=None) -> dict:
    """{policy: summary} of vdjax.run on the ragged batch."""
    params, ids = _model(kv_heads)
    return {p: _summary(vdjax.run(params, ids, p, mesh=mesh, **RUN, **POLICIES[p]))
            for p in policies}


def _extra(mesh=None) -> dict:
    """Summary of the EXTRA run."""
    params, ids = _model(4)
    return _summary(vdjax.run(params, ids, mesh=mesh, key=jax.random.key(7), **RUN, **EXTRA))


def _spec(x) -> list:
    """An array's PartitionSpec as a JSON list, trailing (replicated) Nones dropped."""
    spec = [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def _child(group: str) -> dict:
    """The mesh runs of one child process (8 host devices)."""
    from vdjax.engine.placement import place

    assert jax.device_count() == 8, jax.devices()
    out = {}
    if group == "a":  # data 2 x model 4: 4 KV heads split; rows 3 + 3 (no padding, the cache stays sharded)
        mesh = sharding.make_mesh(data=2, model=4)
        params, ids = _model(4)
        out["2x4"] = _runs(4, POLICIES, mesh)
        cache, logits = vdjax.prefill(params, ids, "valuediff", mesh=mesh, block_size=8, budget=12)
        out["prefill"] = {"kept": _kept(cache), "logits": np.asarray(logits).tolist()}
        placed = place(params, np.zeros((6, 8), np.int32), np.ones(6, np.int32), mesh)
        lw = placed.params.weights["layers"][0]
        out["specs"] = {name: _spec(lw[name]) for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
                                                            "attn_norm")}
        out["specs"] |= {"embed": _spec(placed.params.weights["embed"]), "tokens": _spec(placed.tokens),
                         "cache_k": _spec(cache.layers[0].k), "cache_pos": _spec(cache.layers[1].pos),
                         "tokens_devices": len(placed.tokens.sharding.device_set),
                         "tokens_shard_rows": placed.tokens.addressable_shards[0].data.shape[0]}
        # the layer scan (the GPU/TPU default) on the mesh: the cache carry stacked over layers, split at the
        # end
        out["2x4_scan"] = {p: _summary(vdjax.run(params, ids, p, mesh=mesh, layer_scan=True, **RUN,
                                                 **POLICIES[p]))
                           for p in ("valuediff", "h2o", "dense")}
        cache, _ = vdjax.prefill(params, ids, "valuediff", mesh=mesh, block_size=8, budget=12,
                                 layer_scan=True)
        out["specs"]["cache_k_scan"] = _spec(cache.layers[0].k)
        # a quantized cache on the mesh: codes and scales sharded rows x heads like the unquantized cache
        out["quant"] = {q: _summary(vdjax.run(params, ids, "valuediff", mesh=mesh, kv_quant=q, kv_group=g,
                                              **RUN, budget=12)) for q, g in QUANT}
        cache, _ = vdjax.prefill(params, ids, "valuediff", mesh=mesh, block_size=8, budget=12,
                                 kv_quant="int4")
        out["specs"] |= {"quant_data": _spec(cache.layers[0].k.data),
                         "quant_scale": _spec(cache.layers[0].v.scale)}
        cache, _ = vdjax.prefill(params, ids, "valuediff", mesh=mesh, block_size=8, budget=12,
                                 kv_quant="int4-smooth")
        out["specs"]["quant_centre"] = _spec(cache.layers[0].k.centre)
    else:  # data 8: rows padded 6 -> 8; 2 KV heads on a 4-way model axis: attention replicated, MLP split
        out["8x1"] = _runs(4, POLICIES, sharding.make_mesh(data=8, model=1))
        out["extra"] = _extra(sharding.make_mesh(data=8, model=1))
        mesh = sharding.make_mesh(data=2, model=4)
        out["kv2"] = _runs(2, ["valuediff"], mesh)
        params, _ = _model(2)
        lw = sharding.shard_params(params, mesh).weights["layers"][0]
        cache, _ = vdjax.prefill(*_model(2), "valuediff", mesh=mesh, block_size=8, budget=12)
        out["kv2_specs"] = {"wq": _spec(lw["wq"]), "wk": _spec(lw["wk"]), "w_up": _spec(lw["w_up"]),
                            "cache_k": _spec(cache.layers[0].k)}
        out["qwen3_5"] = _qwen3_5_run(sharding.make_mesh(data=2, model=2))
        # the layer scan: the 3 DeltaNet layers' states stacked over the groups, sharded like one layer's
        out["qwen3_5_scan"] = _qwen3_5_run(sharding.make_mesh(data=2, model=2), layer_scan=True)
        out["gpt_oss"] = _gpt_oss_run(sharding.make_mesh(data=2, model=4))
    return out


@pytest.fixture(scope="module")
def results():
    """(single-device references, child results); the children run while this process computes references."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    code = f"import sys, json; sys.path.insert(0, {str(TESTS)!r}); import test_sharding as t; " \
           "print(json.dumps(t._child(sys.argv[1])))"
    children = [subprocess.Popen([sys.executable, "-c", code, g], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for g in ("a", "b")]
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            params, ids = _model(4)
            cache, logits = vdjax.prefill(params, ids, "valuediff", block_size=8, budget=12)
            ref = {"kv4": _runs(4, POLICIES), "kv2": _runs(2, ["valuediff"]), "extra": _extra(),
                   "prefill": {"kept": _kept(cache), "logits": np.asarray(logits).tolist()},
                   "qwen3_5": _qwen3_5_run(), "gpt_oss": _gpt_oss_run(),
                   "quant": {q: _summary(vdjax.run(params, ids, "valuediff", kv_quant=q, kv_group=g, **RUN,
                                                   budget=12)) for q, g in QUANT}}
        got = {}
        for child in children:
            stdout, stderr = child.communicate(timeout=600)
            assert child.returncode == 0, stderr[-3000:]
            got |= json.loads(stdout.strip().splitlines()[-1])
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    return ref, got


@pytest.mark.parametrize("mesh", ["2x4", "8x1"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_mesh_run_equals_single_device(results, policy, mesh):
    """Same tokens and the same kept positions in every layer, row and head as one device."""
    ref, got = results
    want, have = ref["kv4"][policy], got[mesh][policy]
    assert have["rows"] == len(LENGTHS)  # 8x1's padding rows are dropped from the returned cache
    assert have["tokens"] == want["tokens"]
    _same_kept(have["kept"], want["kept"])


@pytest.mark.parametrize("policy", ["valuediff", "h2o", "dense"])
def test_mesh_layer_scan_equals_single_device(results, policy):
    """`layer_scan=True` on a 2x4 mesh (the accelerators' default) against one device with the layers
    unrolled: same tokens and kept positions, the returned cache split per layer and
    still sharded rows x heads."""
    ref, got = results
    want, have = ref["kv4"][policy], got["2x4_scan"][policy]
    assert have["rows"] == len(LENGTHS) and have["tokens"] == want["tokens"]
    _same_kept(have["kept"], want["kept"])
    assert got["specs"]["cache_k_scan"] == ["data", "model"]


def _same_kept(have: list, want: list) -> None:
    """Kept positions [La][B][K][N] of a sharded run against one device: the same shape, at least 75 % of the
    per-(layer, row, head) kept sets identical and 90 % of all kept positions shared. Sharded matmuls may
    accumulate in another order (which depends on the host CPU's XLA kernels), which can swap two near-tied
    scores, and the swap then carries into later layers: seen on one host for valuediff at 2x4 (44 of 48 sets
    identical, tokens identical); a wrong head or row split changes most sets."""
    have, want = np.asarray(have), np.asarray(want)
    assert have.shape == want.shape
    equal = np.all(have == want, axis=-1)  # [La, B, K]
    shared = np.mean([np.isin(h, w).mean() for h, w in
                      zip(have.reshape(-1, have.shape[-1]), want.reshape(-1, want.shape[-1]), strict=True)])
    print(f"kept sets equal: {equal.mean():.3f} ({int(equal.sum())} of {equal.size}); "
          f"positions shared {shared:.3f}")
    assert equal.mean() >= 0.75 and shared >= 0.9, (f"{equal.mean():.1%} of the kept sets equal, "
                                                    f"{shared:.1%} of the positions shared")


def test_mesh_question_and_sampling_equal_single_device(results):
    ref, got = results
    assert got["extra"]["rows"] == len(LENGTHS)
    assert got["extra"] == ref["extra"]


def test_mesh_prefill_equals_single_device(results):
    ref, got = results
    assert got["prefill"]["kept"] == ref["prefill"]["kept"]
    # the "model" axis adds wo's and w_down's partial sums across devices: the same math, another rounding
    np.testing.assert_allclose(got["prefill"]["logits"], ref["prefill"]["logits"], rtol=1e-5, atol=1e-5)


def test_sharding_is_real(results):
    """Heads and MLP width split over "model", rows over "data"; embeddings and norms replicated."""
    s = results[1]["specs"]
    assert s["wq"] == s["wk"] == s["wv"] == [None, "model"]  # [H, heads, D]
    assert s["wo"] == ["model"]  # [Nq, D, H]
    assert s["w_gate"] == s["w_up"] == [None, "model"] and s["w_down"] == ["model"]
    assert s["embed"] == [] and s["attn_norm"] == []
    assert s["cache_k"] == ["data", "model"] and s["cache_pos"] == ["data", "model"]
    assert s["tokens"] == ["data"] and s["tokens_devices"] == 8 and s["tokens_shard_rows"] == 3


@pytest.mark.parametrize("kv_quant", [q for q, _ in QUANT])
def test_mesh_quantized_cache_equals_single_device(results, kv_quant):
    """kv_quant on a 2x4 mesh: the single device's tokens and kept positions; the packed codes and their
    scales split rows x heads like an unquantized cache (no replicated full copy)."""
    ref, got = results
    want, have = ref["quant"][kv_quant], got["quant"][kv_quant]
    assert have["tokens"] == want["tokens"]
    _same_kept(have["kept"], want["kept"])
    assert got["specs"]["quant_data"] == got["specs"]["quant_scale"] == ["data", "model"]
    assert got["specs"]["quant_centre"] == ["data", "model"]  # smooth keys' calibration [B, K, D] alike


def test_indivisible_kv_heads_replicate_attention(results):
    """2 KV heads on a 4-way model axis: attention weights and cache replicated over "model", MLP
    split; same result as one device."""
    ref, got = results
    s = got["kv2_specs"]
    assert s["wq"] == [] and s["wk"] == [] and s["w_up"] == [None, "model"]
    assert s["cache_k"] == ["data"]
    assert got["kv2"]["valuediff"] == ref["kv2"]["valuediff"]


def test_qwen3_5_on_a_mesh(results):
    """Qwen3.5 on 2x2: DeltaNet value heads (state, z, out projections) and attention heads split over
    "model"; the same tokens, kept positions and states as one device."""
    ref, got = results
    want, have = ref["qwen3_5"], got["qwen3_5"]
    assert have["tokens"] == want["tokens"] and have["kept"] == want["kept"] and have["rows"] == len(LENGTHS)
    np.testing.assert_allclose(have["rec"], want["rec"], rtol=1e-4, atol=1e-5)
    s = have["specs"]
    assert s["rec"] == ["data", "model"] and s["conv"][0] == "data"  # the conv's channels: GSPMD's choice
    assert s["w_z"] == [None, "model"] and s["w_out"] == ["model"] and s["A_log"] == ["model"]
    assert s["w_qkv"] == []  # [q | k | v] channels mixed: replicated
    scan = got["qwen3_5_scan"]
    assert scan["tokens"] == want["tokens"] and scan["kept"] == want["kept"]
    np.testing.assert_allclose(scan["rec"], want["rec"], rtol=1e-4, atol=1e-5)
    assert scan["specs"]["rec"] == ["data", "model"]


def test_gpt_oss_on_a_mesh(results):
    """GPT-OSS on 2x4: experts split over "model" (the router and its bias replicated), sinks with their
    query heads; the same tokens and kept positions as one device."""
    ref, got = results
    want, have = ref["gpt_oss"], got["gpt_oss"]
    assert have["tokens"] == want["tokens"] and have["kept"] == want["kept"] and have["rows"] == len(LENGTHS)
    s = have["specs"]
    assert s["moe_gate_up"] == s["moe_down"] == s["moe_down_b"] == ["model"]
    assert s["router_w"] == [] and s["sinks"] == ["model"]


def test_make_mesh_checks_sizes():
    devices = list(range(8))  # only counted before a Mesh is built
    with pytest.raises(ValueError, match="model=3 does not divide the device count 8"):
        sharding.make_mesh(model=3, devices=devices)
    with pytest.raises(ValueError, match="data=3 x model=2 = 6 devices does not divide the device count 8"):
        sharding.make_mesh(data=3, model=2, devices=devices)
    with pytest.raises(ValueError, match="data=16 x model=1"):
        sharding.make_mesh(data=16, devices=devices)
    with pytest.raises(ValueError, match="model must be an integer >= 1"):
        sharding.make_mesh(model=0, devices=devices)
    with pytest.raises(ValueError, match="data must be an integer >= 1"):
        sharding.make_mesh(data=0, devices=devices)
    mesh = sharding.make_mesh()
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": jax.device_count(), "model": 1}


def test_bad_mesh_refused():
    params, ids = _model(4)
    bad = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("batch", "model"))
    with pytest.raises(ValueError, match=r"mesh must have exactly the axes \('data', 'model'\)"):
        vdjax.run(params, ids, "valuediff", budget=8, mesh=bad)
    with pytest.raises(ValueError, match="exactly the axes"):
        vdjax.prefill(params, ids, "valuediff", budget=8, mesh=Mesh(np.asarray(jax.devices()[:1]), ("data",)))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        vdjax.generate(params, ids, "valuediff", budget=8, mesh="2x4")


def test_evaluate_passes_mesh(tmp_path, monkeypatch):
    """evaluate shards the params once, hands the mesh to every vdjax.run and records it in run.json."""
    from vdjax.eval import runner
    from vdjax.eval.sample import Sample

    class Stop(Exception):
        pass

    class Tok:
        chat_template = None

        def __call__(self, text, add_special_tokens=True, **_):
            return {"input_ids": [2 + ord(c) % 50 for c in text], "offset_mapping": [(i, i + 1) for i in
                                                                                   range(len(text))]}

    bench = type(sys)("fake_mesh")
    bench.TASKS = ("t",)
    bench.build = lambda task, tok, *, length, num_samples, seed: [
        Sample(id=f"s{i}", task=task, context="abc" * 5, question="?", answers=("x",), max_new_tokens=2,
               metric="exact") for i in range(num_samples)]
    seen = []

    def spy(params, ids, *a, mesh=None, **k):
        seen.append((mesh, params.weights["layers"][0]["wq"].sharding, len(ids)))
        raise Stop

    monkeypatch.setattr(timing, "run", spy)
    mesh = sharding.make_mesh(data=1, model=1)
    params, _ = _model(4)
    with pytest.raises(Stop):
        runner.evaluate(params, Tok(), bench, model_name="m", policies=["valuediff"], budgets=[8], length=16,
                        num_samples=2, batch_size=2, out_dir=tmp_path, metrics={"exact": lambda *_: 1.0},
                        progress=False, mesh=mesh)
    assert seen[0][0] is mesh and seen[0][1].mesh == mesh and seen[0][2] == 2
    meta = json.loads(next(tmp_path.rglob("run.json")).read_text())
    assert meta["invocations"][-1]["mesh"] == {"data": 1, "model": 1}


@pytest.mark.parametrize("command", ["generate --prompt hi --budget 8", "eval ruler --budgets 8"])
@pytest.mark.parametrize("mesh, message", [
    ("2by4", "argument --mesh: must look like DATAxMODEL"),
    ("0x1", "argument --mesh: must look like DATAxMODEL"),
    ("1x2", f"argument --mesh: model=2 does not divide the device count {jax.device_count()}"),
    ("2x1", "argument --mesh: data=2 x model=1 = 2 devices does not divide the device count "
            f"{jax.device_count()}"),
])
def test_cli_mesh_refused(command, mesh, message, capsys):
    from vdjax.app.cli import main

    assert main(command.split() + ["--mesh", mesh]) == 2
    assert message in capsys.readouterr().err

"""`vdjax.engine.aot` / `vdjax aot`: the real prefill and decode programs compiled for TPU slices on this CPU
(libtpu from the test extra), the report's fields, eviction's flat per-chip peak against dense's growing one,
a multi-host slice, the analytic counts against XLA's own on a one-iteration program, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from vdjax.engine.aot import aot  # noqa: E402

from helpers import tiny_config  # noqa: E402

FIELDS = {"topology", "chips", "processes", "mesh", "model", "dtype", "policy", "budget", "length", "batch",
          "programs"}
PROGRAM = {"argument_bytes", "output_bytes", "temp_bytes", "peak_bytes_per_chip", "flops", "bytes_accessed",
           "compile_s", "roofline_s"}
CFG = tiny_config(num_heads=8, num_kv_heads=4)


@pytest.fixture(scope="module")
def sweep():
    """{(policy, length): report} on v5e:2x2, mesh 1x4 (4 KV heads split)."""
    out = {}
    for policy, budget in (("valuediff", 64), ("snapkv", 64), ("dense", None)):
        for length in (1024, 4096, 16384):
            out[policy, length] = aot(CFG, topology_name="v5e:2x2", mesh=(1, 4), length=length, policy=policy,
                                      budget=budget, new_tokens=16, model="tiny")
    return out


def test_report_fields(sweep):
    r = sweep["valuediff", 1024]
    assert FIELDS <= set(r)
    assert (r["topology"], r["chips"], r["processes"], r["mesh"], r["dtype"], r["budget"], r["length"]) == (
        "v5e:2x2", 4, 1, [1, 4], "bfloat16", 64, 1024)
    for name in ("prefill", "decode"):
        prog = r["programs"][name]
        assert PROGRAM <= set(prog)
        assert prog["peak_bytes_per_chip"] == (prog["argument_bytes"] + prog["output_bytes"]
                                               - prog["alias_bytes"] + prog["temp_bytes"]) > 0
        assert prog["flops"] > 0 and prog["bytes_accessed"] > 0 and prog["roofline_s"] > 0
    assert r["chip"]["name"] == "TPU v5e" and "cloud.google.com" in r["chip"]["source"]
    assert r["fits"] and r["verdict"].startswith("fits: ")
    assert r["programs"]["decode"]["alias_bytes"] > 0  # the cache is donated to decode


@pytest.mark.parametrize("policy", ["valuediff", "snapkv"])
def test_evicting_peak_is_flat_dense_grows(sweep, policy):
    def peak(p, n):
        return sweep[p, n]["peak_bytes_per_chip"]

    # the prompt's int32 tokens are the only input that grows (16k tokens: 64 KB); the cache does not
    assert peak(policy, 16384) - peak(policy, 1024) <= 4 * (16384 - 1024)
    assert sweep[policy, 16384]["programs"]["decode"]["output_bytes"] == \
        sweep[policy, 1024]["programs"]["decode"]["output_bytes"]
    # dense holds every token: 2 layers x (k, v) x 4 KV heads x 8 dims x 2 bytes / 4 chips per token at least
    assert peak("dense", 16384) - peak("dense", 1024) >= (16384 - 1024) * 2 * 2 * 4 * 8 * 2 / 4
    assert peak("dense", 4096) > peak("dense", 1024)
    # evicting prefill's work grows with the prompt (blocks), its decode step does not
    assert sweep[policy, 16384]["programs"]["prefill"]["flops"] > 10 * sweep[policy, 1024]["programs"][
        "prefill"]["flops"]
    assert sweep[policy, 16384]["programs"]["decode"]["flops_per_step"] == \
        sweep[policy, 1024]["programs"]["decode"]["flops_per_step"]


@pytest.mark.parametrize("kv_quant,group,bits", [("int8", None, 8), ("int4", 4, 4)])
def test_quantized_cache_is_smaller_on_chip(sweep, kv_quant, group, bits):
    """kv_quant: the bytes decode reads per step shrink by exactly the cache's bytes on one chip
    (XLA's argument and output bytes by at least that):
    2 layers x (k, v) x 1 KV head per chip x the slots x (codes + bf16 scale and zero)."""
    r = aot(CFG, topology_name="v5e:2x2", mesh=(1, 4), length=1024, policy="valuediff", budget=64,
            new_tokens=16, model="tiny", kv_quant=kv_quant, kv_group=group)
    base = sweep["valuediff", 1024]
    g = group or CFG.head_dim
    per_token = {"bf16": CFG.head_dim * 2, "q": CFG.head_dim * bits // 8 + 2 * 2 * (CFG.head_dim // g)}
    assert r["cache_slots"] == base["cache_slots"] >= 64
    saved = 2 * 2 * 1 * r["cache_slots"] * (per_token["bf16"] - per_token["q"])
    dec, dec0 = r["programs"]["decode"], base["programs"]["decode"]
    assert (r["kv_quant"], r["kv_group"]) == (kv_quant, g)
    assert dec0["bytes_per_step"] - dec["bytes_per_step"] == saved  # read once a step, one head per chip
    # XLA's own counts of the carry going in and out shrink too (by more here: TPU tiles pad a tiny cache)
    assert dec0["output_bytes"] - dec["output_bytes"] >= saved
    assert dec0["argument_bytes"] - dec["argument_bytes"] >= saved


def test_smooth_keys_compile_for_tpu(sweep):
    """kv_quant="int4-smooth" compiles for a v5e slice; decode reads int4's bytes plus the keys' fixed
    centre and factor (bf16 [K, D] per layer and row: at most a few slots' worth), far below bf16's."""
    kw = dict(topology_name="v5e:2x2", mesh=(1, 4), length=1024, policy="valuediff", budget=64,
              new_tokens=16, model="tiny", kv_group=4)
    smooth, plain = aot(CFG, kv_quant="int4-smooth", **kw), aot(CFG, kv_quant="int4", **kw)
    assert smooth["kv_quant"] == "int4-smooth" and smooth["cache_slots"] == plain["cache_slots"]
    s, p = smooth["programs"]["decode"]["bytes_per_step"], plain["programs"]["decode"]["bytes_per_step"]
    calib = 2 * 2 * 1 * CFG.head_dim * 2  # layers x (centre, factor) x 1 KV head per chip x D x bf16
    assert p <= s <= p + calib, (s, p)
    assert s < sweep["valuediff", 1024]["programs"]["decode"]["bytes_per_step"]


def test_multi_host_slice():
    """v5e:4x4: 16 chips on 4 hosts, one program for the whole slice."""
    r = aot(CFG, topology_name="v5e:4x4", mesh=(2, 8), length=2048, policy="valuediff", budget=64, batch=2,
            new_tokens=16)
    assert (r["chips"], r["processes"], r["mesh"]) == (16, 4, [2, 8])
    assert r["programs"]["prefill"]["peak_bytes_per_chip"] > 0


def test_analytic_flops_match_xla_on_one_iteration():
    """One block (T <= block size), layers unrolled: XLA counts every op once, as the program runs it, and the
    analytic prefill count is within 5 % of XLA's. Past the cache fill XLA counts the block scan's body once
    (its cost analysis does not multiply loop bodies): 4x the blocks, the same XLA count, 4x the analytic
    one."""
    cfg = tiny_config(hidden_size=1024, intermediate_size=4096, num_heads=16, num_kv_heads=8, head_dim=64,
                      vocab_size=4096)
    one, four, sixteen = (aot(cfg, topology_name="v5e:2x2", mesh=(1, 1), length=n, policy="valuediff",
                              budget=256, new_tokens=4, layer_scan=False)["programs"]["prefill"]
                          for n in (128, 512, 2048))
    assert one["flops"] == pytest.approx(one["xla_flops_loop_bodies_once"], rel=0.05)
    assert sixteen["flops"] == pytest.approx(4 * four["flops"], rel=0.01)
    xla = "xla_flops_loop_bodies_once"
    assert sixteen[xla] == pytest.approx(four[xla], rel=0.01)


def test_bad_topology_and_mesh():
    with pytest.raises(ValueError, match="topology='v9x:2x2'"):
        aot(CFG, topology_name="v9x:2x2")
    with pytest.raises(ValueError, match="mesh=3x1 does not divide the 4 chips of v5e:2x2"):
        aot(CFG, topology_name="v5e:2x2", mesh=(3, 1), length=64, budget=16)
    with pytest.raises(ValueError, match="v5e-3"):
        aot(CFG, topology_name="v5e-3")


def test_cli_json_and_does_not_fit(tmp_path):
    """`vdjax aot` on Qwen3-8B's public config: one v5e chip (16 GB) cannot hold its 16.4 GB of bf16
    weights."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vdjax.app.cli", "aot", "--model",
         str(TESTS / "data" / "configs" / "qwen3-8b"),
         "--topology", "v5e-1", "--mesh", "1x1", "--length", "8192", "--policy", "dense", "--new", "16",
         "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert FIELDS <= set(r) and r["chips"] == 1 and r["dtype"] == "bfloat16" and r["policy"] == "dense"
    assert not r["fits"]
    assert "does not fit: " in proc.stdout and "GiB of 14.9 GiB per chip" in proc.stdout
    assert r["programs"]["prefill"]["argument_bytes"] > 16e9  # the weights, one chip

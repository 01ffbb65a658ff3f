"""Several hosts on one machine: two JAX processes (`jax.distributed` on 127.0.0.1, gloo CPU collectives, 2
CPU devices each) run `vdjax.run` / `prefill` on one ("data", "model") mesh spanning both, and both get the
tokens and kept positions one process computes alone, ragged rows (padded to the "data" size) included.

The children are started at once, with a free port, bounded timeouts and always ended; the reference runs in
this process meanwhile.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from helpers import policy_kwargs, random_ids, random_params, tiny_config  # noqa: E402

LENGTHS = (37, 20, 45, 9, 30)  # 5 ragged rows: 2-way "data" pads them to 6
RUN = dict(block_size=8, max_new_tokens=8)
POLICIES = {"valuediff": 12, "snapkv": 12, "adakv:snapkv": 12, "kvzip": 12, "dense": None}


def _model():
    """The tiny model (4 KV heads: split by a 2-way "model" axis) and the ragged batch."""
    cfg = tiny_config(num_heads=8, num_kv_heads=4)
    ids = [random_ids(n, cfg.vocab_size, seed=100 + n).tolist() for n in LENGTHS]
    return random_params(cfg, seed=1), ids


def _kept(cache) -> list:
    return np.sort(np.asarray(cache.pos), axis=-1).tolist()


def _runs(mesh=None) -> dict:
    """{policy: tokens and kept positions} of the ragged batch; one prefill's kept positions and logits."""
    import vdjax

    params, ids = _model()
    out = {}
    for policy, budget in POLICIES.items():
        gen = vdjax.run(params, ids, policy, budget=budget, mesh=mesh, **RUN, **policy_kwargs(policy, params))
        out[policy] = {"tokens": gen.tokens.tolist(), "kept": _kept(gen.cache)}
    cache, logits = vdjax.prefill(params, ids, "valuediff", budget=12, block_size=8, mesh=mesh)
    out["prefill"] = {"kept": _kept(cache), "logits": np.round(np.asarray(logits), 4).tolist()}
    out["generate"] = vdjax.generate(params, ids[:2], "tova", budget=12, mesh=mesh, **RUN).tolist()
    return out


def _child(process: int, port: int) -> dict:
    """One of the two processes: join the cluster, run on a 2 x 2 mesh over all four devices."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process,
                               initialization_timeout=120)
    import vdjax

    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = vdjax.make_mesh(data=2, model=2)
    assert {d.process_index for d in mesh.devices.flat} == {0, 1}
    out = _runs(mesh)
    out["process"] = jax.process_index()
    jax.distributed.shutdown()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results():
    """(one process's results, [each child's results])."""
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    code = (f"import sys, json; sys.path.insert(0, {str(TESTS)!r}); import test_multihost as t; "
            "print(json.dumps(t._child(int(sys.argv[1]), int(sys.argv[2]))))")
    children = [subprocess.Popen([sys.executable, "-c", code, str(i), str(port)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        ref = _runs()
        got = []
        for child in children:
            stdout, stderr = child.communicate(timeout=600)
            assert child.returncode == 0, stderr[-3000:]
            got.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
    return ref, got


@pytest.mark.parametrize("policy", list(POLICIES))
def test_two_processes_equal_one(results, policy):
    ref, got = results
    for child in got:
        assert child[policy]["tokens"] == ref[policy]["tokens"], (child["process"], policy)
        assert child[policy]["kept"] == ref[policy]["kept"], (child["process"], policy)


def test_prefill_and_generate_come_back_to_every_process(results):
    ref, got = results
    assert sorted(c["process"] for c in got) == [0, 1]
    for child in got:
        assert child["prefill"]["kept"] == ref["prefill"]["kept"]
        np.testing.assert_allclose(child["prefill"]["logits"], ref["prefill"]["logits"], atol=2e-4)
        assert child["generate"] == ref["generate"]
    assert len(ref["valuediff"]["tokens"]) == len(LENGTHS)  # the padding row is dropped again

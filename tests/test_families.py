"""Qwen2, Qwen3, Gemma2, Gemma3: tiny random HF models equal HF (fp32, eager); eviction at full budget is
dense; sliding layers never hold a token outside their window."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_parity import hf_logits, rel_err  # noqa: E402

import vdjax  # noqa: E402
from vdjax.models import transformer as tf  # noqa: E402
from vdjax.models.hf_config import from_hf_config  # noqa: E402

from helpers import policy_kwargs  # noqa: E402

V, T = 101, 80  # vocab; prompt length (> every sliding window below)
W = 16


def _randomize(model, seed):
    """Weights far from the default init: peaked attention, norms away from their identity values."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            else:  # biases
                p.normal_(0, 0.3)


def _qwen2(heads, kv, tied):
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, hidden_size=8 * heads, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
        tie_word_embeddings=tied, attn_implementation="eager"))


def _qwen3(heads, kv, tied, bias=False, sliding=False):
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=16, max_position_embeddings=256, tie_word_embeddings=tied,
        attention_bias=bias, use_sliding_window=sliding, sliding_window=W if sliding else None,
        max_window_layers=1, attn_implementation="eager",
        layer_types=["full_attention"] + ["sliding_attention" if sliding else "full_attention"] * 2))


def _gemma2(heads, kv, softcaps=(50.0, 30.0)):
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=16, query_pre_attn_scalar=24, sliding_window=W,
        attn_logit_softcapping=softcaps[0], final_logit_softcapping=softcaps[1], max_position_embeddings=256,
        attn_implementation="eager"))


def _gemma3(heads, kv, linear=False, layers=3):
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6} if linear else {"rope_type": "default",
                                                                                      "rope_theta": 1e6}
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=W,
        layer_types=None if layers == 7 else ["sliding_attention"] * (layers - 1) + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": full},
        max_position_embeddings=512, attn_implementation="eager"))


FAMILIES = {
    "qwen2_14to2": lambda: _qwen2(14, 2, False),
    "qwen2_mha_tied": lambda: _qwen2(4, 4, True),
    "qwen3_gqa_tied": lambda: _qwen3(4, 2, True),
    "qwen3_bias_sliding": lambda: _qwen3(4, 1, False, bias=True, sliding=True),
    "gemma2_gqa": lambda: _gemma2(4, 2),
    "gemma2_hard_softcaps": lambda: _gemma2(4, 1, softcaps=(2.0, 3.0)),
    "gemma3_mqa": lambda: _gemma3(4, 1),
    # 7 layers: HF's default 5:1 pattern
    "gemma3_gqa_linear_rope_7layers": lambda: _gemma3(4, 2, linear=True, layers=7),
}
# The eviction tests (one compile per policy) run on one model per family, the one with sliding layers if any.
EVICTION = {"qwen2_14to2", "qwen3_bias_sliding", "gemma2_gqa", "gemma3_mqa"}


_BUILT: dict = {}


def _build(name, tmp_path_factory):
    """(name, HF folder, torch model, vdjax params) of one tiny random model, built once per session."""
    if name not in _BUILT:
        model = FAMILIES[name]().eval()
        _randomize(model, seed=sorted(FAMILIES).index(name))
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, safe_serialization=True)
        _BUILT[name] = (name, folder, model, vdjax.load(folder))
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(EVICTION))
def evicting_family(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def test_dense_logits_match_hf(family):
    name, _, model, params = family
    cfg = params.config
    assert cfg.family == name.split("_")[0]
    if "sliding" in name or "gemma" in name:
        assert "sliding_attention" in cfg.layer_types and cfg.sliding_window == W < T
    if name.endswith("7layers"):  # Gemma3's default pattern: 5 sliding, 1 global, ...
        assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    ids = np.random.RandomState(1).randint(0, V, size=(2, T))
    ref = hf_logits(model, ids)
    got = np.asarray(tf.forward(params, jnp.asarray(ids)))
    err = rel_err(got, ref)
    assert err < 1e-4, err
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    for block in (16, 128):  # block pipeline, dense and evicting with N >= T, gives the same last logits
        for policy, budget in (("dense", None), ("valuediff", T)):
            _, last = vdjax.prefill(params, ids, policy=policy, budget=budget, block_size=block)
            assert rel_err(last, ref[:, -1]) < 1e-4, (policy, block)


NEW = 6


def test_full_budget_is_dense_every_policy(evicting_family):
    name, _, _, params = evicting_family
    ids = [np.random.RandomState(2).randint(0, V, size=T),
           np.random.RandomState(3).randint(0, V, size=T - 13)]
    dense = vdjax.generate(params, ids, "dense", max_new_tokens=NEW, eos_token_id=[])
    for policy in vdjax.POLICIES:
        if policy == "dense":
            continue
        out = vdjax.generate(params, ids, policy, budget=T + NEW, block_size=7, max_new_tokens=NEW,
                             eos_token_id=[], **policy_kwargs(policy, params))
        np.testing.assert_array_equal(out, dense, err_msg=f"{name} {policy}")
        jax.clear_caches()  # this policy is done: keep the memory maps of compiled programs few (conftest)


@pytest.mark.parametrize("policy", ["valuediff", "snapkv", "h2o", "dense"])
def test_sliding_layers_hold_only_live_tokens(evicting_family, policy):
    """After every block and decode step, a sliding layer's valid positions p satisfy next_pos - p < W, and it
    holds exactly min(N, W - 1, seen) of them (all the live ones when they fit);
    global layers hold min(N, seen).

    Rows of lengths 8, 16, ..., 80 (one ragged batch, rows evict independently)
    show the cache after each block.
    """
    name, _, _, params = evicting_family
    cfg = params.config
    if cfg.sliding_window is None:
        assert name.startswith("qwen2")  # the one family model without sliding layers
        return
    n, block = 24, 8  # N > W: a sliding layer could hoard dead tokens if eviction did not drop them
    budget = None if policy == "dense" else n
    ids = np.random.RandomState(4).randint(0, V, size=T)
    rows = [ids[:t] for t in range(block, T + 1, block)]
    seen = np.array([len(r) for r in rows])
    cache, _ = vdjax.prefill(params, rows, policy=policy, budget=budget, block_size=block)
    _check_live(cfg, cache, seen, n if budget else None)
    if budget:  # sliding layers are sized to the W - 1 tokens that can be live (N > W - 1 here)
        assert cache.slots == tuple(n if cfg.window(i) is None else W - 1 for i in range(cfg.num_layers))
        assert cache.pos.shape[-1] == n and cache.budget == n
    gen = vdjax.run(params, rows, policy, budget=budget, block_size=block, max_new_tokens=4, eos_token_id=[])
    _check_live(cfg, gen.cache, seen + 3, n if budget else None)  # the last sampled token is not fed


def _check_live(cfg, cache, seen, n):
    for i, lc in enumerate(cache.layers):
        w = cfg.window(i)
        for row, pos in enumerate(np.asarray(lc.pos)):  # [K, N] per row
            for head in pos:
                kept = np.sort(head[head >= 0])
                assert len(set(kept.tolist())) == len(kept)
                cap = seen[row] if n is None else min(n, seen[row])
                if w is None:
                    assert len(kept) == cap, (i, row, len(kept))
                else:
                    assert (seen[row] - kept < w).all(), (i, row, kept)  # seen = next position to be fed
                    assert len(kept) == min(cap, w - 1), (i, row, len(kept))


def test_qwen3_duplicate_tied_lm_head_checked_then_dropped(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _qwen3(4, 2, True).eval()
    _randomize(model, 0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    sd = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in sd
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    params = vdjax.load(tmp_path)
    assert "lm_head" not in params.weights
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        vdjax.load(tmp_path)


def test_gemma3_multimodal_checkpoint_loads_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (weights under model.language_model.*, a vision tower beside
    them) gives the text model's logits."""
    text = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=W,
        layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                                    image_token_id=V - 1, boi_token_id=V - 2, eoi_token_id=V - 3)
    cfg._attn_implementation = "eager"
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    _randomize(model, 5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    keys = json.loads((tmp_path / "config.json").read_text())
    assert keys["architectures"] == ["Gemma3ForConditionalGeneration"]
    params = vdjax.load(tmp_path)
    ids = np.random.RandomState(1).randint(0, V - 3, size=(1, 40))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).logits.float().numpy()
    assert rel_err(tf.forward(params, jnp.asarray(ids)), ref) < 1e-4


@pytest.mark.parametrize("change, match", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "hidden_act='relu'"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}},
     "rope type 'longrope'"),
    ({"some_new_switch": 3}, "some_new_switch=3"),
    ({"layer_types": ["chunked_attention"] * 2}, "chunked_attention"),
])
def test_config_refuses_unhandled_math_by_name(change, match):
    base = transformers.Gemma3TextConfig(vocab_size=V, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                         head_dim=16).to_dict()
    base["architectures"] = ["Gemma3ForCausalLM"]
    from_hf_config(base)
    with pytest.raises(ValueError, match=match):
        from_hf_config(base | change)


def test_gemma3_older_config_keys():
    """transformers 4.x Gemma3 configs: sliding_window_pattern, rope_local_base_freq,
    a global-only rope_scaling."""
    hf = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": V, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
          "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256}
    cfg = from_hf_config(hf)
    assert cfg.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
    assert cfg.rope(0) == (1e4, {}) and cfg.rope(5) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert cfg.window(0) == 512 and cfg.window(5) is None and cfg.attn_scale == 256 ** -0.5
    base = 1.0 / (1e6 ** (np.arange(0, 16, 2) / 16))
    np.testing.assert_allclose(tf.rope_inv_freq(cfg, *cfg.rope(5)), base / 8, rtol=1e-6)
    np.testing.assert_allclose(tf.rope_inv_freq(cfg, *cfg.rope(0)), 1.0 / (1e4 ** (np.arange(0, 16, 2) / 16)),
                               rtol=1e-6)

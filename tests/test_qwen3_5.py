"""Qwen3.5: gated attention + Gated DeltaNet, tiny random HF models (fp32, eager) against vdjax.

Prompts of 150 tokens span three DeltaNet chunks (64) and many blocks; block sizes 7 and 48 are
not multiples of the chunk."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_parity import hf_logits, rel_err  # noqa: E402

import vdjax  # noqa: E402
from vdjax.models import deltanet as dn  # noqa: E402
from vdjax.models import transformer as tf  # noqa: E402
from vdjax.models.deltanet import LinearState  # noqa: E402

from helpers import policy_kwargs  # noqa: E402

V, T, NEW = 128, 150, 6
PATTERNS = {
    "interval4_untied": dict(layers=4, interval=4, tied=False),  # linear, linear, linear, full
    "alternating_tied": dict(layers=4, types=["linear_attention", "full_attention"] * 2, tied=True),
    "full_first": dict(layers=3, types=["full_attention", "linear_attention", "linear_attention"],
                       tied=False),
}


def _config(layers, tied, interval=None, types=None):
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4,
              rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True),
              rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=tied,
              attn_implementation="eager")
    if types is not None:
        kw["layer_types"] = types
    if interval is not None:
        kw["full_attention_interval"] = interval
    return transformers.Qwen3_5TextConfig(**kw)


def _randomize(model, seed):
    """Away from the init: (1+w) norms start at 0, the DeltaNet norm at 1; perturb every parameter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            scale = 0.15 if p.dim() >= 2 else 0.3
            p.add_(torch.randn_like(p) * scale)


_BUILT: dict = {}


def _build(name, tmp_path_factory):
    """(HF model, folder, vdjax params) of one tiny random Qwen3.5, built once per session."""
    if name not in _BUILT:
        torch.manual_seed(100 + sorted(PATTERNS).index(name))  # the init too: the same model in every run
        model = transformers.Qwen3_5ForCausalLM(_config(**PATTERNS[name])).eval()
        _randomize(model, sorted(PATTERNS).index(name))
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, safe_serialization=True)
        _BUILT[name] = (model, folder, vdjax.load(folder))
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def qwen(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def interval4(tmp_path_factory):
    return _build("interval4_untied", tmp_path_factory)


def _ids(seed, n=T):
    return np.random.RandomState(seed).randint(0, V, size=n)


def test_config_and_dense_logits_match_hf(qwen):
    model, _, params = qwen
    cfg = params.config
    assert cfg.family == "qwen3_5" and cfg.attn_gate and cfg.rotary_dim == 8 and cfg.norm_offset == 1.0
    assert tuple(model.config.layer_types) == cfg.layer_types
    assert cfg.tie_embeddings == model.config.tie_word_embeddings
    assert cfg.attention_layers == tuple(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    ids = np.stack([_ids(1), _ids(2)])
    ref = hf_logits(model, ids)
    got = np.asarray(tf.forward(params, jnp.asarray(ids)))
    assert rel_err(got, ref) < 1e-4, rel_err(got, ref)
    for block in (7, 48, 200):  # block pipeline (chunked DeltaNet per block), dense and evicting with N >= T
        for policy, budget in (("dense", None), ("valuediff", T)):
            _, last = vdjax.prefill(params, ids, policy=policy, budget=budget, block_size=block)
            assert rel_err(last, ref[:, -1]) < 1e-4, (policy, block)


def _hf_greedy(model, ids, new):
    with torch.no_grad():
        out = model.generate(torch.tensor(ids[None], dtype=torch.long), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].numpy()


def test_every_policy_at_full_budget_gives_hf_greedy_tokens(interval4):
    model, _, params = interval4
    ids = _ids(3)
    want = _hf_greedy(model, ids, NEW)
    for policy in vdjax.POLICIES:
        kw = policy_kwargs(policy, params)
        budget = None if policy == "dense" else T + NEW
        out = vdjax.generate(params, ids, policy, budget=budget, block_size=48, max_new_tokens=NEW,
                             eos_token_id=[], **kw)
        np.testing.assert_array_equal(out[0], want, err_msg=policy)
        jax.clear_caches()  # this policy is done: keep the memory maps of compiled programs few (conftest)


def _hf_states(model, ids):
    """HF's DeltaNet states after a prefill: {layer: (conv [B, C, K] (last K
    inputs), rec [B, Hv, dk, dv])}."""
    with torch.no_grad():
        cache = model(input_ids=torch.tensor(ids, dtype=torch.long), use_cache=True).cache
    return {i: (cache.get_conv_state(i).numpy(), cache.get_recurrent_state(i).numpy())
            for i, t in enumerate(model.config.layer_types) if t == "linear_attention"}


def test_state_after_blocks_equals_one_pass_and_hf(interval4):
    """The DeltaNet state after block prefill with B = 7, 64, 128 equals the one-block pass and HF's cache."""
    model, _, params = interval4
    ids = np.stack([_ids(4)])
    hf = _hf_states(model, ids)
    whole, _ = vdjax.prefill(params, ids, "dense", block_size=T)
    for block in (7, 64, 128):
        cache, _ = vdjax.prefill(params, ids, "valuediff", budget=T, block_size=block)  # N >= T: no eviction
        for i, (conv, rec) in hf.items():
            state = cache[i]
            assert isinstance(state, LinearState)
            np.testing.assert_allclose(state.rec, whole[i].rec, rtol=1e-4, atol=1e-5)
            # block vs one pass rounding
            np.testing.assert_allclose(state.conv, whole[i].conv, rtol=1e-4, atol=5e-5)
            np.testing.assert_allclose(state.rec, rec, rtol=1e-3, atol=2e-5)  # HF's rule in fp32 too
            np.testing.assert_allclose(state.conv, conv[:, :, 1:].transpose(0, 2, 1), rtol=1e-4, atol=5e-5)


def test_recurrent_step_equals_chunked_form():
    rng = np.random.RandomState(5)
    b, s, hv, dk, dv = 2, 70, 3, 8, 5
    q, k = (jnp.asarray(dn._l2(jnp.asarray(rng.randn(b, s, hv, dk), jnp.float32))) for _ in range(2))
    v = jnp.asarray(rng.randn(b, s, hv, dv), jnp.float32)
    g = jnp.asarray(-np.abs(rng.randn(b, s, hv)) * 0.3, jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.randn(b, s, hv))), jnp.float32)
    rec0 = jnp.asarray(rng.randn(b, hv, dk, dv) * 0.1, jnp.float32)
    outs, rec = [], rec0
    for t in range(s):
        o, rec = dn.recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], rec)
        outs.append(o)
    for chunk in (64, 16, 7):
        o_c, rec_c = dn.chunked(q, k, v, g, beta, rec0, chunk=chunk)
        np.testing.assert_allclose(o_c, np.stack(outs, 1), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(rec_c, rec, rtol=1e-4, atol=1e-5)
    # padding steps (g = 0, beta = 0) change nothing
    o_p, rec_p = dn.chunked(q, k, v, g.at[:, 40:].set(0.0), beta.at[:, 40:].set(0.0), rec0)
    o_40, rec_40 = dn.chunked(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], rec0)
    np.testing.assert_allclose(rec_p, rec_40, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(o_p[:, :40], o_40, rtol=1e-5, atol=1e-6)


def test_decode_steps_follow_hf(interval4):
    """Greedy decoding through the recurrent form and the conv state = HF's cached decoding."""
    model, _, params = interval4
    ids = _ids(6, 70)
    want = _hf_greedy(model, ids, 12)
    dense = vdjax.generate(params, ids, "dense", block_size=16, max_new_tokens=12, eos_token_id=[])
    np.testing.assert_array_equal(dense[0], want)
    # one decode step after a prefill = the last logits of a prefill one token longer
    cache, last = vdjax.prefill(params, np.concatenate([ids, want[:1]]), "dense", block_size=16)
    with_step = vdjax.run(params, ids, "dense", block_size=16, max_new_tokens=2, eos_token_id=[])
    assert with_step.tokens[0, 1] == int(np.argmax(np.asarray(last)[0])) == want[1]


def test_ragged_rows_equal_their_single_runs(interval4):
    _, _, params = interval4
    rows = [_ids(7, 150), _ids(8, 61), _ids(9, 100)]
    batch = vdjax.run(params, rows, "valuediff", budget=32, block_size=16, max_new_tokens=5, eos_token_id=[])
    for r, ids in enumerate(rows):
        alone = vdjax.run(params, ids, "valuediff", budget=32, block_size=16, max_new_tokens=5,
                          eos_token_id=[])
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[r])
        for i in params.config.attention_layers:
            assert sorted(np.asarray(alone.cache[i].pos[0]).ravel().tolist()) == \
                sorted(np.asarray(batch.cache[i].pos[r]).ravel().tolist())
        for i, t in enumerate(params.config.layer_types):
            if t == "linear_attention":
                np.testing.assert_allclose(batch.cache[i].rec[r], alone.cache[i].rec[0], rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(batch.cache[i].conv[r], alone.cache[i].conv[0], rtol=1e-4,
                                           atol=1e-5)


@pytest.mark.parametrize("policy", [p for p in vdjax.POLICIES if p != "dense"])
def test_attention_layers_hold_min_n_seen_after_every_block(interval4, policy):
    _, _, params = interval4
    budget, block = 12, 8
    ids = _ids(10, 40)
    rows = [ids[:n] for n in (5, 8, 16, 24, 40)]
    cache, _ = vdjax.prefill(params, rows, policy, budget=budget, block_size=block,
                             **policy_kwargs(policy, params))
    pos = np.asarray(cache.pos)
    assert pos.shape[0] == len(params.config.attention_layers)
    for layer, b, h in np.ndindex(pos.shape[:3]):
        valid = pos[layer, b, h][pos[layer, b, h] >= 0]
        assert len(valid) == min(budget, len(rows[b])) and len(set(valid.tolist())) == len(valid)


def test_multimodal_layout_checkpoint_loads(tmp_path, interval4):
    """The released checkpoints' layout: Qwen3_5ForConditionalGeneration, text weights under
    model.language_model.*, the vision tower (model.visual.*) and mtp.* beside them: ignored."""
    model, folder, params = interval4
    from safetensors.numpy import load_file, save_file

    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(folder / "model.safetensors").items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((6, 2), np.float32)
    tensors["mtp.norm.weight"] = np.zeros((64,), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((folder / "config.json").read_text())
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": {k: v for k, v in text.items()
                           if k not in ("architectures", "tie_word_embeddings")},
           "vision_config": {"depth": 1}, "image_token_id": 5, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mm = vdjax.load(tmp_path)
    assert mm.config == params.config
    jax.tree.map(np.testing.assert_array_equal, mm.weights, params.weights)


def test_refusals_name_the_setting():
    from vdjax.models.hf_config import from_hf_config

    base = _config(4, False, interval=4).to_dict()
    with pytest.raises(ValueError, match="attention_bias=True \\(not handled for Qwen3.5\\)"):
        from_hf_config(dict(base, attention_bias=True))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        from_hf_config(dict(base, hidden_act="gelu"))
    llama = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64).to_dict()
    llama["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError,
                       match="partial_rotary_factor=0.5 \\(partial RoPE is handled for Qwen3.5 only\\)"):
        from_hf_config(llama)


def test_geometry_and_hybrid_fit_on_attention_layers_only(interval4):
    """Statistics and the hybrid fit cover the attention layers; Gated DeltaNet
    rows are NaN (mix 1, unused)."""
    from vdjax.analysis import geometry as G
    from vdjax.analysis import hybrid as HY

    _, _, params = interval4
    cfg = params.config
    geo = G.analyze(params, [_ids(11, 96).tolist(), _ids(12, 96).tolist()], topk=8, n_queries=8, margin=4)
    linear = [i for i in range(cfg.num_layers) if not cfg.attends(i)]
    for i in range(cfg.num_layers):
        assert np.isfinite(geo.heads["sigma_k"][i]).all() == cfg.attends(i)
        assert geo.measured(i) == cfg.attends(i)
    agg = geo.aggregate()
    assert np.isfinite(agg["ratio"]) and np.isfinite(agg["sink_rate"]) and np.isfinite(agg["bos_cos"])
    assert np.all(HY.geometry_mix(geo)[linear] == 1.0)
    mix, info = HY.fit(params, [_ids(13, 64).tolist(), _ids(14, 64).tolist()], budget=16, block=16, steps=2)
    assert mix.shape == (cfg.num_layers, cfg.num_kv_heads) and len(info) == len(cfg.attention_layers)
    assert np.all(mix[linear] == 1.0)
    out = vdjax.generate(params, _ids(15, 60), "hybrid", budget=16, block_size=16, max_new_tokens=3, mix=mix)
    assert out.shape == (1, 3)

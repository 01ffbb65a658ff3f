"""GPT-OSS: learned sinks, mixture of experts, YaRN, sliding layers, MXFP4, against tiny random HF models
(fp32, eager). Prompts of 60 tokens are several windows (8) long; both layer orders
(sliding first, full first)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_parity import hf_logits, rel_err  # noqa: E402

import vdjax  # noqa: E402
from vdjax.convert import mxfp4  # noqa: E402
from vdjax.models import moe as M  # noqa: E402
from vdjax.models import transformer as tf  # noqa: E402
from vdjax.models.hf_config import from_hf_config  # noqa: E402

from helpers import policy_kwargs  # noqa: E402

V, T, NEW, W = 128, 60, 6, 8
ORDERS = {"sliding_first": ["sliding_attention", "full_attention"] * 2,
          "full_first": ["full_attention", "sliding_attention"] * 2}
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}


def _config(types, **kw):
    args = dict(vocab_size=V, hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=len(types), layer_types=types, num_local_experts=4,
                num_experts_per_tok=2, sliding_window=W, max_position_embeddings=256, rope_parameters=YARN,
                attn_implementation="eager")
    return transformers.GptOssConfig(**(args | kw))


def _randomize(model, seed):
    """Away from the init (tiny sinks, zero expert biases, unit norms); expert weights large enough that the
    SwiGLU clamp at 7 is reached."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "experts" in name:
                p.normal_(0.0, 0.3)


_BUILT: dict = {}


def _build(order, tmp_path_factory):
    """(HF model, folder, vdjax params) of one tiny random GPT-OSS, built once per session."""
    if order not in _BUILT:
        seed = sorted(ORDERS).index(order)
        torch.manual_seed(200 + seed)
        model = transformers.GptOssForCausalLM(_config(ORDERS[order])).eval()
        _randomize(model, seed)
        folder = tmp_path_factory.mktemp(order)
        model.save_pretrained(folder, safe_serialization=True)
        _BUILT[order] = (model, folder, vdjax.load(folder))
    return _BUILT[order]


@pytest.fixture(scope="module", params=sorted(ORDERS))
def gpt(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def sliding_first(tmp_path_factory):
    return _build("sliding_first", tmp_path_factory)


def _ids(seed, n=T):
    return np.random.RandomState(seed).randint(0, V, size=n)


def test_config_and_dense_logits_match_hf(gpt):
    model, _, params = gpt
    cfg = params.config
    assert cfg.family == "gpt_oss" and cfg.sinks and cfg.qkv_bias and cfg.o_bias and cfg.norm_offset == 0.0
    assert (cfg.num_experts, cfg.experts_per_token, cfg.sliding_window) == (4, 2, W)
    assert cfg.layer_types == tuple(model.config.layer_types)
    assert cfg.rope_attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    ids = np.stack([_ids(1), _ids(2)])
    ref = hf_logits(model, ids)
    got = np.asarray(tf.forward(params, jnp.asarray(ids)))
    assert rel_err(got, ref) < 1e-4, rel_err(got, ref)
    for block in (7, 16, 64):  # block pipeline: dense and evicting with N >= T
        for policy, budget in (("dense", None), ("tova", T)):
            _, last = vdjax.prefill(params, ids, policy=policy, budget=budget, block_size=block)
            assert rel_err(last, ref[:, -1]) < 1e-4, (policy, block)


def _hf_greedy(model, ids, new):
    with torch.no_grad():
        out = model.generate(torch.tensor(ids[None], dtype=torch.long), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].numpy()


def test_every_policy_at_full_budget_gives_hf_greedy_tokens(gpt):
    model, _, params = gpt
    ids = _ids(3)
    want = _hf_greedy(model, ids, NEW)
    for policy in vdjax.POLICIES:
        kw = policy_kwargs(policy, params)
        budget = None if policy == "dense" else T + NEW
        out = vdjax.generate(params, ids, policy, budget=budget, block_size=16, max_new_tokens=NEW,
                             eos_token_id=[], **kw)
        np.testing.assert_array_equal(out[0], want, err_msg=policy)
        jax.clear_caches()  # this policy is done: keep the memory maps of compiled programs few (conftest)


def test_sliding_layers_hold_only_live_tokens(sliding_first):
    """After prefill + decode, a sliding layer's valid slots are exactly the last W - 1 positions (what the
    next query can see besides itself), a full layer's min(N, seen) positions."""
    _, _, params = sliding_first
    cfg, budget = params.config, 24
    for policy in ("dense", "valuediff", "tova"):
        g = vdjax.run(params, _ids(4), policy, budget=None if policy == "dense" else budget, block_size=16,
                      max_new_tokens=5, eos_token_id=[])
        seen = T + 4  # the last sampled token is not in the cache
        for i in range(cfg.num_layers):
            pos = np.asarray(g.cache[i].pos[0])
            for h in range(cfg.num_kv_heads):
                valid = sorted(pos[h][pos[h] >= 0].tolist())
                if cfg.window(i):
                    assert valid == list(range(seen - W + 1, seen)), (policy, i)
                else:
                    assert len(valid) == (seen if policy == "dense" else budget), (policy, i)


def _hf_layer0_probs(model, ids):
    """HF's eager attention weights of layer 0 [Nq, T, T] (the sink column dropped)."""
    with torch.no_grad():
        out = model(torch.tensor(ids[None], dtype=torch.long), output_attentions=True)
    return out.attentions[0][0].double().numpy()


def _topn(scores, n):
    """Positions of the n largest scores, ties to the earlier position (the pipeline's rule)."""
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    return sorted(order[:n])


@pytest.mark.parametrize("policy", ["tova", "snapkv"])
def test_layer0_kept_positions_match_numpy_on_hf_attention(policy):
    """One block of T tokens cut to N: layer 0 keeps the top N of the score computed in NumPy from HF's
    sink-dropped weights (TOVA: the last query's weights averaged over all heads; SnapKV: the last 32 queries'
    votes per KV head, averaged over its query heads, max-pooled over 7 positions, the window protected).
    A full-attention layer 0 (full first): every query sees every earlier key."""
    torch.manual_seed(7)
    model = transformers.GptOssForCausalLM(_config(ORDERS["full_first"])).eval()
    _randomize(model, 7)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        params = vdjax.load(d)
    ids, n = _ids(5), 20
    probs = _hf_layer0_probs(model, ids)  # [Nq, T, T]
    assert np.all(probs.sum(-1) < 1 - 1e-6)  # the sink takes part of every row
    kh, g = params.config.num_kv_heads, params.config.group_size
    cache, _ = vdjax.prefill(params, ids, policy, budget=n, block_size=T)
    kept = np.asarray(cache[0].pos[0])
    for h in range(kh):
        heads = probs[h * g:(h + 1) * g]
        if policy == "tova":
            score = probs[:, -1].mean(0)
        else:
            window = 32
            votes = heads[:, T - window:].sum(1).mean(0)
            pooled = np.array([votes[max(0, j - 3):j + 4].max() for j in range(T)])
            score = np.where(np.arange(T) >= T - window, np.inf, pooled)
        assert sorted(kept[h].tolist()) == _topn(score, n), (policy, h)


def test_ragged_rows_equal_their_single_runs(sliding_first):
    _, _, params = sliding_first
    rows = [_ids(7, 60), _ids(8, 23), _ids(9, 41)]
    batch = vdjax.run(params, rows, "valuediff", budget=16, block_size=8, max_new_tokens=5, eos_token_id=[])
    for r, ids in enumerate(rows):
        alone = vdjax.run(params, ids, "valuediff", budget=16, block_size=8, max_new_tokens=5,
                          eos_token_id=[])
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[r])
        for i in range(params.config.num_layers):
            assert sorted(np.asarray(alone.cache[i].pos[0]).ravel().tolist()) == \
                sorted(np.asarray(batch.cache[i].pos[r]).ravel().tolist())


def test_dispatch_equals_all_experts_reference():
    """The sparse dispatch (CPU loop over selected experts, tiles, and ragged_dot) = every expert on every
    token, weighted; unselected experts and tile padding change nothing."""
    from vdjax.models import weights

    hf_cfg = _config(ORDERS["sliding_first"], num_local_experts=8, num_experts_per_tok=3)
    cfg = from_hf_config(hf_cfg.to_dict())
    lw = weights.init_params(cfg, seed=3).weights["layers"][0]
    x = jnp.asarray(np.random.RandomState(0).randn(37, cfg.hidden_size), jnp.float32)
    idx, w = M.route(lw, x, cfg)
    ref = M.dense_moe(lw, x, idx, w, cfg)
    for ragged in (False, True):
        got = M.grouped(lw, x, idx, w, cfg, ragged=ragged)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * float(jnp.abs(ref).max()))
    one = M.grouped(lw, x[:1], idx[:1], w[:1], cfg)  # decode: one token, only its k experts
    np.testing.assert_allclose(one, ref[:1], rtol=2e-5, atol=2e-5 * float(jnp.abs(ref).max()))
    # routing = HF's router: top-k of the logits, softmax over the k
    logits = np.asarray(x) @ np.asarray(lw["router_w"]) + np.asarray(lw["router_b"])
    top = np.sort(logits, axis=1)[:, ::-1][:, :3]
    np.testing.assert_allclose(w, np.exp(top) / np.exp(top).sum(1, keepdims=True), rtol=1e-5)
    assert (np.sort(np.asarray(idx), 1) == np.sort(np.argsort(-logits, 1)[:, :3], 1)).all()


@pytest.mark.parametrize("rope", [
    YARN,
    dict(YARN, truncate=True),
    {k: v for k, v in YARN.items() if k != "truncate"},  # HF's default: truncate
    dict(YARN, factor=32.0, rope_theta=150000.0, original_max_position_embeddings=4096),  # the released one
    dict(YARN, beta_fast=16.0, beta_slow=2.0, attention_factor=1.25),
    dict(YARN, mscale=1.0, mscale_all_dim=0.5),
])
def test_yarn_matches_hf_rope_init(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _config(ORDERS["sliding_first"], head_dim=64, hidden_size=64, max_position_embeddings=8192,
                 rope_parameters=dict(rope))
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = from_hf_config(hf.to_dict())
    np.testing.assert_allclose(tf.rope_inv_freq(cfg), inv.numpy(), rtol=1e-6)
    assert cfg.rope_attention_factor == pytest.approx(factor, rel=1e-12)


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.RandomState(0)
    blocks = rng.randint(0, 256, (3, 10, 2, 16)).astype(np.uint8)
    scales = rng.randint(118, 136, (3, 10, 2)).astype(np.uint8)
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    got = mxfp4.dequantize(blocks, scales)
    assert got.shape == tuple(ref.shape) == mxfp4.shape(blocks.shape) == (3, 64, 10)
    np.testing.assert_array_equal(got, ref.numpy())


def test_mxfp4_checkpoint_loads_and_matches_hf(tmp_path, sliding_first):
    """The released layout: expert tensors as *_blocks / *_scales with quant_method mxfp4, dequantized on
    load; logits = HF's (which dequantizes too on CPU)."""
    from safetensors.torch import load_file, save_file

    _, folder, _ = sliding_first
    torch.manual_seed(0)
    tensors = load_file(folder / "model.safetensors")
    packed = {}
    for key, value in tensors.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, n_in, n_out = value.shape
            packed[key + "_blocks"] = torch.randint(0, 256, (e, n_out, n_in // 32, 16), dtype=torch.uint8)
            packed[key + "_scales"] = torch.randint(122, 128, (e, n_out, n_in // 32), dtype=torch.uint8)
        else:
            packed[key] = value
    save_file(packed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    params = vdjax.load(tmp_path)
    assert params.config.quantization == "mxfp4"
    model = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    ids = _ids(10)[None]
    ref = hf_logits(model, ids)
    assert rel_err(np.asarray(tf.forward(params, jnp.asarray(ids))), ref) < 1e-4
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError,
                       match="quantization_config.quant_method='gptq' \\(GptOssForCausalLM reads"):
        vdjax.load(tmp_path)


def test_other_families_refuse_quantized_checkpoints():
    llama = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64).to_dict()
    with pytest.raises(ValueError, match="quant_method='mxfp4' \\(LlamaForCausalLM reads: none"):
        from_hf_config(dict(llama, quantization_config={"quant_method": "mxfp4"}))


def test_released_config_format_reads(tmp_path):
    """config.json as released: legacy rope_scaling + top-level rope_theta, experts_per_token and
    initial_context_length beside the HF names."""
    cfg = from_hf_config({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "intermediate_size": 2880,
        "layer_types": ORDERS["sliding_first"] * 6,
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999,
        "quantization_config": {"quant_method": "mxfp4"}})
    assert (cfg.num_experts, cfg.experts_per_token, cfg.head_dim, cfg.sliding_window) == (32, 4, 64, 128)
    assert cfg.rope_attention_factor == pytest.approx(1.3465735902799727)
    inv = tf.rope_inv_freq(cfg)
    np.testing.assert_allclose(inv[[0, 7, 8, 9, 12, 17, 18, 31]],
                               [1.0, 0.0737445652, 0.0508132756, 0.0317056961, 0.0067949593, 1.29318694e-4,
                                3.83088118e-5, 3.02351140e-7], rtol=1e-6)


def test_geometry_reports_learned_sink_mass(sliding_first):
    """`analyze` reports the mean learned-sink mass per layer/head: 1 - the weights over real tokens."""
    from vdjax.analysis import geometry as G

    model, _, params = sliding_first
    ids = _ids(11, 48)
    geo = G.analyze(params, [ids.tolist()], topk=8, n_queries=8, margin=4)
    mass = geo.heads["learned_sink"]  # [L, Nq]
    with torch.no_grad():
        probs = model(torch.tensor(ids[None]), output_attentions=True).attentions
    for i in range(params.config.num_layers):
        p = probs[i][0].double().numpy()  # [Nq, T, T]
        np.testing.assert_allclose(mass[i], (1 - p.sum(-1)).mean(-1), rtol=1e-4, atol=1e-6)
    assert 0 < geo.aggregate()["learned_sink"] < 1

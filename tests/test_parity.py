"""Dense logits equal HF transformers (torch, fp32, eager attention): tiny random
Llamas and the real SmolLM2."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import vdjax  # noqa: E402
from vdjax.models import transformer as tf  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    """HF fp32 eager logits [B, T, V]."""
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def build_llama(tmp_path, heads, kv_heads, rope, tied, seed=0):
    """Save a tiny random LlamaForCausalLM as an HF checkpoint folder; return (folder, torch model)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=256, tie_word_embeddings=tied,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the default init so attention is far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, model


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["rope", "llama3rope"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_llama_matches_hf(tmp_path, heads, kv_heads, rope, tied):
    folder, model = build_llama(tmp_path, heads, kv_heads, rope, tied)
    params = vdjax.load(folder)
    assert params.config.tie_embeddings == tied and params.config.num_kv_heads == kv_heads
    ids = np.random.RandomState(1).randint(0, 101, size=(2, 150))
    ref = hf_logits(model, ids)
    got = np.asarray(tf.forward(params, jnp.asarray(ids)))
    assert rel_err(got, ref) < 1e-4
    chex.assert_trees_all_close(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # the block pipeline (dense, B=32) gives the same last-token logits
    _, last = vdjax.prefill(params, ids, policy="dense", block_size=32)
    assert rel_err(last, ref[:, -1]) < 1e-4


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return vdjax.load(smollm2_dir), model, vdjax.load_tokenizer(smollm2_dir)


def test_smollm2_matches_hf_over_600_tokens(smollm2):
    params, model, tok = smollm2
    from pydoc_data.topics import topics  # real prose shipped with CPython

    torch.set_num_threads(2)
    text = "\n".join(topics[k] for k in sorted(topics)[:8])
    ids = np.asarray(tok(text)["input_ids"][:600])[None]
    assert ids.shape[1] >= 512
    ref = hf_logits(model, ids)
    got = np.asarray(tf.forward(params, jnp.asarray(ids)))
    err = rel_err(got, ref)
    assert err < 1e-4, err
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.99
    # block prefill with N >= T (no eviction) equals dense, for an eviction policy
    _, last = vdjax.prefill(params, ids, policy="valuediff", budget=ids.shape[1], block_size=128)
    assert rel_err(last, ref[:, -1]) < 1e-4


@pytest.fixture(scope="module")
def gemma3(gemma3_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return vdjax.load(gemma3_dir), model, vdjax.load_tokenizer(gemma3_dir)


def test_gemma3_270m_matches_hf_across_the_sliding_window(gemma3):
    """Real Gemma3-270M (5 sliding : 1 global, W=512, qk-norm, local/global RoPE) over 1100 tokens, so the
    sliding layers' window matters; logits compared at every 8th position and the last 64 (vocab 262k)."""
    params, model, tok = gemma3
    from pydoc_data.topics import topics

    torch.set_num_threads(2)
    text = "\n".join(topics[k] for k in sorted(topics)[:12])
    ids = np.asarray(tok(text)["input_ids"][:1100])[None]
    t = ids.shape[1]
    assert t == 1100 and ids[0, 0] == params.config.bos_token_id and params.config.sliding_window == 512
    at = np.unique(np.r_[0:t:8, t - 64:t])
    with torch.no_grad():
        ref = model(torch.tensor(ids), logits_to_keep=torch.tensor(at)).logits.float().numpy()
    got = np.asarray(tf.forward(params, jnp.asarray(ids), logits_at=jnp.asarray(at)))
    err = rel_err(got, ref)
    assert err < 1e-4, err
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.99
    for policy, budget in (("dense", None), ("valuediff", t)):  # block prefill with N >= T equals dense
        _, last = vdjax.prefill(params, ids, policy=policy, budget=budget, block_size=128)
        assert rel_err(last, ref[:, -1]) < 1e-4, policy

"""The engine's explicit pieces: the bound policy, the cache rule, Generation's budget and slots, the prompt
length warning, and the state the engine keeps (scan forms, background compiles) as objects one can see."""

from __future__ import annotations

import gc
import warnings

import jax
import numpy as np
import pytest

import vdjax
from vdjax.engine import compiler, evict, forms, inputs
from vdjax.engine.policies import BoundPolicy
from vdjax.models.config import ModelConfig

from helpers import random_ids, random_params, tiny_config


@pytest.fixture(scope="module")
def model():
    return random_params(tiny_config(num_layers=2, vocab_size=300, max_position_embeddings=64), seed=2)


def test_bind_checks_the_budget_before_the_keywords_and_the_mix(model):
    """The budget is validated first: a bad budget names the budget, not hybrid's missing mix."""
    with pytest.raises(ValueError, match="budget must be an integer >= 1, got 0"):
        vdjax.bind("hybrid", model, 0)
    with pytest.raises(ValueError, match="needs budget=N"):
        vdjax.bind("hybrid", model, None)
    with pytest.raises(ValueError, match="found no fitted/geometry mix"):
        vdjax.bind("hybrid", model, 8)  # params built in memory: no checkpoint folder, no saved mix
    with pytest.raises(TypeError, match="unknown keyword"):
        vdjax.bind("valuediff", model, 8, n_sink=3)


def test_bound_policy_is_one_hashable_static_object(model):
    """Binding resolves every keyword once; equal bindings are equal and hash alike (one jit cache entry)."""
    a, b = vdjax.bind("snapkv", model, 16), vdjax.bind("snapkv", model, 16)
    assert isinstance(a, BoundPolicy) and a == b and hash(a) == hash(b)
    assert dict(a.hyper) == {"kernel": 7, "pooling": "max", "window": 32} and a.budget == 16
    assert vdjax.bind("snapkv", model, 17) != a
    hybrid = vdjax.bind("hybrid", model, 16, mix=0.25)
    assert dict(hybrid.hyper)["mix"] == ((0.25,) * model.config.num_kv_heads,) * model.config.num_layers
    hash(hybrid)
    dense = vdjax.bind("dense", model, 5)
    assert dense.budget is None and dense.is_dense  # dense keeps everything: no budget


def test_cache_rule_decides_dense_and_evicting_in_one_place(model):
    """`evict.cache_rule` is where dense and evicting part: slots, per-layer slots,
    prefill path, question room."""
    cfg = tiny_config(num_layers=3, layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                      sliding_window=10)
    dense = evict.cache_rule(vdjax.bind("dense", model))
    evicting = evict.cache_rule(vdjax.bind("keydiff", model, 32))
    assert (dense.evicts, dense.causal_prefill, dense.grows_for_question) == (False, True, False)
    assert (evicting.evicts, evicting.causal_prefill, evicting.grows_for_question) == (True, False, True)
    assert dense.slots(None, 96) == 96 and evicting.slots(32, 96) == 32
    assert dense.layer_slots(cfg, 96) == (96, 96, 96) and evicting.layer_slots(cfg, 32) == (9, 32, 9)


def test_generation_reports_the_budget_asked_for_and_each_layers_slots(model):
    ids = random_ids(40, model.config.vocab_size, 3)
    gen = vdjax.run(model, ids, "valuediff", 12, block_size=8, max_new_tokens=3, eos_token_id=[])
    assert gen.budget == 12 and gen.slots == (12, 12) and gen.hyper == ()
    asked = vdjax.run(model, ids, "valuediff", 12, block_size=8, max_new_tokens=3, eos_token_id=[],
                      question=[5, 6, 7])
    assert asked.budget == 12 and asked.slots == (12 + inputs.QUESTION_PAD,) * 2  # the question's room
    dense = vdjax.run(model, ids, "dense", max_new_tokens=3, eos_token_id=[])
    assert dense.budget is None and dense.slots == (48 + 3,) * 2  # bucketed prompt + bucketed new tokens


def test_a_prompt_beyond_max_position_embeddings_warns_with_both_lengths(model):
    with pytest.warns(UserWarning, match="the prompt has 70 tokens, more than the model's "
                                         "max_position_embeddings=64"):
        vdjax.generate(model, random_ids(70, model.config.vocab_size, 4), "keydiff", 16, 16, max_new_tokens=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vdjax.generate(model, random_ids(64, model.config.vocab_size, 4), "keydiff", 16, 16, max_new_tokens=2)


def test_scan_forms_live_with_their_params(model):
    """The layer scan's stacked weights are made once per params object and dropped with it."""
    params = random_params(tiny_config(num_layers=2, vocab_size=300), seed=7)
    form = forms.scan_form(params)
    assert forms.scan_form(params) is form and id(params) in forms.SCAN_FORMS._forms
    key = id(params)
    del params, form
    gc.collect()
    assert key not in forms.SCAN_FORMS._forms


def test_background_compiles_belong_to_an_object_one_can_join():
    behind = compiler.BackgroundCompiler()
    f = jax.jit(lambda a: a + 1)
    threads = [behind.submit(f, (np.ones(n, np.float32),), {}) for n in (3, 4)]
    behind.join()
    assert not any(t.is_alive() for t in threads) and len(behind.compiled) == 2
    assert isinstance(compiler.BACKGROUND, compiler.BackgroundCompiler)  # the one `run` uses


def test_kept_positions_per_layer_row_and_head(model):
    """`vdjax.kept_positions(cache)`: sorted absolute positions per layer, row and KV head, whatever the slot
    order; None for a layer without a KV cache."""
    rows = [random_ids(40, model.config.vocab_size, 5), random_ids(25, model.config.vocab_size, 6)]
    cache, _ = vdjax.prefill(model, rows, "keynorm", 12, block_size=8)
    kept = vdjax.kept_positions(cache)
    assert len(kept) == model.config.num_layers
    for layer, lc in zip(kept, cache.layers, strict=True):
        pos = np.asarray(lc.pos)
        for r, length in enumerate((40, 25)):
            for h in range(model.config.num_kv_heads):
                want = sorted(int(p) for p in pos[r, h] if p >= 0)
                assert layer[r][h].tolist() == want and len(want) == 12 and max(want) < length

    from test_pipeline import QWEN3_5_TINY  # Gated DeltaNet layers: no KV cache

    hybrid_cfg = ModelConfig(**QWEN3_5_TINY)
    empty = vdjax.KVCache.for_model(hybrid_cfg, 2, (4,) * hybrid_cfg.num_layers, np.float32)
    kept = vdjax.kept_positions(empty)
    assert [k is None for k in kept] == [not hybrid_cfg.attends(i) for i in range(hybrid_cfg.num_layers)]
    assert all(h.size == 0 for k in kept if k is not None for row in k for h in row)

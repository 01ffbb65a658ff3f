"""`vdjax generate / analyze / eval` on the two sink-suppressed families (tiny random Qwen3.5 and GPT-OSS
checkpoints with a tiny tokenizer); GPT-OSS with a harmony-style template that reads `reasoning_effort`."""

import json

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from vdjax.app.cli import main  # noqa: E402
from vdjax.text.prompt import render_chat  # noqa: E402

from helpers import tiny_tokenizer  # noqa: E402

# the harmony template's shape: a system message carrying "Reasoning: <effort>" (default medium)
HARMONY = (
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def _hf_config(family, vocab, tok):
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
               vocab_size=vocab, max_position_embeddings=4096)
    if family == "qwen3_5":
        return transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, tie_word_embeddings=True, **ids)
    return transformers.GptOssForCausalLM, transformers.GptOssConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        **ids)


@pytest.fixture(scope="module", params=["qwen3_5", "gpt_oss"])
def checkpoint(request, tmp_path_factory):
    tok = tiny_tokenizer()
    if request.param == "gpt_oss":
        tok.chat_template = HARMONY
    cls, cfg = _hf_config(request.param, len(tok), tok)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    cls(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return request.param, path


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VDJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VDJAX_COMPILE_CACHE", "0")


def test_generate(checkpoint, capsys):
    _, path = checkpoint
    rc = main(["generate", "--model", str(path), "--policy", "valuediff", "--budget", "16",
               "--block-size", "8", "--max-new-tokens", "4",
               "--prompt", "The grass is green. The sky is blue. " * 4])
    out = capsys.readouterr().out
    assert rc == 0 and "budget N            16" in out and "valid slots/head    min " in out


def test_analyze(checkpoint, tmp_path, capsys):
    family, path = checkpoint
    rc = main(["analyze", "--model", str(path), "--out", str(tmp_path), "--length", "96",
               "--per-category", "1", "--topk", "8", "--n-queries", "6", "--jaccard-prompts", "1"])
    assert rc == 0, capsys.readouterr().err
    summary = (tmp_path / path.name / "summary.md").read_text()
    geo = json.loads((tmp_path / path.name / "geometry.json").read_text())
    assert "learned-sink mass" in summary
    mass = geo["aggregate"]["learned_sink"]
    assert (mass is None) == (family == "qwen3_5")  # only GPT-OSS has learned sinks
    assert family == "qwen3_5" or 0 < mass < 1
    if family == "qwen3_5":
        assert "Gated DeltaNet" in summary


def test_eval_ruler_with_reasoning_effort(checkpoint, tmp_path, capsys):
    family, path = checkpoint
    args = ["eval", "ruler", "--model", str(path), "--tasks", "niah_single_1", "--length", "512",
            "--samples", "1", "--policies", "dense,valuediff", "--budgets", "64", "--block-size", "32",
            "--batch-size", "1", "--out", str(tmp_path)]
    if family == "gpt_oss":
        args += ["--reasoning-effort", "high"]
    assert main(args) == 0, capsys.readouterr().err
    folder = tmp_path / "ruler" / path.name / "paper" / "L512"
    lines = [json.loads(x) for x in (folder / "predictions.jsonl").read_text().splitlines()]
    assert {(r["policy"], r["budget"]) for r in lines} == {("dense", None), ("valuediff", 64)}
    if family == "gpt_oss":
        run = json.loads((folder / "run.json").read_text())
        assert json.dumps(run).count('"reasoning_effort": "high"') >= 1


def test_reasoning_effort_reaches_the_harmony_template():
    tok = tiny_tokenizer()
    tok.chat_template = HARMONY
    high, cut = render_chat(tok, "ctx ", "q?", template_kwargs={"reasoning_effort": "high"})
    default, _ = render_chat(tok, "ctx ", "q?")
    assert "Reasoning: high" in high and "Reasoning: medium" in default and high[:cut].endswith("ctx ")

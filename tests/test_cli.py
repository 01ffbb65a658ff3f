"""The `vdjax` CLI and the needle prompt builder, on a tiny random Llama with a tiny trained tokenizer."""

import re

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from vdjax.app.cli import main  # noqa: E402
from vdjax.app.needle import NEEDLE, is_correct, needle_prompt  # noqa: E402

from helpers import tiny_tokenizer as _tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tok):
    """A 2-layer random LlamaForCausalLM saved with its tokenizer: an HF checkpoint folder for --model."""
    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VDJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VDJAX_COMPILE_CACHE", "0")  # no process-wide JAX setting leaks into other tests


# ---- needle ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [200, 333, 600])
def test_needle_hits_length(tok, length):
    p = needle_prompt(tok, length, seed=0)
    assert abs(p.n_tokens - length) <= 6  # one haystack sentence is a few tokens
    assert p.n_tokens == len(p.ids) == len(tok(p.text, add_special_tokens=False)["input_ids"])
    assert p.text.count(NEEDLE.format(key=p.key, value=p.answer)) == 1
    assert p.text.count(p.answer) == 1
    assert p.text.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in p.text
    assert p.text.endswith(f"The special magic number for {p.key} mentioned in the provided text is")


def test_needle_golden_and_seeded(tok):
    p = needle_prompt(tok, 300, seed=0)
    assert (p.key, p.answer) == ("rapid-willow", "1679215")  # golden for seed 0
    assert re.fullmatch(r"\d{7}", p.answer)
    assert needle_prompt(tok, 300, seed=0) == p
    assert (needle_prompt(tok, 300, seed=1).key, needle_prompt(tok, 300, seed=1).answer) != (p.key, p.answer)


def test_needle_depth_and_plain(tok):
    needle = NEEDLE.split("{")[0]
    early, late = needle_prompt(tok, 400, depth=0.0), needle_prompt(tok, 400, depth=1.0)
    assert early.text.index(needle) < late.text.index(needle)
    plain = needle_prompt(_tokenizer(chat=False), 400)
    assert "<|im_start|>" not in plain.text
    assert plain.text.endswith(
        f"\nAnswer: The special magic number for {plain.key} mentioned in the provided text is"
    )
    with pytest.raises(ValueError, match="depth"):
        needle_prompt(tok, 400, depth=1.5)


def test_is_correct():
    assert is_correct(" 1679215.", "1679215")
    assert is_correct("The number is 1679215 indeed", "1679215")
    assert not is_correct(" 167921", "1679215")
    assert not is_correct("", "1679215")


# ---- CLI ---------------------------------------------------------------------------------------------------
def test_generate(tiny_model, capsys):
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_model),
            "--policy",
            "valuediff",
            "--budget",
            "16",
            "--block-size",
            "8",
            "--max-new-tokens",
            "5",
            "--prompt",
            "The grass is green. The sky is blue.",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for label in (
        "prompt tokens",
        "budget N            16",
        "valid slots/head    min 16, max 16",
        "cache bytes",
        "time to first token",
        "decode",
    ):
        assert label in out, label


def test_generate_dense_plain_file(tiny_model, tmp_path, capsys):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Here we go.")
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_model),
            "--policy",
            "dense",
            "--no-chat",
            "--prompt-file",
            str(prompt),
            "--max-new-tokens",
            "3",
            "--temperature",
            "0.8",
            "--top-k",
            "5",
            "--seed",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "dense" in out and "chat template" not in out


def test_demo(tiny_model, capsys):
    rc = main(["demo", "--model", str(tiny_model), "--length", "200", "--budget", "64", "--policies",
               "dense,valuediff,keydiff,streaming", "--max-new-tokens", "4"])
    captured = capsys.readouterr()
    out = captured.out
    assert rc == 0
    assert "budget N=64" in out and "geometry  σV/σK " in out and "sink rate" in out and "total " in out
    for name in ("dense", "valuediff", "keydiff", "streaming"):
        assert re.search(rf"^  {re.escape(name)} +[0-3]/3 ", out, re.M), (name, out)
    assert re.search(r"verdict .*valuediff\s+\d,\s+keydiff\s+\d\s+->", out, re.S)
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
    assert "[" in captured.err and "found" in captured.err  # progress lines, also without a TTY


@pytest.mark.parametrize("protocol", ["paper", "question_agnostic"])
def test_generate_context_file_and_question(tiny_model, tmp_path, capsys, protocol):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("The grass is green. The sky is blue. " * 20)
    rc = main(["generate", "--model", str(tiny_model), "--context-file", str(ctx), "--question",
               " What color is the sky?", "--protocol", protocol, "--policy", "valuediff", "--budget", "32",
               "--block-size", "16", "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and f"{protocol} protocol" in out and "budget N            " in out
    import vdjax

    tok, params = vdjax.load_tokenizer(tiny_model), vdjax.load(tiny_model)
    want = vdjax.answer(params, tok, ctx.read_text(), " What color is the sky?", "valuediff", 32,
                        protocol=protocol, block_size=16, max_new_tokens=3)
    assert out.splitlines()[0] == want.text


def test_question_needs_context_file(tiny_model, capsys):
    assert main(["generate", "--model", str(tiny_model), "--prompt", "hi", "--question", "q", "--policy",
                 "dense"]) == 2
    assert "--question: goes with --context-file" in capsys.readouterr().err


def test_empty_prompt(tiny_model, capsys):
    assert (
        main(["generate", "--model", str(tiny_model), "--policy", "dense", "--no-chat", "--prompt", ""]) == 2
    )
    assert "argument --prompt: ids must hold at least one token" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--policy", "nope", "--budget", "4", "--prompt", "x"], "unknown policy 'nope'"),
        (["generate", "--budget", "0", "--prompt", "x"], "argument --budget: must be an integer >= 1"),
        (["generate", "--prompt", "x"], "argument --budget: policy 'valuediff' needs --budget"),
        (
            ["generate", "--budget", "4", "--prompt-file", "/no/such/file"],
            "argument --prompt-file: no such file",
        ),
        (["generate", "--budget", "4", "--prompt", "x", "--policy-arg", "n_sink=2"], "argument --policy-arg"),
        (["generate", "--budget", "4", "--prompt", "x", "--top-p", "0"], "argument --top-p"),
        (
            ["generate", "--budget", "4"],
            "one of the arguments --prompt --prompt-file --context-file is required",
        ),
        (["demo", "--policies", "dense,nope"], "argument --policies: unknown policy 'nope'"),
        (["convert", "not-a-model"], "neither a .gguf file nor a registered model"),
        (["convert", "/no/such/model.gguf"], "argument NAME_OR_GGUF: no such file"),
        (["generate", "--model", "/no/such/dir", "--budget", "4", "--prompt", "x"], "argument --model"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err

"""Damaged checkpoint folders give a clear ValueError naming the file and what to do (re-download or
re-convert): an empty, truncated or garbage `.safetensors`, a shard the index names but that does not exist,
a corrupt index, an unreadable `config.json`. A tiny Llama checkpoint written with
NumPy (no torch, no download)."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.numpy import save_file

import vdjax
from vdjax.convert import hf
from vdjax.convert.gguf import MARKER

H, INTER, VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 16, 32, 40, 2, 4, 2, 4
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H, intermediate_size=INTER,
              vocab_size=VOCAB, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
              num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5, rope_theta=10000.0,
              max_position_embeddings=128, tie_word_embeddings=False, eos_token_id=2, torch_dtype="float32")


def _tensors() -> dict[str, np.ndarray]:
    """Random weights of every tensor of the tiny Llama, HF names and shapes."""
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,),
              "lm_head.weight": (VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
                   p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
                   p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H),
                   p + "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
                   p + "mlp.gate_proj.weight": (INTER, H), p + "mlp.up_proj.weight": (INTER, H),
                   p + "mlp.down_proj.weight": (H, INTER)}
    rng = np.random.default_rng(0)
    return {key: rng.standard_normal(shape).astype(np.float32) for key, shape in shapes.items()}


def _checkpoint(path: Path, shards: int = 1) -> Path:
    """A tiny Llama HF checkpoint folder: config.json and one model.safetensors, or
    `shards` shards and their index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    tensors = _tensors()
    if shards == 1:
        save_file(tensors, path / hf.SINGLE_FILE, metadata={"format": "pt"})
        return path
    keys, weight_map = sorted(tensors), {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[s::shards]}
        save_file(part, path / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    (path / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _error(path: Path, file: Path, cause=None) -> str:
    """The message of the ValueError loading `path` raises; it names `file` and says what to do."""
    with pytest.raises(ValueError) as info:
        hf.load_hf_checkpoint(path)
    message = str(info.value)
    assert str(file) in message, message
    assert "re-download" in message and "re-convert" in message, message
    if cause is not None:
        assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)
    return message


def test_good_checkpoints_load(tmp_path):
    single = hf.load_hf_checkpoint(_checkpoint(tmp_path / "single"))
    sharded = hf.load_hf_checkpoint(_checkpoint(tmp_path / "sharded", shards=3))
    assert single.config.num_layers == LAYERS and single.config.eos_token_ids == (2,)
    np.testing.assert_array_equal(single.weights["embed"], _tensors()["model.embed_tokens.weight"])
    for name in ("embed", "lm_head", "final_norm"):
        np.testing.assert_array_equal(single.weights[name], sharded.weights[name])
    for a, b in zip(single.weights["layers"], sharded.weights["layers"], strict=True):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])


def test_empty_safetensors(tmp_path):
    path = _checkpoint(tmp_path / "ckpt")
    file = path / hf.SINGLE_FILE
    file.write_bytes(b"")
    message = _error(path, file, SafetensorError)
    assert "damaged or incomplete" in message


@pytest.mark.parametrize("where", ["data", "header"])
def test_truncated_safetensors(tmp_path, where):
    path = _checkpoint(tmp_path / "ckpt")
    file = path / hf.SINGLE_FILE
    data = file.read_bytes()
    header = int.from_bytes(data[:8], "little")
    file.write_bytes(data[:len(data) - 100] if where == "data" else data[:8 + header // 2])
    assert "damaged or incomplete" in _error(path, file, SafetensorError)


def test_garbage_safetensors(tmp_path):
    path = _checkpoint(tmp_path / "ckpt")
    file = path / hf.SINGLE_FILE
    file.write_bytes(np.random.default_rng(1).bytes(4096))
    assert "damaged or incomplete" in _error(path, file, SafetensorError)


def test_file_damaged_after_its_header_was_read(tmp_path, monkeypatch):
    """The tensor-reading path too: the file truncated between reading the headers and the tensors."""
    path = _checkpoint(tmp_path / "ckpt")
    file = path / hf.SINGLE_FILE
    headers = hf._headers

    def then_truncate(files):
        out = headers(files)
        file.write_bytes(file.read_bytes()[:-100])
        return out

    monkeypatch.setattr(hf, "_headers", then_truncate)
    assert "damaged or incomplete" in _error(path, file, SafetensorError)


def test_missing_shard(tmp_path):
    path = _checkpoint(tmp_path / "ckpt", shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    message = _error(path, path / hf.INDEX_FILE)
    assert "model-00002-of-00003.safetensors" in message and "do not exist" in message


def test_damaged_shard_named(tmp_path):
    path = _checkpoint(tmp_path / "ckpt", shards=3)
    file = path / "model-00003-of-00003.safetensors"
    file.write_bytes(file.read_bytes()[:50])
    _error(path, file, SafetensorError)


@pytest.mark.parametrize(("text", "cause"), [
    ("", json.JSONDecodeError),
    ('{"weight_map": {"model.norm.weight": "model-0', json.JSONDecodeError),  # truncated
    ("[1, 2]", None),
    ('{"metadata": {}}', None),
])
def test_bad_index_json(tmp_path, text, cause):
    path = _checkpoint(tmp_path / "ckpt", shards=2)
    (path / hf.INDEX_FILE).write_text(text)
    assert "damaged" in _error(path, path / hf.INDEX_FILE, cause)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("content", [b"", b'{"architectures": ["LlamaForCausalLM"], "hidden_',
                                     b"\xff\xfe\x00garbage", b'"a string"'])
def test_bad_config_json(tmp_path, name, content):
    path = _checkpoint(tmp_path / "ckpt")
    (path / name).write_bytes(content)
    message = _error(path, path / name, None if content == b'"a string"' else ValueError)
    assert ("not valid JSON" in message) == (content != b'"a string"'), message


def test_unreadable_config_json(tmp_path, monkeypatch):
    """A read error (here a PermissionError, which chmod cannot cause for root) names the file too."""
    path = _checkpoint(tmp_path / "ckpt")
    read_text = Path.read_text

    def refuse(self, *args, **kwargs):
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse)
    assert "cannot be read" in _error(path, path / "config.json", PermissionError)


def test_hint_for_a_hub_snapshot(tmp_path):
    path = _checkpoint(tmp_path / "hub" / "models--some-org--tiny-llama" / "snapshots" / "0123abcd")
    file = path / hf.SINGLE_FILE
    file.write_bytes(b"")
    with pytest.raises(ValueError) as info:
        vdjax.load(path)
    message = str(info.value)
    assert str(file) in message
    assert ("re-download it: `hf download some-org/tiny-llama model.safetensors --revision 0123abcd "
            "--force-download`") in message
    assert str(tmp_path / "hub" / "models--some-org--tiny-llama") in message


def test_hint_for_a_vdjax_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("VDJAX_CACHE", str(tmp_path / "cache"))
    registered = _checkpoint(tmp_path / "cache" / "smollm2-135m")  # where `vdjax convert smollm2-135m` writes
    elsewhere = _checkpoint(tmp_path / "mine")  # `vdjax convert some.gguf --out .../mine`
    for path in (registered, elsewhere):
        (path / MARKER).write_text(json.dumps({"gguf_file": "some.gguf", "gguf_bytes": 1}))
        (path / hf.SINGLE_FILE).write_bytes(b"garbage")
    for load, path in ((lambda: vdjax.load("smollm2-135m"), registered),
                       (lambda: hf.load_hf_checkpoint(elsewhere), elsewhere)):
        with pytest.raises(ValueError, match="re-convert it") as info:
            load()
        assert str(info.value).endswith(
            f"re-convert it: delete the folder {path}, then run `vdjax convert NAME --out {path}` "
            "(NAME: the registered model name, or the path of some.gguf)")

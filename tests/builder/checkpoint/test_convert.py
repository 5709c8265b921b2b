"""Tests of `convert_checkpoint` and its readers: round trips on every source format, and every bad input."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbuild import engine_format as ef
from specbuild.builder.checkpoint import weights_io
from specbuild.builder.checkpoint.canonical import Checkpoint
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.builder.checkpoint.tokenizer_io import carry_tokenizer, read_chat_template
from specbuild.builder.checkpoint.weights_io import load_hf_weights, load_tensor_file
from specbuild.errors import SpecbuildError
from specbuild.modes import registry
from tests.shapes import TINY_SHAPES, save_tiny_model, tiny_hf_model
from tests.tiers import full

ALL_SHAPES = sorted(TINY_SHAPES)


def hf_state(name: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tiny_hf_model(name).state_dict().items()}


def copy_with(src: Path, dst: Path, edit=None) -> Path:
    """Copy HF dir `src` to `dst`, letting edit(tensors) change model.safetensors."""
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def convert_fails(model_dir: Path, out: Path, *needles: str, **kwargs) -> str:
    """convert_checkpoint must raise SpecbuildError naming every needle and leave no output directory."""
    with pytest.raises(SpecbuildError) as info:
        convert_checkpoint(model_dir, out, progress=False, **kwargs)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert "\n" not in message
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]
    return message


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", ALL_SHAPES)
def test_round_trip_tensors_equal_hf_state(name, tiny_checkpoints):
    ckpt = Checkpoint.load(tiny_checkpoints[name])
    state = hf_state(name)
    tensors = ckpt.tensors()
    if TINY_SHAPES[name][2]["tie_word_embeddings"]:
        assert "lm_head.weight" not in tensors
        state.pop("lm_head.weight", None)
    assert set(tensors) == set(state)
    for key, value in state.items():
        assert tensors[key].dtype == torch.float32
        assert torch.equal(tensors[key], value), key
    assert ckpt.dtype == "float32"
    assert ckpt.heads == {}
    assert ckpt.tokenizer_file is None


def test_round_trip_config_llama_gqa_llama3rope(tiny_checkpoints):
    m = Checkpoint.load(tiny_checkpoints["llama_gqa_llama3rope"]).model
    assert (m.architecture, m.vocab_size, m.hidden_size, m.intermediate_size) == ("llama", 97, 64, 96)
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (2, 4, 2, 16)
    assert m.rope_scaling["rope_type"] == "llama3"
    assert m.rope_scaling["factor"] == 8.0 and m.rope_scaling["original_max_position_embeddings"] == 32
    assert m.max_position_embeddings == 256 and m.rms_norm_eps == 1e-5
    assert not m.tie_word_embeddings and not m.attention_bias
    assert m.bos_token_id == 1 and m.eos_token_ids == [2]


def test_round_trip_config_llama_tied_linear(tiny_checkpoints):
    m = Checkpoint.load(tiny_checkpoints["llama_tied_linear"]).model
    assert (m.vocab_size, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (61, 48, 4, 4, 24)
    assert m.tie_word_embeddings
    assert m.rope_scaling == {"factor": 2.0, "rope_type": "linear"}
    assert m.rope_theta == 500.0


def test_round_trip_config_qwen2_bias(tiny_checkpoints):
    m = Checkpoint.load(tiny_checkpoints["qwen2_bias"]).model
    assert m.architecture == "qwen2" and m.attention_bias
    assert (m.vocab_size, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (89, 32, 2, 1, 16)
    assert m.rope_scaling is None and m.rope_theta == 1e6
    assert "model.layers.0.self_attn.k_proj.bias" in Checkpoint.load(tiny_checkpoints["qwen2_bias"]).tensors()


def test_sharded_safetensors_with_index(tmp_path):
    hf = save_tiny_model("llama_gqa_llama3rope", tmp_path / "hf", max_shard_size="20KB")
    shards = sorted(hf.glob("model-*.safetensors"))
    assert len(shards) > 2 and (hf / "model.safetensors.index.json").is_file()
    out = convert_checkpoint(hf, tmp_path / "out", progress=False)
    tensors = Checkpoint.load(out).tensors()
    for key, value in hf_state("llama_gqa_llama3rope").items():
        assert torch.equal(tensors[key], value), key


def test_sharded_safetensors_missing_shard(tmp_path):
    hf = save_tiny_model("llama_gqa_llama3rope", tmp_path / "hf", max_shard_size="20KB")
    victim = sorted(hf.glob("model-*.safetensors"))[1]
    victim.unlink()
    convert_fails(hf, tmp_path / "out", victim.name, "missing")


def test_sharded_index_names_tensor_absent_from_shard(tmp_path):
    hf = save_tiny_model("llama_gqa_llama3rope", tmp_path / "hf", max_shard_size="20KB")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.ghost.weight"] = shard
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    convert_fails(hf, tmp_path / "out", "model.ghost.weight", shard)


def test_pytorch_bin_checkpoint(tmp_path):
    src = save_tiny_model("qwen2_bias", tmp_path / "src")
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(src / "config.json", hf / "config.json")
    state = hf_state("qwen2_bias")
    torch.save(state, hf / "pytorch_model.bin")
    out = convert_checkpoint(hf, tmp_path / "out", progress=False)
    tensors = Checkpoint.load(out).tensors()
    assert set(tensors) == set(state)
    assert all(torch.equal(tensors[k], v) for k, v in state.items())


def test_sharded_pytorch_bin_with_index(tmp_path):
    src = save_tiny_model("llama_tied_linear", tmp_path / "src")
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(src / "config.json", hf / "config.json")
    state = hf_state("llama_tied_linear")
    keys = sorted(state)
    parts = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    weight_map = {}
    for file, part in parts.items():
        torch.save({k: state[k] for k in part}, hf / file)
        weight_map.update(dict.fromkeys(part, file))
    (hf / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = convert_checkpoint(hf, tmp_path / "out", progress=False)
    tensors = Checkpoint.load(out).tensors()
    state.pop("lm_head.weight", None)
    assert set(tensors) == set(state)
    assert all(torch.equal(tensors[k], v) for k, v in state.items())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_conversion(dtype, tiny_hf_models, tmp_path):
    out = convert_checkpoint(tiny_hf_models["llama_gqa_llama3rope"], tmp_path / "out", dtype=dtype, progress=False)
    ckpt = Checkpoint.load(out)
    assert ckpt.dtype == dtype
    tensors = ckpt.tensors()
    torch_dtype = getattr(torch, dtype)
    for key, value in hf_state("llama_gqa_llama3rope").items():
        assert tensors[key].dtype == torch_dtype
        assert torch.equal(tensors[key], value.to(torch_dtype)), key


def test_auto_dtype_keeps_the_weights_own_and_mixed_dtypes_become_float32(tiny_hf_models, tmp_path):
    state = hf_state("llama_gqa_llama3rope")
    hf = copy_with(tiny_hf_models["llama_gqa_llama3rope"], tmp_path / "bf16", lambda t: t.update(
        {k: v.to(torch.bfloat16) for k, v in t.items()}))  # fmt: skip
    ckpt = Checkpoint.load(convert_checkpoint(hf, tmp_path / "out-bf16", progress=False))
    assert ckpt.dtype == "bfloat16"
    assert torch.equal(ckpt.tensors()["model.norm.weight"], state["model.norm.weight"].to(torch.bfloat16))

    def mixed(t):  # bfloat16 matrices, float32 norms
        t.update({k: v.to(torch.bfloat16) for k, v in t.items() if not k.endswith("norm.weight")})

    hf = copy_with(tiny_hf_models["llama_gqa_llama3rope"], tmp_path / "mixed", mixed)
    ckpt = Checkpoint.load(convert_checkpoint(hf, tmp_path / "out-mixed", progress=False))
    assert ckpt.dtype == "float32"
    assert torch.equal(ckpt.tensors()["model.norm.weight"], state["model.norm.weight"])


def test_ignorable_tensors_dropped(tiny_hf_models, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    hf = copy_with(tiny_hf_models["llama_tied_linear"], tmp_path / "hf", edit)
    with_lm_head = load_file(str(hf / "model.safetensors"))
    with_lm_head["lm_head.weight"] = with_lm_head["model.embed_tokens.weight"].clone()
    save_file(with_lm_head, str(hf / "model.safetensors"))
    tensors = Checkpoint.load(convert_checkpoint(hf, tmp_path / "out", progress=False)).tensors()
    assert "lm_head.weight" not in tensors
    assert not any("inv_freq" in k for k in tensors)


def test_generation_config_eos_ids_added(tiny_hf_models, tmp_path):
    hf = copy_with(tiny_hf_models["qwen2_bias"], tmp_path / "hf")
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    model = Checkpoint.load(convert_checkpoint(hf, tmp_path / "out", progress=False)).model
    assert model.eos_token_ids == [2, 7]


def test_overwrite(tiny_hf_models, tmp_path):
    out = tmp_path / "out"
    (out / "junk").mkdir(parents=True)
    with pytest.raises(SpecbuildError, match="already exists"):
        convert_checkpoint(tiny_hf_models["qwen2_bias"], out, progress=False)
    with pytest.raises(SpecbuildError, match="not a specbuild output"):  # --overwrite replaces only our outputs
        convert_checkpoint(tiny_hf_models["qwen2_bias"], out, overwrite=True, progress=False)
    assert (out / "junk").is_dir()
    (out / "junk").rmdir()
    convert_checkpoint(tiny_hf_models["qwen2_bias"], out, progress=False)  # an existing empty directory is used
    (out / "stale").write_text("x")
    convert_checkpoint(tiny_hf_models["qwen2_bias"], out, overwrite=True, progress=False)  # a previous checkpoint
    assert not (out / "stale").exists() and (out / ef.CHECKPOINT_CONFIG).is_file()


def test_output_must_not_replace_model_dir(tiny_hf_models, tmp_path):
    hf = copy_with(tiny_hf_models["qwen2_bias"], tmp_path / "hf")
    with pytest.raises(SpecbuildError, match="is the input"):
        convert_checkpoint(hf, hf, overwrite=True, progress=False)
    with pytest.raises(SpecbuildError, match="contains the input"):
        convert_checkpoint(hf, tmp_path, overwrite=True, progress=False)
    with pytest.raises(SpecbuildError, match="inside the input directory"):
        convert_checkpoint(hf, hf / "ckpt", progress=False)
    assert (hf / "model.safetensors").is_file()


def test_progress_bar_path(tiny_hf_models, monkeypatch):
    monkeypatch.setattr(weights_io, "PROGRESS_MIN_TENSORS", 1)
    tensors = load_hf_weights(tiny_hf_models["qwen2_bias"], progress=True)
    assert set(tensors) == set(hf_state("qwen2_bias"))


# ---------------------------------------------------------------- heads


FAKE_SEEN: dict = {}


def fake_converter(head_dir, model_config, base_tensors, base_dir=None):
    embed = base_tensors["model.embed_tokens.weight"]
    FAKE_SEEN.update(head_dir=head_dir, vocab=model_config.vocab_size, embed=embed, base_dir=base_dir)
    return {"num_heads": 2}, {"w": torch.ones(3, 4), "idx": torch.arange(3)}


def test_heads_use_registered_converter(tiny_hf_models, tmp_path, monkeypatch):
    from specbuild.modes.spec import ENGINE_DRAFTED, ModeSpec

    fake = ModeSpec(
        name="fakemode",
        family=ENGINE_DRAFTED,
        summary="a mode registered by this test",
        graph_plugin="specbuild.plugins.none.graph:NonePlugin",
        drafter="specbuild.runtime.drafter:GraphDrafter",
        heads="fake heads",
        converter="tests.builder.checkpoint.test_convert:fake_converter",
    )
    monkeypatch.setitem(registry.modes(), "fakemode", fake)
    seen = FAKE_SEEN
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    hf = tiny_hf_models["qwen2_bias"]
    out = convert_checkpoint(hf, tmp_path / "out", dtype="float16", heads={"fakemode": head_dir}, progress=False)
    ckpt = Checkpoint.load(out)
    assert seen["head_dir"] == head_dir and seen["vocab"] == 89 and seen["embed"].dtype == torch.float16
    assert seen["base_dir"] == hf  # the base model's directory (a draft model's tokenizer is checked against it)
    assert ckpt.heads == {"fakemode": {"num_heads": 2}}
    head = ckpt.head_tensors("fakemode")
    assert head["w"].dtype == torch.float16 and head["idx"].dtype == torch.int64


def test_unknown_head_mode(tiny_hf_models, tmp_path):
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    convert_fails(tiny_hf_models["qwen2_bias"], tmp_path / "out", "nosuchmode", heads={"nosuchmode": head_dir})


def test_missing_head_dir(tiny_hf_models, tmp_path):
    convert_fails(tiny_hf_models["qwen2_bias"], tmp_path / "out", "nowhere", heads={"medusa": tmp_path / "nowhere"})


# ---------------------------------------------------------------- bad inputs


def test_missing_tensor(tiny_hf_models, tmp_path):
    hf = copy_with(
        tiny_hf_models["llama_gqa_llama3rope"], tmp_path / "hf", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")
    )
    convert_fails(hf, tmp_path / "out", "model.layers.1.mlp.up_proj.weight", "(96, 64)", "missing")


def test_missing_untied_lm_head(tiny_hf_models, tmp_path):
    hf = copy_with(tiny_hf_models["qwen2_bias"], tmp_path / "hf", lambda t: t.pop("lm_head.weight"))
    convert_fails(hf, tmp_path / "out", "lm_head.weight", "(89, 32)", "tie_word_embeddings")


def test_extra_tensor(tiny_hf_models, tmp_path):
    def edit(t):
        t["model.layers.2.mlp.up_proj.weight"] = torch.zeros(96, 64)

    hf = copy_with(tiny_hf_models["llama_gqa_llama3rope"], tmp_path / "hf", edit)
    convert_fails(hf, tmp_path / "out", "model.layers.2.mlp.up_proj.weight", "(96, 64)", "unexpected")


def test_misshaped_tensor(tiny_hf_models, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)

    hf = copy_with(tiny_hf_models["llama_gqa_llama3rope"], tmp_path / "hf", edit)
    convert_fails(hf, tmp_path / "out", "model.layers.0.self_attn.k_proj.weight", "(64, 64)", "(32, 64)")


def test_vocab_disagreement(tiny_hf_models, tmp_path):
    def edit(t):
        t["model.embed_tokens.weight"] = torch.zeros(100, 32)

    hf = copy_with(tiny_hf_models["qwen2_bias"], tmp_path / "hf", edit)
    convert_fails(hf, tmp_path / "out", "model.embed_tokens.weight", "(100, 32)", "(89, 32)")


def test_non_float_tensor(tiny_hf_models, tmp_path):
    def edit(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)

    hf = copy_with(tiny_hf_models["qwen2_bias"], tmp_path / "hf", edit)
    convert_fails(hf, tmp_path / "out", "model.norm.weight", "int32")


def test_truncated_safetensors(tiny_hf_models, tmp_path):
    hf = copy_with(tiny_hf_models["qwen2_bias"], tmp_path / "hf")
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    convert_fails(hf, tmp_path / "out", str(hf / "model.safetensors"))


def test_garbage_safetensors_header(tiny_hf_models, tmp_path):
    hf = copy_with(tiny_hf_models["qwen2_bias"], tmp_path / "hf")
    (hf / "model.safetensors").write_bytes(b"\xff" * 64)
    convert_fails(hf, tmp_path / "out", "model.safetensors")


def test_unknown_architecture(tiny_hf_models, tmp_path):
    hf = copy_with(tiny_hf_models["qwen2_bias"], tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (hf / "config.json").write_text(json.dumps(cfg))
    convert_fails(hf, tmp_path / "out", "GPT2LMHeadModel", "config.json")


def test_config_json_missing(tiny_hf_models, tmp_path):
    hf = copy_with(tiny_hf_models["qwen2_bias"], tmp_path / "hf")
    (hf / "config.json").unlink()
    convert_fails(hf, tmp_path / "out", "config.json", "missing")


def test_no_weights_at_all(tiny_hf_models, tmp_path):
    hf = copy_with(tiny_hf_models["qwen2_bias"], tmp_path / "hf")
    (hf / "model.safetensors").unlink()
    convert_fails(hf, tmp_path / "out", "no weights", "model.safetensors", "pytorch_model.bin")


def test_bad_dtype(tiny_hf_models, tmp_path):
    convert_fails(tiny_hf_models["qwen2_bias"], tmp_path / "out", "int8", "float16", dtype="int8")


class _Exploit:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("container", ["torch_zip", "raw_pickle"])
def test_bin_with_code_is_not_executed(container, tiny_hf_models, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(tiny_hf_models["qwen2_bias"] / "config.json", hf / "config.json")
    marker = tmp_path / "PWNED"
    payload = {"model.norm.weight": torch.ones(32), "evil": _Exploit(marker)}
    if container == "torch_zip":
        torch.save(payload, hf / "pytorch_model.bin")
    else:
        (hf / "pytorch_model.bin").write_bytes(pickle.dumps(payload))
    message = convert_fails(hf, tmp_path / "out", str(hf / "pytorch_model.bin"), "not executed", "code")
    assert "system" in message
    assert not marker.exists()


def test_bin_with_non_tensor_entry(tmp_path):
    torch.save({"w": torch.ones(2), "step": 7}, tmp_path / "head.pt")
    with pytest.raises(SpecbuildError, match=r"head\.pt.*'step' is a int"):
        load_tensor_file(tmp_path / "head.pt")


def test_truncated_bin(tiny_hf_models, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(tiny_hf_models["qwen2_bias"] / "config.json", hf / "config.json")
    torch.save(hf_state("qwen2_bias"), hf / "pytorch_model.bin")
    data = (hf / "pytorch_model.bin").read_bytes()
    (hf / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    convert_fails(hf, tmp_path / "out", str(hf / "pytorch_model.bin"))


# ---------------------------------------------------------------- single tensor files


def test_load_tensor_file_formats(tmp_path):
    tensors = {"a.weight": torch.randn(3, 2), "b": torch.arange(4)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    torch.save(tensors, tmp_path / "x.pt")
    torch.save({"state_dict": tensors}, tmp_path / "wrapped.bin")
    for file in ("x.safetensors", "x.pt", "wrapped.bin"):
        loaded = load_tensor_file(tmp_path / file)
        assert set(loaded) == set(tensors)
        assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    (tmp_path / "x.npz").write_bytes(b"")
    with pytest.raises(SpecbuildError, match="unsupported weight file type"):
        load_tensor_file(tmp_path / "x.npz")
    with pytest.raises(SpecbuildError, match="missing"):
        load_tensor_file(tmp_path / "nope.safetensors")


# ---------------------------------------------------------------- tokenizers and chat templates


def _sentencepiece_model(tmp_path: Path) -> Path:
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    lines = ["the quick brown fox jumps over the lazy dog", "hello world, speculative decoding drafts tokens"]
    corpus.write_text("\n".join(lines * 40))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60, model_type="bpe", minloglevel=2
    )
    return tmp_path / "sp.model"


@pytest.mark.parametrize("with_tokenizer_config", [False, True])
def test_sentencepiece_tokenizer_converted(with_tokenizer_config, tiny_hf_models, tmp_path):
    import sentencepiece as spm
    from tokenizers import Tokenizer

    sp_file = _sentencepiece_model(tmp_path)
    hf = copy_with(tiny_hf_models["llama_tied_linear"], tmp_path / "hf")
    shutil.copy(sp_file, hf / "tokenizer.model")
    if with_tokenizer_config:
        config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        (hf / "tokenizer_config.json").write_text(json.dumps(config))
    out = convert_checkpoint(hf, tmp_path / "out", progress=False)
    assert (out / ef.TOKENIZER_CONFIG_FILE).is_file()
    tokenizer = Tokenizer.from_file(str(out / ef.TOKENIZER_FILE))
    text = "hello world the lazy fox"
    expected = spm.SentencePieceProcessor(model_file=str(sp_file)).encode(text)
    assert tokenizer.encode(text, add_special_tokens=False).ids == expected


def test_carry_tokenizer_none(tiny_hf_models, tmp_path):
    assert carry_tokenizer(tiny_hf_models["qwen2_bias"], tmp_path) is False
    assert list(tmp_path.iterdir()) == []


def test_read_chat_template_sources(tmp_path):
    assert read_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert read_chat_template(tmp_path) == "{{ messages }}"
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert read_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert read_chat_template(tmp_path) == "J"


# ---------------------------------------------------------------- SmolLM2-135M


@full("the real SmolLM2-135M model")
def test_smollm2_conversion(smollm2_hf, smollm2_checkpoint):
    ckpt = Checkpoint.load(smollm2_checkpoint)
    m = ckpt.model
    assert (m.architecture, m.num_layers, m.vocab_size, m.hidden_size) == ("llama", 30, 49152, 576)
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (9, 3, 64)
    assert m.tie_word_embeddings and m.rope_theta == 100000.0 and m.rope_scaling is None
    assert m.eos_token_ids and m.bos_token_id == 1
    assert ckpt.tokenizer_file is not None
    assert ckpt.tokenizer_file.read_bytes() == (smollm2_hf / "tokenizer.json").read_bytes()
    assert "<|im_start|>" in (ckpt.chat_template or "")
    tensors = ckpt.tensors()
    assert "lm_head.weight" not in tensors and len(tensors) == 2 + 30 * 9
    source = load_file(str(smollm2_hf / "model.safetensors"))
    for key in ("model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(tensors[key], source[key]), key

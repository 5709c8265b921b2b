"""Random-weight Hugging Face checkpoints at the shapes users run, without a model hub.

`python -m specbuild.bench.checkpoints --shape llama-3.2-1b --out-dir ckpt-1b [--heads eagle3-head,...]` writes
what `specbuild convert` reads: config.json, the weights in bfloat16 shards with `model.safetensors.index.json` (as the
Hub lays them out), a tokenizer whose vocabulary matches the model's (the embedded SmolLM2 tokenizer, its vocabulary
padded with reserved tokens), and optionally random heads for it: an EAGLE-3 head (SafeAILab's layout, a reduced draft
vocabulary), Medusa heads (Medusa-2's layout) and a draft model (the same family, two layers). Build cost, memory and
speed are real at these shapes; acceptance is not (the heads are random).

Weights have a realistic scale (normal, std 0.02 as HF initialises them; norms at 1), so logits are not flat. Each
tensor is drawn from its own seeded generator, so a layer can be written (and checked) without the others, and the
writer holds one shard at a time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

STD = 0.02
SHARD_BYTES = 2 * 1024**3
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip
# Phi-4-mini's LongRoPE factors (48 = rotary dims / 2) are long lists in its config; these have their range (short
# near 1, long growing to ~40): engines use the short ones up to original_max_position_embeddings
_PHI_SHORT = [1.0 + 0.05 * i for i in range(48)]
_PHI_LONG = [1.0 + 0.8 * i for i in range(48)]
# Each from the published config.json of the model named (architecture, widths, RoPE, vocabulary, tying).
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "qwen2.5-1.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        use_sliding_window=False, sliding_window=32768, max_window_layers=21, bos_token_id=151643,
        eos_token_id=151645,
    ),
    "mistral-7b": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=36,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-1.7b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=28,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "phi-4-mini": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
        max_position_embeddings=131072, original_max_position_embeddings=4096, partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": _PHI_SHORT, "long_factor": _PHI_LONG}, rms_norm_eps=1e-5,
        rope_theta=10000.0, sliding_window=262144, tie_word_embeddings=True, bos_token_id=199999,
        eos_token_id=199999, pad_token_id=199999,
    ),
    "gemma-3-1b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        max_position_embeddings=32768, rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=512,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106],
        pad_token_id=0,
    ),
    # small shapes of the same families, for tests: real layouts, seconds to build
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=49152,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 256},
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    "tiny-qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=96, intermediate_size=192,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, vocab_size=49408,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        use_sliding_window=False, bos_token_id=1, eos_token_id=2,
    ),
    "tiny-phi3": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=128, intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, vocab_size=49408,
        max_position_embeddings=4096, original_max_position_embeddings=2048, partial_rotary_factor=0.5,
        rope_scaling={"type": "longrope", "short_factor": _PHI_SHORT[:16], "long_factor": _PHI_LONG[:16]},
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=None, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    ),
    "tiny-gemma3": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=128, intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=49408,
        max_position_embeddings=2048, rms_norm_eps=1e-6, query_pre_attn_scalar=64, sliding_window=64,
        sliding_window_pattern=2, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=1, pad_token_id=0,
    ),
    "tiny-qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=96, intermediate_size=192,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=49408,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        use_sliding_window=False, bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip


def model_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of a Llama-family checkpoint with this config, in layer order."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    bias = cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias"))
    o_bias = bool(cfg.get("attention_bias"))  # llama / qwen3: on o_proj too
    qk_norm = cfg["model_type"] in ("qwen3", "gemma3_text")
    sandwich = cfg["model_type"] == "gemma3_text"  # post-attention, pre- and post-feed-forward norms
    fused = cfg["model_type"] == "phi3"  # qkv_proj and gate_up_proj, as Phi-3 stores them
    out = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        if fused:
            out[p + "self_attn.qkv_proj.weight"] = ((heads + 2 * kv) * d, h)
        for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)) if not fused else ():
            out[f"{p}self_attn.{name}.weight"] = (rows, h)
            if bias:
                out[f"{p}self_attn.{name}.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (h, heads * d)
        if o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if sandwich:
            out[p + "pre_feedforward_layernorm.weight"] = (h,)
            out[p + "post_feedforward_layernorm.weight"] = (h,)
        if fused:
            out[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
        else:
            out[p + "mlp.gate_proj.weight"] = (inter, h)
            out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (vocab, h)
    return out


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The tensor `name` of a random checkpoint: norms 1 + small noise, biases and weights normal(0, STD); drawn from
    a generator seeded by (seed, name), whatever else is written."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    noise = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):
        noise = 1.0 + 0.1 * noise
    else:
        noise = noise.mul_(STD)
    return noise.to(dtype)


def write_weights(out_dir: Path, shapes: dict, seed: int, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> list:
    """Shards of at most ~shard_bytes in Hub naming, and the index; one shard in memory at a time."""
    from safetensors.torch import save_file

    size = torch.tensor([], dtype=dtype).element_size()
    groups, current, used = [], [], 0
    for name, shape in shapes.items():
        nbytes = size * int(torch.tensor(shape).prod())
        if current and used + nbytes > shard_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    groups.append(current)
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    if len(groups) == 1:
        files = ["model.safetensors"]
    weight_map, total = {}, 0
    for file, names in zip(files, groups):
        tensors = {name: random_tensor(name, shapes[name], seed, dtype) for name in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def write_tokenizer(out_dir: Path, vocab_size: int, source: Path | None = None) -> None:
    """tokenizer.json + tokenizer_config.json: SmolLM2's tokenizer (or `source`'s) with its BPE vocabulary padded by
    `<|reserved_N|>` tokens up to vocab_size (they decode, nothing encodes to them), and its chat template."""
    if source is None:
        from specbuild.builder.checkpoint.default_model import prepare_smollm2

        source = prepare_smollm2()
    tok = json.loads((Path(source) / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    if max(used) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(used)}, more than the model's vocabulary {vocab_size}")
    for i in range(vocab_size):
        if i not in used:
            vocab[f"<|reserved_{i}|>"] = i
    (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    config = json.loads((Path(source) / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    template = Path(source) / "chat_template.jinja"  # transformers keeps the template beside the config
    if template.exists():
        (out_dir / "chat_template.jinja").write_text(template.read_text())


def write_checkpoint(shape: str, out_dir, *, seed: int = 0, dtype: str = "bfloat16", num_layers: int | None = None,
                     tokenizer: Path | None = None, shard_bytes: int = SHARD_BYTES, log=print) -> Path:  # fmt: skip
    """A random checkpoint of SHAPES[shape] (num_layers: fewer layers, same widths) in out_dir (created)."""
    cfg = dict(SHAPES[shape])
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
    cfg["torch_dtype"] = dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    shapes = model_tensors(cfg)
    params = sum(int(torch.tensor(s).prod()) for s in shapes.values())
    log(f"{shape}: {params / 1e9:.2f}B parameters, {cfg['num_hidden_layers']} layers, {dtype}")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_weights(out, shapes, seed, DTYPES[dtype], shard_bytes)
    write_tokenizer(out, cfg["vocab_size"], tokenizer)
    return out


def write_eagle3_head(out_dir, base: dict, *, draft_vocab: int = 32000, seed: int = 0) -> Path:
    """An EAGLE-3 head in SafeAILab's layout for the base config `base` (one draft layer over 3 captured hidden
    states, a reduced draft vocabulary of the draft_vocab lowest ids: d2t, t2d)."""
    from safetensors.torch import save_file

    h, vocab = base["hidden_size"], base["vocab_size"]
    heads, kv = base["num_attention_heads"], base["num_key_value_heads"]
    d, inter = base.get("head_dim") or h // heads, base["intermediate_size"]
    vd = min(draft_vocab, vocab)
    shapes = {"fc.weight": (h, 3 * h), "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
              "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h), "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, heads * d), "midlayer.post_attention_layernorm.weight": (h,),
              "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
              "midlayer.mlp.down_proj.weight": (h, inter), "norm.weight": (h,), "lm_head.weight": (vd, h)}  # fmt: skip
    state = {name: random_tensor(name, shape, seed, torch.bfloat16) for name, shape in shapes.items()}
    if vd < vocab:
        state["d2t"] = torch.zeros(vd, dtype=torch.int64)  # draft id i is target id i
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[:vd] = True
        state["t2d"] = t2d
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    save_file(state, str(out / "model.safetensors"))
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "vocab_size", "max_position_embeddings")  # fmt: skip
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "torch_dtype": "bfloat16",
           "num_hidden_layers": 1, "draft_vocab_size": vd}  # fmt: skip
    cfg.update({k: base[k] for k in keys if base.get(k) is not None})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_medusa_heads(out_dir, base: dict, *, num_heads: int = 4, seed: int = 0) -> Path:
    """Medusa-2 heads (`medusa_lm_head.safetensors`, one ResBlock each, the base lm_head shared)."""
    from safetensors.torch import save_file

    h = base["hidden_size"]
    shapes = {}
    for i in range(num_heads):
        shapes[f"{i}.0.linear.weight"], shapes[f"{i}.0.linear.bias"] = (h, h), (h,)
    state = {name: random_tensor(name, shape, seed, torch.bfloat16) for name, shape in shapes.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    save_file(state, str(out / "medusa_lm_head.safetensors"))
    cfg = {"medusa_num_heads": num_heads, "medusa_num_layers": 1, "version": "2", "base_model_name_or_path": "random"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_draft_model(out_dir, shape: str, *, num_layers: int = 2, seed: int = 1, log=print) -> Path:
    """A draft model for SHAPES[shape]: the same family and vocabulary, num_layers layers (its own weights)."""
    return write_checkpoint(shape, out_dir, seed=seed, num_layers=num_layers, log=log)


HEADS = {
    "eagle3-head": lambda out, shape, seed: write_eagle3_head(out, SHAPES[shape], seed=seed),
    "medusa-heads": lambda out, shape, seed: write_medusa_heads(out, SHAPES[shape], seed=seed),
    "draft-model": lambda out, shape, seed: write_draft_model(out, shape, seed=seed + 1, log=lambda *a: None),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specbuild.bench.checkpoints", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--out-dir", required=True, type=Path, help="The checkpoint directory to write (new).")
    parser.add_argument("--heads", default="", help=f"Comma-separated: {', '.join(HEADS)} (written beside it).")
    parser.add_argument("--num-layers", type=int, help="Fewer layers than the shape's (same widths).")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    heads = [h for h in args.heads.split(",") if h]
    unknown = sorted(set(heads) - set(HEADS))
    if unknown:
        parser.error(f"--heads: unknown {unknown} (known: {', '.join(HEADS)})")
    write_checkpoint(args.shape, args.out_dir, seed=args.seed, dtype=args.dtype, num_layers=args.num_layers)
    for head in heads:
        path = HEADS[head](args.out_dir.with_name(f"{args.out_dir.name}-{head}"), args.shape, args.seed)
        print(f"{head}: {path}")


if __name__ == "__main__":
    main()

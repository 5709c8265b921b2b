"""Tiny random Hugging Face models of every shape the tests build: the Llama family's core (TINY_SHAPES), sliding
windows and the other architectures, each a config and seeded, non-tiny random weights.

Tiny models get weights of std 0.3-0.5 (not HF's 0.02), random norm weights and biases, so logits are peaked and every
tensor matters: a loader or network bug changes the output instead of hiding in near-uniform noise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiers import fast_first

TINY_SEED = 0


TINY_STD = 0.3


TINY_VOCAB_STD = 0.5  # embeddings / lm_head: peaked logits


# name -> (transformers config class name, model class name, config kwargs)
TINY_SHAPES: dict[str, tuple[str, str, dict]] = {
    "llama_gqa_llama3rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "llama_tied_linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=24,
            max_position_embeddings=128,
            rms_norm_eps=1e-6,
            rope_theta=500.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen2_bias": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=89,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}


TINY_ENGINE = "qwen2_bias"  # the tiny `none` engine of the fast tier (its Llama shapes run in every mode's tests)


# the tiny shapes, TINY_ENGINE first: parameter values of the tests over tiny_engines
TINY_ENGINE_SHAPES = fast_first(
    [TINY_ENGINE, *(name for name in TINY_SHAPES if name != TINY_ENGINE)], "another tiny shape's `none` engine"
)


# Sliding-window shapes (kept out of TINY_SHAPES so the suites parametrized over it do not grow): windows far
# shorter than prompt + output. Mistral slides on every layer; this Qwen2 only on layers >= max_window_layers.
SLIDING_SHAPES: dict[str, tuple[str, str, dict]] = {
    "mistral_window": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen2_window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=89,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}


# The architectures beyond the Llama family's core (tests/builder/test_architectures.py): each proved against
# transformers at several seeds, every mode on them. head_dim differs from hidden / heads where the config allows it.
ARCH_SHAPES: dict[str, tuple[str, str, dict]] = {
    "qwen3_qknorm": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=83,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen3_window": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=89,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "phi3_longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            vocab_size=91,
            hidden_size=64,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
            # the long factors from here: a 64-token generation crosses it (ModelConfig.rope_switch)
            original_max_position_embeddings=40,
            partial_rotary_factor=0.5,  # 16 of the 32 dims of a head rotate (ONNX Runtime: 16 is its least)
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.2, 1.5, 1.9, 2.4, 3.0, 3.6, 4.0],
                "long_factor": [1.5, 2.3, 3.4, 5.0, 7.1, 9.8, 13.0, 16.0],
            },
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            sliding_window=None,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
    "phi3_window": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            vocab_size=77,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            original_max_position_embeddings=128,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=6,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
    "gemma3_pattern": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            query_pre_attn_scalar=20,  # scores scaled by 20 ** -0.5, not head_dim ** -0.5
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
    "gemma3_untied": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=83,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            hidden_activation="gelu",
            # logit soft-capping (no Gemma 3 release sets it), small enough to change sampling; attention's is set
            # but transformers' Gemma 3 never applies it (config_fields)
            attn_logit_softcapping=2.0,
            final_logit_softcapping=4.0,
            tie_word_embeddings=False,  # a peaked lm_head of its own
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
}


ALL_SHAPES = {**TINY_SHAPES, **SLIDING_SHAPES, **ARCH_SHAPES}


def tiny_hf_config(name: str, **overrides):
    """A fresh transformers config object for TINY_SHAPES / SLIDING_SHAPES[name] (optional overrides, e.g. vocab)."""
    import transformers

    config_cls, _, kwargs = ALL_SHAPES[name]
    return getattr(transformers, config_cls)(**{**kwargs, **overrides})


def tiny_hf_model(name: str, seed: int = TINY_SEED, **overrides):
    """A TINY_SHAPES / SLIDING_SHAPES[name] transformers model with seeded, non-tiny random weights, in eval mode."""
    import transformers

    _, model_cls, _ = ALL_SHAPES[name]
    model = getattr(transformers, model_cls)(tiny_hf_config(name, **overrides))
    gen = torch.Generator().manual_seed(seed)
    # Gemma's norms scale by 1 + weight (weights around 0) and its embeddings by sqrt(hidden) (rows scaled down)
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for pname, param in model.named_parameters():  # tied parameters are yielded once
            noise = torch.randn(param.shape, generator=gen)
            if pname.endswith("norm.weight"):
                param.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            elif gemma and pname == "model.embed_tokens.weight":
                param.copy_(TINY_VOCAB_STD * noise / model.config.hidden_size**0.5)

            elif pname.endswith(".bias"):
                param.copy_(0.2 * noise)
            elif pname in ("model.embed_tokens.weight", "lm_head.weight"):
                param.copy_(TINY_VOCAB_STD * noise)
            else:
                param.copy_(TINY_STD * noise)
    return model.eval()


def save_tiny_model(name: str, out_dir: Path, **save_kwargs) -> Path:
    """Save TINY_SHAPES[name] (seeded weights) with save_pretrained into out_dir and return it."""
    tiny_hf_model(name).save_pretrained(out_dir, **save_kwargs)
    return Path(out_dir)

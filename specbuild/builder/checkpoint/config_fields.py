"""Every Hugging Face config field of Llama, Mistral, Qwen2, Qwen3 and Phi-3 and how specbuild handles it: the one
table.

Each field transformers reads for these architectures (their config classes and modeling code, the RoPE and mask
helpers they call) is listed in exactly one of three ways:

- ``honoured``: implemented exactly in the step graph (or the generation limits), proved against transformers;
- ``refused``: some values change the network in a way specbuild does not implement; `refusal(value, arch)` returns
  the reason for such a value and the checkpoint is refused with one line naming the field and its value;
- ``no effect``: the field does not change the network's outputs at inference (training-only, bookkeeping, or not
  read by the architecture's modeling code, which is what transformers itself does with it).

Fields that transformers does not read for the architecture are ignored, as transformers ignores them. The RoPE
parameters (``rope_scaling`` / ``rope_parameters`` entries) have their own table, ROPE_FIELDS.
tests/builder/checkpoint/test_config_fields.py fails when the installed transformers reads a field that is in neither
table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

HONOURED, REFUSED, NO_EFFECT = "honoured", "refused", "no effect"
SILU_NAMES = ("silu", "swish")
GELU_NAMES = ("gelu_pytorch_tanh", "gelu")  # tanh approximation, exact (erf)
ATTENTION_KINDS = ("full_attention", "sliding_attention")
# RoPE types implemented exactly ("dynamic" equals "default" within max_position_embeddings, which bounds
# --max-seq-len; transformers only rescales beyond it).
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")
PHI3_ROPE_TYPES = ("default", "longrope")  # what Phi3Config accepts ("su" and "yarn" are read as longrope)


@dataclasses.dataclass(frozen=True)
class Field:
    handling: str  # HONOURED, REFUSED or NO_EFFECT
    note: str  # how it is honoured / what is refused / why it has no effect
    refusal: Callable[[Any, str], str | None] | None = None  # (value, architecture) -> reason to refuse, or None


def _refuse_unless(allowed: Callable[[Any], bool], why: str) -> Callable[[Any, str], str | None]:
    return lambda value, arch: None if allowed(value) else why


def _partial_rotary(value, arch):
    if value is None or value == 1 or arch == "phi3":
        return None
    return "partial rotary embeddings are implemented for Phi-3 only"


def _hidden_act(value, arch):
    if arch == "gemma3":  # Gemma 3 reads hidden_activation, not this
        return None
    return None if value in SILU_NAMES else "only SiLU MLPs (hidden_act silu) are implemented"


def _hidden_activation(value, arch):
    if arch != "gemma3" or value in GELU_NAMES + SILU_NAMES:
        return None
    return f"Gemma 3 MLPs with {' / '.join(GELU_NAMES + SILU_NAMES)} are implemented"


FIELDS: dict[str, Field] = {
    # --- architecture selection and shapes
    "architectures": Field(HONOURED, "selects llama / mistral / qwen2 / qwen3 / phi3; anything else is refused"),
    "model_type": Field(HONOURED, "selects the architecture when `architectures` is absent"),
    "vocab_size": Field(HONOURED, "embedding / lm_head rows; checked against the tensors"),
    "hidden_size": Field(HONOURED, "checked against the tensors"),
    "intermediate_size": Field(HONOURED, "MLP width; checked against the tensors"),
    "num_hidden_layers": Field(HONOURED, "layer count; checked against the tensors"),
    "num_attention_heads": Field(HONOURED, "query heads"),
    "num_key_value_heads": Field(HONOURED, "GQA kv heads (default: num_attention_heads)"),
    "head_dim": Field(
        HONOURED, "per-head width (default hidden_size // num_attention_heads; qwen3: 128, as Qwen3Config)"
    ),
    "rms_norm_eps": Field(HONOURED, "RMSNorm epsilon (qwen3: also of the per-head q_norm / k_norm)"),
    "hidden_act": Field(
        REFUSED, "silu/swish honoured; any other activation refused; gemma3 does not read it", _hidden_act
    ),
    "hidden_activation": Field(
        REFUSED, "gemma3: gelu_pytorch_tanh (default), gelu, silu honoured; others refused", _hidden_activation
    ),
    "query_pre_attn_scalar": Field(HONOURED, "gemma3: attention scores scaled by query_pre_attn_scalar ** -0.5"),
    "rope_local_base_freq": Field(HONOURED, "gemma3 (legacy key): RoPE base of the sliding layers (default 10000)"),
    "sliding_window_pattern": Field(
        HONOURED, "gemma3 (legacy key): without layer_types, every pattern-th layer is global (default 6)"
    ),
    "final_logit_softcapping": Field(
        HONOURED, "gemma3: logits -> cap * tanh(logits / cap) in the step graph (null: none, every Gemma 3 release)"
    ),
    "attn_logit_softcapping": Field(
        NO_EFFECT,
        "gemma3: transformers' Gemma3Attention keeps it but never passes it to its attention (Gemma 2's did); "
        "its scores are not capped, nor are the engine's",
    ),
    "use_bidirectional_attention": Field(
        REFUSED,
        "gemma3: false honoured (causal LM); true (EmbeddingGemma) refused",
        _refuse_unless(lambda v: not v, "bidirectional attention is not implemented"),
    ),
    "attention_bias": Field(
        HONOURED,
        "llama, qwen3: biases on q/k/v/o projections; qwen2 (always q/k/v biases) and mistral (none) do not read it",
    ),
    "mlp_bias": Field(HONOURED, "llama: biases on gate/up/down projections; not read by mistral/qwen2/qwen3"),
    "tie_word_embeddings": Field(
        HONOURED,
        "lm_head = embedding; a distinct lm_head.weight beside it is refused (transformers 4.x ties it, 5.x keeps it)",
    ),
    "max_position_embeddings": Field(HONOURED, "upper bound of --max-seq-len; RoPE scaling reference length"),
    # --- RoPE (entries of rope_scaling / rope_parameters: ROPE_FIELDS)
    "rope_theta": Field(HONOURED, "RoPE base (rope_parameters['rope_theta'] wins when both are given)"),
    "rope_scaling": Field(HONOURED, f"legacy name of rope_parameters (wins over it); types {', '.join(ROPE_TYPES)}"),
    "rope_parameters": Field(HONOURED, f"RoPE type and parameters; types {', '.join(ROPE_TYPES)}, others refused"),
    "partial_rotary_factor": Field(
        REFUSED,
        "phi3: RoPE on int(head_dim * factor) dims of each head, honoured; below 1 refused for other architectures "
        "(their transformers code rotates the whole head)",
        _partial_rotary,
    ),
    "original_max_position_embeddings": Field(
        HONOURED,
        "llama3/yarn/longrope pre-training length (transformers gives the top-level value priority; phi3 default "
        "4096); longrope switches to its long factors from this position",
    ),
    # --- attention pattern
    "sliding_window": Field(
        HONOURED,
        "mistral, phi3: window on every layer when not null; qwen2/qwen3: window on the sliding layers when "
        "use_sliding_window; "
        "key j is visible from query i iff i - window < j <= i (masked over cache and tree); llama does not read it",
    ),
    "use_sliding_window": Field(HONOURED, "qwen2/qwen3: switches sliding_window on; not read by llama/mistral"),
    "max_window_layers": Field(
        HONOURED,
        "qwen2/qwen3: layers >= max_window_layers slide (when layer_types is not given); not read otherwise",
    ),
    "layer_types": Field(
        HONOURED,
        "qwen2/qwen3: full_attention / sliding_attention per layer; mistral and llama ignore it (as transformers)",
    ),
    "is_causal": Field(
        REFUSED,
        "causal attention honoured; is_causal false refused",
        _refuse_unless(lambda v: v is not False, "bidirectional attention is not implemented"),
    ),
    # --- generation
    "bos_token_id": Field(HONOURED, "recorded in the engine"),
    "eos_token_id": Field(HONOURED, "generation stops on it (plus generation_config.json's)"),
    "pad_token_id": Field(NO_EFFECT, "embedding padding_idx only affects training gradients"),
    # --- weights format
    "quantization_config": Field(
        REFUSED,
        "quantized checkpoints are refused",
        lambda v, arch: "quantized checkpoints are not supported" if v else None,
    ),
    "pruned_heads": Field(
        REFUSED,
        "pruned attention heads are refused",
        lambda v, arch: "pruned attention heads are not supported" if v else None,
    ),
    "dtype": Field(NO_EFFECT, "storage dtype; the engine dtype comes from `convert --dtype`"),
    "torch_dtype": Field(NO_EFFECT, "legacy name of dtype"),
    # --- training-only or bookkeeping
    "attention_dropout": Field(NO_EFFECT, "dropout is off at inference"),
    "resid_pdrop": Field(NO_EFFECT, "phi3: residual dropout, off at inference"),
    "embd_pdrop": Field(NO_EFFECT, "phi3: embedding dropout, off at inference"),
    "initializer_range": Field(NO_EFFECT, "weight initialisation only"),
    "pretraining_tp": Field(NO_EFFECT, "tensor-parallel split of the same matmuls; transformers 5 does not read it"),
    "use_cache": Field(NO_EFFECT, "the engine always uses its KV cache"),
    "_attn_implementation": Field(NO_EFFECT, "kernel choice; the same attention math"),
    "transformers_version": Field(NO_EFFECT, "bookkeeping"),
    "_name_or_path": Field(NO_EFFECT, "bookkeeping"),
    "auto_map": Field(NO_EFFECT, "custom code is never run; the built-in architecture is used, as transformers does"),
    "output_hidden_states": Field(NO_EFFECT, "what a forward returns, not its values"),
    "output_attentions": Field(NO_EFFECT, "what a forward returns, not its values"),
    "return_dict": Field(NO_EFFECT, "what a forward returns, not its values"),
    "chunk_size_feed_forward": Field(NO_EFFECT, "not read by these architectures"),
    "is_encoder_decoder": Field(NO_EFFECT, "not read by these decoder-only architectures"),
    "id2label": Field(NO_EFFECT, "classification heads only"),
    "label2id": Field(NO_EFFECT, "classification heads only"),
    "problem_type": Field(NO_EFFECT, "classification heads only"),
    # read by transformers' Gemma3ForConditionalGeneration (image + text) only, an architecture that is refused
    "image_token_id": Field(NO_EFFECT, "multimodal Gemma 3 only; the text model does not read it"),
    "mm_tokens_per_image": Field(NO_EFFECT, "multimodal Gemma 3 only; the text model does not read it"),
    "text_config": Field(NO_EFFECT, "multimodal Gemma 3 only (its text part is a Gemma3ForCausalLM config)"),
    "vision_config": Field(NO_EFFECT, "multimodal Gemma 3 only; the text model does not read it"),
}

ROPE_FIELDS: dict[str, Field] = {
    "rope_type": Field(
        HONOURED, f"{', '.join(ROPE_TYPES)}; phi3: default, longrope (su, yarn read as longrope); others refused"
    ),
    "type": Field(HONOURED, "legacy name of rope_type"),
    "rope_theta": Field(HONOURED, "RoPE base"),
    "factor": Field(
        HONOURED,
        "linear / llama3 / dynamic / yarn scale factor; longrope: sets its attention factor (default "
        "max_position_embeddings / original_max_position_embeddings)",
    ),
    "low_freq_factor": Field(HONOURED, "llama3"),
    "high_freq_factor": Field(HONOURED, "llama3"),
    "original_max_position_embeddings": Field(
        HONOURED, "llama3 / yarn pre-training length (default max_position_embeddings)"
    ),
    "attention_factor": Field(
        HONOURED, "yarn, longrope: cos/sin scale (default from factor; yarn also mscale, mscale_all_dim)"
    ),
    "mscale": Field(HONOURED, "yarn attention-factor numerator"),
    "mscale_all_dim": Field(HONOURED, "yarn attention-factor denominator"),
    "beta_fast": Field(HONOURED, "yarn correction range (default 32)"),
    "beta_slow": Field(HONOURED, "yarn correction range (default 1)"),
    "truncate": Field(HONOURED, "yarn: round the correction range (default true)"),
    "partial_rotary_factor": Field(
        REFUSED, "phi3: honoured (wins over the top-level field); below 1 refused elsewhere", _partial_rotary
    ),
    "short_factor": Field(HONOURED, "longrope: inv_freq divisors at positions < original_max_position_embeddings"),
    "long_factor": Field(HONOURED, "longrope: inv_freq divisors from original_max_position_embeddings on"),
}


def refusal(name: str, value: Any, arch: str) -> str | None:
    """The reason `value` of config field `name` is refused for `arch`, or None."""
    field = FIELDS.get(name)
    if field is None or field.refusal is None:
        return None
    return field.refusal(value, arch)


def table_rows() -> list[tuple[str, str, str]]:
    """(field, handling, note) for every top-level and RoPE field (RoPE entries prefixed `rope_parameters.`)."""
    rows = [(name, f.handling, f.note) for name, f in FIELDS.items()]
    rows += [(f"rope_parameters.{name}", f.handling, f.note) for name, f in ROPE_FIELDS.items()]
    return rows

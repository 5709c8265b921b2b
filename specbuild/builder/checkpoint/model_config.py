"""The base model's architecture, read from a Hugging Face config.json and stored in a canonical checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from specbuild.builder.checkpoint import config_fields
from specbuild.errors import SpecbuildError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
}
MODEL_TYPES = {"gemma3_text": "gemma3"}  # config.json model_type -> architecture, where the names differ
# transformers' config-class defaults for keys a config.json of the architecture may leave out (Gemma3TextConfig)
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": dict(
        head_dim=256, tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
        sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, bos_token_id=2,
        eos_token_id=1,
    ),
}  # fmt: skip
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
DEFAULT_ROPE_THETA = 10000.0
# transformers' defaults when config.json omits the key
MISTRAL_DEFAULT_WINDOW = 4096
QWEN2_DEFAULT_WINDOW = 4096
QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28
QWEN3_DEFAULT_HEAD_DIM = 128  # Qwen3Config's default: not hidden_size // num_attention_heads
SLIDING_BY_LAYER_TYPES = ("qwen2", "qwen3")  # use_sliding_window + max_window_layers / layer_types
SLIDING_EVERYWHERE = ("mistral", "phi3")  # sliding_window, when not null, on every layer
PHI3_DEFAULT_ORIGINAL_MAX = 4096  # Phi3Config's original_max_position_embeddings default
PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}  # Phi3Config reads both as longrope


@dataclasses.dataclass
class ModelConfig:
    """Everything the network needs to know about a Llama-family base model (see config_fields for the HF fields)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_tanh | gelu (erf)
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + weight): Gemma's 1 + weight
    sandwich_norms: bool = False  # Gemma: attention, MLP outputs normed too (post_attention, pre-/post_feedforward)
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), in the model's dtype
    attention_scale: float | None = None  # attention score scale; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # Gemma: logits -> cap * tanh(logits / cap)
    sliding_rope_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3's local base); None: rope_theta
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None  # {"rope_type": linear|llama3|dynamic|yarn|longrope, ...}; None = default RoPE
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of each head (partial rotary); None = all
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases
    o_proj_bias: bool = False  # attention output projection bias (llama attention_bias)
    mlp_bias: bool = False  # gate/up/down projection biases (llama mlp_bias)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (qwen3 q_norm / k_norm)
    sliding_window: int | None = None  # keys j visible from query i iff i - window < j <= i ...
    sliding_layers: list[int] = dataclasses.field(default_factory=list)  # ... on these layers
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: list[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "model config") -> ModelConfig:
        """The config a canonical checkpoint stores (config.yaml `model:`), every key type-checked."""
        if not isinstance(data, dict):
            raise SpecbuildError(f"{source}: expected a mapping, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(fields)
        if unknown:
            raise SpecbuildError(f"{source}: unknown model config keys: {sorted(unknown)}")
        for name, field in fields.items():
            required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            if name not in data:
                if required:
                    raise SpecbuildError(f"{source}: model config key {name!r} is missing")
                continue
            if not _has_type(data[name], str(field.type)):
                raise SpecbuildError(
                    f"{source}: model config key {name!r} is {_show(data[name])}, expected {field.type}"
                )
        return cls(**data)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """A transformers config dict (Llama, Mistral, Qwen2, Qwen3, Phi-3); each field is honoured or refused
        (config_fields)."""
        if not isinstance(hf, dict):
            raise SpecbuildError(f"{source}: expected a JSON object, got {type(hf).__name__}")
        archs = hf.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            model_type = MODEL_TYPES.get(hf.get("model_type"), hf.get("model_type"))
            arch = model_type if model_type in SUPPORTED_ARCHITECTURES.values() else None
        if arch is None:
            raise SpecbuildError(
                f"{source}: unknown architecture {archs or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key, value in hf.items():
            reason = config_fields.refusal(key, value, arch)
            if reason:
                raise SpecbuildError(f"{source}: {key} {_show(value)} is not supported: {reason}")
        hf = {**ARCH_DEFAULTS.get(arch, {}), **hf}  # the config class's defaults for keys it leaves out
        read = _Reader(hf, source)
        hidden = read.int("hidden_size")
        heads = read.int("num_attention_heads")
        head_dim = read.int("head_dim", default=None) or hidden // heads
        if arch == "qwen3" and "head_dim" not in hf:
            head_dim = QWEN3_DEFAULT_HEAD_DIM
        if head_dim < 1:
            raise SpecbuildError(f"{source}: hidden_size {hidden} // num_attention_heads {heads} gives head_dim 0")
        kv_heads = read.int("num_key_value_heads", default=None) or heads
        if heads % kv_heads:
            raise SpecbuildError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        layers = read.int("num_hidden_layers")
        max_pos = read.int("max_position_embeddings", default=2048)
        if arch == "gemma3":
            (theta, rope_scaling, rotary_dim), sliding_theta = _gemma3_rope(hf, source, max_pos, head_dim)
        else:
            (theta, rope_scaling, rotary_dim), sliding_theta = _rope(hf, source, max_pos, head_dim, arch), None
        window, sliding = _sliding_window(hf, arch, layers, read, source)
        gemma = arch == "gemma3"
        act = hf.get("hidden_activation" if gemma else "hidden_act", "silu")
        eos_ids = read.token_ids("eos_token_id")
        biased = read.bool("attention_bias", default=False)  # llama, qwen3: q/k/v/o biases
        bos = read.token_ids("bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=read.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=read.int("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=read.float("rms_norm_eps", default=1e-6, positive=True),
            hidden_act=ACTIVATIONS[act],
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embedding_scale=hidden**0.5 if gemma else None,
            attention_scale=read.float("query_pre_attn_scalar", default=0, positive=True) ** -0.5 if gemma else None,
            final_logit_softcapping=read.optional_float("final_logit_softcapping") if gemma else None,
            sliding_rope_theta=sliding_theta,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rotary_dim=rotary_dim,
            tie_word_embeddings=read.bool("tie_word_embeddings", default=False),
            attention_bias=arch == "qwen2" or (arch in ("llama", "qwen3", "gemma3") and biased),
            o_proj_bias=arch in ("llama", "qwen3", "gemma3") and biased,
            mlp_bias=arch == "llama" and read.bool("mlp_bias", default=False),
            qk_norm=arch in ("qwen3", "gemma3"),
            sliding_window=window,
            sliding_layers=sliding,
            max_position_embeddings=max_pos,
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=eos_ids,
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape for every tensor the base model must hold."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.sandwich_norms:
                shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
                shapes[p + "post_feedforward_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (q,)
                shapes[p + "self_attn.k_proj.bias"] = (kv,)
                shapes[p + "self_attn.v_proj.bias"] = (kv,)
            if self.o_proj_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (d,)
                shapes[p + "self_attn.k_norm.weight"] = (d,)
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
            if self.mlp_bias:
                shapes[p + "mlp.gate_proj.bias"] = (self.intermediate_size,)
                shapes[p + "mlp.up_proj.bias"] = (self.intermediate_size,)
                shapes[p + "mlp.down_proj.bias"] = (h,)
        return shapes

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None for full attention (also for a window no sequence
        can outgrow, as Phi-4-mini's 262144 within 131072 positions: the graph then keeps its plain causal path)."""
        if layer not in self.sliding_layers or self.sliding_window >= self.max_position_embeddings:
            return None
        return self.sliding_window

    def rope_frequencies(self):
        """(inv_freq float32 tensor [D/2], attention scaling of cos/sin), computed as transformers computes them."""
        import torch

        d = self.rotary_dim or self.head_dim
        base = self.rope_theta
        rs = self.rope_scaling or {"rope_type": "default"}
        kind = rs["rope_type"]

        def default(theta):
            return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d))

        if kind == "default":
            return default(base), 1.0
        if kind == "linear":
            return default(base) / rs["factor"], 1.0
        if kind == "dynamic":
            # transformers' initial frequencies (seq_len = max_position_embeddings); it rescales only beyond that
            factor, seq_len = rs["factor"], self.max_position_embeddings
            base = base * ((factor * seq_len / self.max_position_embeddings) - (factor - 1)) ** (d / (d - 2))
            return default(base), 1.0
        if kind == "llama3":
            inv = default(base)
            factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
            old_ctx = rs["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled), 1.0
        if kind == "yarn":
            return _yarn(rs, base, d, self.max_position_embeddings)
        if kind == "longrope":  # the short factors (long_rope_frequencies: the long ones, rope_switch: from where)
            return _longrope(rs, rs["short_factor"], base, d, self.max_position_embeddings)
        raise SpecbuildError(f"unsupported rope_type {kind!r}")  # from_hf refuses it first

    def sliding_rope_frequencies(self):
        """inv_freq [D/2] of the sliding layers' RoPE (default type, base sliding_rope_theta), as transformers'
        Gemma3RotaryEmbedding computes it."""
        import torch

        d = self.head_dim
        return 1.0 / (self.sliding_rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d))

    def rope_switch(self) -> int | None:
        """LongRoPE (Phi-3): the sequence length from which the long factors rotate every position
        (original_max_position_embeddings), None when the model has no switch below max_position_embeddings.

        transformers' Phi-3 rotates a sequence of up to that many tokens with the short factors; once it grows past
        it, Phi3ForCausalLM.prepare_inputs_for_generation drops the KV cache and recomputes the whole sequence with
        the long factors, so every earlier key changes. An engine built past it does the same (ef.ROPE_LONG)."""
        rs = self.rope_scaling or {}
        if rs.get("rope_type") == "longrope":
            original = int(rs["original_max_position_embeddings"])
            if original < self.max_position_embeddings:
                return original
        return None

    def long_rope_frequencies(self):
        """inv_freq [R/2] of LongRoPE's long factors (the attention factor is the short ones': rope_frequencies)."""
        rs = self.rope_scaling
        return _longrope(rs, rs["long_factor"], self.rope_theta, self.rotary_dim or self.head_dim,
                         self.max_position_embeddings)[0]  # fmt: skip


def _longrope(rs: dict, ext_factors: list, base: float, d: int, max_pos: int):
    """(inv_freq, attention factor) of LongRoPE with one set of extension factors, as transformers computes them."""
    import torch

    original = rs["original_max_position_embeddings"]
    factor = rs.get("factor")
    if factor is None:
        factor = max_pos / original
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base**shape), float(attention)


def _yarn(rs: dict, base: float, d: int, max_pos: int):
    import torch

    factor = rs.get("factor")
    old_ctx = rs["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / old_ctx

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rs.get("attention_factor")
    if attention is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations):
        return (d * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).to(dtype=torch.float) / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _has_type(value, annotation: str) -> bool:
    """Whether a YAML value fits a ModelConfig annotation such as "int", "float", "int | None", "list[int]"."""
    if value is None:
        return "None" in annotation
    if annotation.startswith("list"):
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if annotation.startswith("dict"):
        return isinstance(value, dict)
    if annotation.startswith("bool"):
        return isinstance(value, bool)
    if annotation.startswith("int"):
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation.startswith("float"):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if annotation.startswith("str"):
        return isinstance(value, str)
    return True


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Reader:
    """Typed reads of config.json values; a wrong type or range is one error naming the field and its value."""

    def __init__(self, hf: dict, source: str):
        self.hf, self.source = hf, source

    def _bad(self, key, want: str):
        return SpecbuildError(f"{self.source}: {key} {_show(self.hf.get(key))} is not {want}")

    def int(self, key: str, default=..., minimum: int = 1):
        value = self.hf.get(key)
        if value is None:
            if default is ...:
                raise SpecbuildError(f"{self.source}: missing required key {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise self._bad(key, "an integer")
        if int(value) < minimum:
            raise self._bad(key, f"an integer >= {minimum}")
        return int(value)

    def float(self, key: str, default: float, positive: bool = False) -> float:
        value = self.hf.get(key, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(key, "a finite number")
        if positive and value <= 0:
            raise self._bad(key, "a positive number")
        return float(value)

    def optional_float(self, key: str) -> float | None:
        """A positive number, or None where the key is absent or null."""
        return None if self.hf.get(key) is None else self.float(key, default=0, positive=True)

    def bool(self, key: str, default: bool) -> bool:
        value = self.hf.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def token_ids(self, key: str) -> list[int]:
        value = self.hf.get(key)
        values = [] if value is None else value if isinstance(value, list) else [value]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise self._bad(key, "a token id or a list of token ids")
        return [int(v) for v in values]


def _rope(hf: dict, source: str, max_pos: int, head_dim: int, arch: str) -> tuple[float, dict | None, int | None]:
    """(rope_theta, normalized rope_scaling or None, rotary_dim or None) as transformers resolves them
    (rope_scaling wins over rope_parameters)."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict):
        raise SpecbuildError(f"{source}: {field} {_show(params)} is not an object")
    if any(k in config_fields.ATTENTION_KINDS for k in params):
        raise SpecbuildError(
            f"{source}: {field} {_show(params)} is not supported: per-layer-type RoPE parameters are not implemented"
        )
    for key, value in params.items():
        f = config_fields.ROPE_FIELDS.get(key)
        reason = f.refusal(value, arch) if f is not None and f.refusal is not None else None
        if reason:
            raise SpecbuildError(f"{source}: {field}.{key} {_show(value)} is not supported: {reason}")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    theta = DEFAULT_ROPE_THETA if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise SpecbuildError(f"{source}: rope_theta {_show(theta)} is not a finite positive number")
    kind = params.get("rope_type", params.get("type", "default"))
    rotary_dim = _rotary_dim(hf, params, head_dim, arch, source)
    if arch == "phi3":
        kind = PHI3_ROPE_ALIASES.get(kind, kind)
        if kind not in config_fields.PHI3_ROPE_TYPES:
            raise SpecbuildError(
                f"{source}: {field}.rope_type {_show(kind)} is not supported: Phi-3 takes "
                f"{' or '.join(config_fields.PHI3_ROPE_TYPES)} (as transformers' Phi3Config)"
            )
    elif kind not in config_fields.ROPE_TYPES:
        raise SpecbuildError(
            f"{source}: {field}.rope_type {_show(kind)} is not supported; supported: "
            f"{', '.join(config_fields.ROPE_TYPES)} (and longrope for Phi-3)"
        )
    if kind == "default":
        return float(theta), None, rotary_dim
    out: dict[str, Any] = {"rope_type": kind}

    def number(key, default=..., positive=True):
        value = params.get(key)
        if value is None:
            if default is ...:
                raise SpecbuildError(f"{source}: {field}.{key} is missing (needed by rope_type {kind})")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpecbuildError(f"{source}: {field}.{key} {_show(value)} is not a finite number")
        if positive and value <= 0:
            raise SpecbuildError(f"{source}: {field}.{key} {_show(value)} is not a positive number")
        return value

    if kind in ("linear", "dynamic"):
        out["factor"] = number("factor")
    if kind in ("llama3", "yarn", "longrope"):
        top = hf.get("original_max_position_embeddings")  # transformers gives the top-level value priority
        fallback = PHI3_DEFAULT_ORIGINAL_MAX if arch == "phi3" else max_pos
        out["original_max_position_embeddings"] = (
            top if top is not None else number("original_max_position_embeddings", default=fallback)
        )
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            out[key] = _factors(params.get(key), (rotary_dim or head_dim) // 2, f"{source}: {field}.{key}")
        out["factor"] = number("factor", default=None)
        out["attention_factor"] = number("attention_factor", default=None)
    if kind == "llama3":
        out["factor"] = number("factor")
        out["low_freq_factor"] = number("low_freq_factor")
        out["high_freq_factor"] = number("high_freq_factor")
        if out["high_freq_factor"] == out["low_freq_factor"]:
            raise SpecbuildError(f"{source}: {field} low_freq_factor and high_freq_factor must differ")
    if kind == "yarn":
        out["factor"] = number("factor", default=None)
        for key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
            value = number(key, default=None, positive=False)
            if value is not None:
                out[key] = value
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise SpecbuildError(f"{source}: {field}.truncate {_show(truncate)} is not true or false")
        out["truncate"] = truncate
    if kind == "dynamic" and head_dim <= 2:
        raise SpecbuildError(f"{source}: dynamic RoPE needs head_dim > 2")
    return float(theta), out, rotary_dim


def _gemma3_rope(hf: dict, source: str, max_pos: int, head_dim: int):
    """((rope_theta, rope_scaling, None) of the full-attention layers, RoPE base of the sliding layers) as
    Gemma3TextConfig resolves them: rope_parameters per layer type, or the legacy rope_theta (+ rope_scaling) and
    rope_local_base_freq. The sliding layers' RoPE must be the default type (every Gemma 3 is)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and any(k in config_fields.ATTENTION_KINDS for k in params):
        unknown = set(params) - set(config_fields.ATTENTION_KINDS)
        if unknown:
            raise SpecbuildError(f"{source}: rope_parameters has keys {sorted(unknown)} beside the layer types")
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or {})
    else:
        full = {"rope_type": "default", **(params or {}), **(hf.get("rope_scaling") or {})}
        full.setdefault("rope_theta", hf.get("rope_theta"))
        sliding = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq")}
    full.setdefault("rope_theta", ARCH_DEFAULTS["gemma3"]["rope_theta"])
    sliding.setdefault("rope_theta", ARCH_DEFAULTS["gemma3"]["rope_local_base_freq"])
    kind = sliding.get("rope_type", sliding.get("type", "default"))
    if kind != "default":
        raise SpecbuildError(
            f"{source}: rope_parameters.sliding_attention.rope_type {_show(kind)} is not supported: the sliding "
            "layers' RoPE is implemented with the default type only"
        )
    local = _rope({"rope_parameters": {"rope_theta": sliding["rope_theta"]}}, source, max_pos, head_dim, "gemma3")[0]
    return _rope({"rope_parameters": full}, source, max_pos, head_dim, "gemma3"), local


def _gemma3_sliding(hf: dict, layers: int, read: _Reader, source: str) -> tuple[int | None, list[int]]:
    """Gemma 3's local layers: layer_types, or every layer but each sliding_window_pattern-th (Gemma3TextConfig)."""
    window = read.int("sliding_window")
    kinds = hf.get("layer_types")
    if kinds is None:
        pattern = read.int("sliding_window_pattern")
        return window, [i for i in range(layers) if (i + 1) % pattern]
    known = config_fields.ATTENTION_KINDS
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in known for k in kinds):
        raise SpecbuildError(
            f"{source}: layer_types {_show(kinds)} must list {layers} entries of "
            f"{' / '.join(config_fields.ATTENTION_KINDS)}"
        )
    return window, [i for i, k in enumerate(kinds) if k == "sliding_attention"]


def _rotary_dim(hf: dict, params: dict, head_dim: int, arch: str, source: str) -> int | None:
    """Phi-3's partial rotary: RoPE on int(head_dim * partial_rotary_factor) dims (the rope parameters' factor wins
    over the top-level one, as Phi3Config resolves them); None when it covers the whole head. Other architectures
    refuse a factor below 1 first (config_fields)."""
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if factor is None or arch != "phi3":
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise SpecbuildError(f"{source}: partial_rotary_factor {_show(factor)} is not a number in (0, 1]")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise SpecbuildError(
            f"{source}: partial_rotary_factor {_show(factor)} gives {dim} rotary dims of head_dim {head_dim}; "
            "RoPE needs an even number of at least 2"
        )
    return None if dim == head_dim else dim


def _factors(value, count: int, where: str) -> list[float]:
    """LongRoPE's short or long factors: `count` positive finite numbers."""
    if (
        not isinstance(value, list)
        or len(value) != count
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0 for v in value)
    ):
        raise SpecbuildError(f"{where} {_show(value)} is not a list of {count} positive numbers (rotary dims / 2)")
    return [float(v) for v in value]


def _sliding_window(hf: dict, arch: str, layers: int, read: _Reader, source: str) -> tuple[int | None, list[int]]:
    """(window, sliding layer indices) as transformers' Mistral, Phi-3, Qwen2 and Qwen3 modeling applies them; Llama
    has none."""
    if arch in SLIDING_EVERYWHERE:
        default = MISTRAL_DEFAULT_WINDOW if arch == "mistral" else None  # their config classes' defaults
        window = read.int("sliding_window", default=None) if "sliding_window" in hf else default
        return window, list(range(layers)) if window is not None else []
    if arch == "gemma3":
        return _gemma3_sliding(hf, layers, read, source)
    if arch not in SLIDING_BY_LAYER_TYPES:
        return None, []
    use = read.bool("use_sliding_window", default=False)
    window = (
        (read.int("sliding_window", default=None) if "sliding_window" in hf else QWEN2_DEFAULT_WINDOW) if use else None
    )
    kinds = hf.get("layer_types")
    if kinds is None:
        first = read.int("max_window_layers", default=QWEN2_DEFAULT_MAX_WINDOW_LAYERS, minimum=0)
        return window, [i for i in range(layers) if window is not None and i >= first]
    if (
        not isinstance(kinds, list)
        or len(kinds) != layers
        or any(k not in config_fields.ATTENTION_KINDS for k in kinds)
    ):
        raise SpecbuildError(
            f"{source}: layer_types {_show(kinds)} must list {layers} entries of "
            f"{' / '.join(config_fields.ATTENTION_KINDS)}"
        )
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    if sliding and window is None:
        raise SpecbuildError(
            f"{source}: layer_types names sliding_attention layers but there is no sliding window "
            f"(use_sliding_window {_show(hf.get('use_sliding_window'))}, sliding_window "
            f"{_show(hf.get('sliding_window'))}); transformers cannot run this config either"
        )
    return window, sliding

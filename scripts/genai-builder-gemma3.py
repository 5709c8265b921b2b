"""Run ONNX Runtime GenAI 0.18's model builder on a transformers-5 Gemma 3 checkpoint: its builder reads the global
RoPE from rope_parameters['rope_type'] / rope_theta and the local base from rope_local_base_freq (transformers 4
names), so the loaded config is given those names (the same values)."""

import sys

import transformers

original = transformers.AutoConfig.from_pretrained.__func__


def patched(cls, *args, **kwargs):
    out = original(cls, *args, **kwargs)
    config = out[0] if isinstance(out, tuple) else out
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        config.rope_local_base_freq = params["sliding_attention"]["rope_theta"]
        config.rope_parameters = {**params, **params["full_attention"]}  # both readings: per type, and global
        config.rope_theta = params["full_attention"]["rope_theta"]
    return out


transformers.AutoConfig.from_pretrained = classmethod(patched)
import runpy  # noqa: E402

sys.argv = ["builder", *sys.argv[1:]]
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")

"""ONNX Runtime GenAI 0.18's model builder, taking transformers-5 Gemma 3 configs too (the benchmarks' peer models).

`python -m specbuild.bench.genai_builder -i HF_DIR -o OUT -p int4 -e cpu` takes the builder's own arguments. Its
builder reads a Gemma 3 model's global RoPE from rope_parameters['rope_type'] / rope_theta and the local base from
rope_local_base_freq (transformers 4 names); transformers 5 keeps them per layer type, so the loaded config is given
those names too (the same values). Every other config is passed on as it is."""

import runpy
import sys


def with_gemma3_rope_names(config):
    """The config, given transformers 4's names of a Gemma 3 RoPE (global rope_type/rope_theta, the local
    rope_local_base_freq) where it keeps them per layer type; any other config as it is."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        config.rope_local_base_freq = params["sliding_attention"]["rope_theta"]
        config.rope_parameters = {**params, **params["full_attention"]}  # both readings: per type, and global
        config.rope_theta = params["full_attention"]["rope_theta"]
    return config


def main(argv: list[str]) -> None:
    import transformers

    original = transformers.AutoConfig.from_pretrained.__func__

    def patched(cls, *args, **kwargs):
        out = original(cls, *args, **kwargs)
        with_gemma3_rope_names(out[0] if isinstance(out, tuple) else out)
        return out

    transformers.AutoConfig.from_pretrained = classmethod(patched)
    sys.argv = ["builder", *argv]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

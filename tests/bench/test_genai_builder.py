"""The GenAI builder's wrapper gives a transformers-5 Gemma 3 config the RoPE names the builder reads (same values)
and leaves other configs alone."""

import transformers

from specbuild.bench.genai_builder import with_gemma3_rope_names


def test_gemma3_config_gets_global_and_local_rope_names():
    config = with_gemma3_rope_names(transformers.Gemma3TextConfig())
    assert config.rope_parameters["rope_type"] == "default"
    assert config.rope_theta == config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.rope_local_base_freq == config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0


def test_other_configs_unchanged():
    config = transformers.LlamaConfig()
    before = config.to_dict()
    assert with_gemma3_rope_names(config).to_dict() == before

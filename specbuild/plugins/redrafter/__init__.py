"""`--speculative-mode redrafter`: Apple's recurrent drafter (ReDrafter). After acceptance the step graph runs the
drafter's beam search from the last accepted token's hidden state, merges the beams' shared prefixes into one tree
and outputs it as the next call's candidates (Cheng et al. 2024, arXiv:2403.09919;
github.com/apple/ml-recurrent-drafter)."""

from specbuild.modes.spec import ENGINE_DRAFTED, MAX_DRAFT_LEN, TYPICAL_ACCEPTANCE, ModeOption, ModeSpec

DEFAULT_NUM_BEAMS = 5  # TensorRT-LLM's redrafter_num_beams and redrafter_draft_len_per_beam
DEFAULT_DRAFT_LEN = 5
TOP_K_WARP = 50  # the reference's top-k warp of every drafting step (logits outside the top 50 are masked)

MODE = ModeSpec(
    name="redrafter",
    family=ENGINE_DRAFTED,
    summary="ReDrafter recurrent drafter (apple/ml-recurrent-drafter): in-graph beam search, prefix-merged tree",
    graph_plugin="specbuild.plugins.redrafter.graph:RedrafterPlugin",
    drafter="specbuild.plugins.redrafter.drafter:RedrafterDrafter",
    options=(
        ModeOption(
            "redrafter_num_beams",
            "int",
            f"ReDrafter: beams of the drafter's beam search (default {DEFAULT_NUM_BEAMS}, at most the top-k warp "
            f"{TOP_K_WARP}).",
            minimum=1,
        ),
        ModeOption(
            "redrafter_draft_len_per_beam",
            "int",
            f"ReDrafter: draft tokens per beam (default {DEFAULT_DRAFT_LEN}).",
            minimum=1,
        ),
        MAX_DRAFT_LEN,
        TYPICAL_ACCEPTANCE,
    ),
    heads="ReDrafter drafter directory (config.json + model.safetensors, model.pt or pytorch_model.bin).",
    converter="specbuild.plugins.redrafter.convert:convert_redrafter",
    trainer="specbuild.plugins.redrafter.training:run_redrafter_recipe",
    head_evaluator="specbuild.plugins.redrafter.training:evaluate_heads",
)

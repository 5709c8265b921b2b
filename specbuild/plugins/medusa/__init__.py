"""`--speculative-mode medusa`: Medusa heads draft a static tree inside the step graph."""

from specbuild.modes.spec import (
    ENGINE_DRAFTED,
    GRAPH_DRAFTER,
    MAX_DRAFT_LEN,
    TREE,
    TYPICAL_ACCEPTANCE,
    ModeOption,
    ModeSpec,
)

MODE = ModeSpec(
    name="medusa",
    family=ENGINE_DRAFTED,
    summary="Medusa heads (v0.1 .pt, legacy .safetensors, v2, Medusa-2 full models)",
    graph_plugin="specbuild.plugins.medusa.graph:MedusaPlugin",
    drafter=GRAPH_DRAFTER,
    options=(
        TREE,
        MAX_DRAFT_LEN,
        ModeOption("medusa_top_k", "int", "Top-k per Medusa head when building the tree.", minimum=1),
        TYPICAL_ACCEPTANCE,
    ),
    heads="Medusa heads directory.",
    converter="specbuild.plugins.medusa.graph:convert_medusa",
    trainer="specbuild.plugins.medusa.training:run_medusa_recipe",
    head_evaluator="specbuild.plugins.medusa.training:evaluate_heads",
)

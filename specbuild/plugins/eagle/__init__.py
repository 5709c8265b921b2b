"""`--speculative-mode eagle`: EAGLE-1 (static tree) and EAGLE-2 (dynamic top-k tree) drafting in the step graph."""

from specbuild.plugins.spec import (
    ENGINE_DRAFTED,
    GRAPH_DRAFTER,
    MAX_DRAFT_LEN,
    TREE,
    TYPICAL_ACCEPTANCE,
    ModeOption,
    ModeSpec,
)

OPTIONS = (
    TREE,
    MAX_DRAFT_LEN,
    ModeOption("eagle_top_k", "int", "EAGLE-2 dynamic tree: top-k per expansion.", minimum=1),
    ModeOption("eagle_depth", "int", "EAGLE-2 dynamic tree: draft depth.", minimum=1),
    ModeOption("eagle_total_tokens", "int", "EAGLE-2 dynamic tree: nodes kept for verification.", minimum=2),
    TYPICAL_ACCEPTANCE,
)

MODE = ModeSpec(
    name="eagle",
    family=ENGINE_DRAFTED,
    summary="EAGLE-1/2 draft head (SafeAILab ea_layer state dicts)",
    graph_plugin="specbuild.plugins.eagle.graph:EaglePlugin",
    drafter=GRAPH_DRAFTER,
    options=OPTIONS,
    heads="EAGLE-1/2 draft head directory.",
    converter="specbuild.plugins.eagle.convert:convert_eagle",
    trainer="specbuild.plugins.eagle.training:run_eagle_recipe",
)

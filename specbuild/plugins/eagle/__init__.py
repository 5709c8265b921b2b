"""`--speculative-mode eagle`: EAGLE-1 (static tree) and EAGLE-2 (dynamic top-k tree) drafting in the step graph."""

from specbuild.modes.spec import ENGINE_DRAFTED, GRAPH_DRAFTER, ModeSpec
from specbuild.plugins.feature_draft import OPTIONS

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
    head_evaluator="specbuild.plugins.eagle.training:evaluate_heads",
)

"""`--speculative-mode eagle3`: EAGLE-3 drafting (fused low/mid/high features, reduced draft vocabulary)."""

from specbuild.modes.spec import ENGINE_DRAFTED, GRAPH_DRAFTER, ModeSpec
from specbuild.plugins.feature_draft import OPTIONS

MODE = ModeSpec(
    name="eagle3",
    family=ENGINE_DRAFTED,
    summary="EAGLE-3 draft head (SafeAILab, ModelOpt and speculators exports)",
    graph_plugin="specbuild.plugins.eagle3.graph:Eagle3Plugin",
    drafter=GRAPH_DRAFTER,
    demo=True,
    options=OPTIONS,
    heads="EAGLE-3 draft head directory.",
    converter="specbuild.plugins.eagle3.convert:convert_eagle3",
    trainer="specbuild.plugins.eagle3.training:run_eagle3_recipe",
    head_evaluator="specbuild.plugins.eagle3.training:evaluate_heads",
    features="specbuild.plugins.eagle3.training:LAYER_FEATURES",
)

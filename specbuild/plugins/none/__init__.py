"""`--speculative-mode none`: plain autoregressive decoding through the same step graph (the baseline)."""

from specbuild.modes.spec import GRAPH_DRAFTER, PLAIN, ModeSpec

MODE = ModeSpec(
    name="none",
    family=PLAIN,
    summary="plain autoregressive decoding (the baseline every mode reproduces)",
    graph_plugin="specbuild.plugins.none.graph:NonePlugin",
    drafter=GRAPH_DRAFTER,
)

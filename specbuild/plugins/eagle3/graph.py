"""`--speculative-mode eagle3`: EAGLE-3 drafting in the graph (the shared plugin: specbuild.plugins.feature_draft.
graph) from three captured base-layer inputs, with a reduced draft vocabulary."""

from __future__ import annotations

from specbuild.plugins.eagle3.draft_net import Eagle3Net
from specbuild.plugins.feature_draft.graph import FeatureDraftPlugin


class Eagle3Plugin(FeatureDraftPlugin):
    name = "eagle3"
    head_key = "eagle3"
    net_class = Eagle3Net

    def __init__(self, checkpoint, net, settings):
        super().__init__(checkpoint, net, settings)
        self.capture_layers = tuple(int(i) for i in checkpoint.heads[self.head_key]["capture_layers"])

    def manifest(self) -> dict:
        # speculators/vLLM heads: the layer's residual is hidden_norm(x), not x
        return {**super().manifest(), "draft_norm_before_residual": self.drafter.c["norm_before_residual"]}

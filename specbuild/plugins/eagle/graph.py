"""`--speculative-mode eagle`: EAGLE-1 (static `--tree`) and EAGLE-2 (dynamic top-k tree) drafting in the graph,
with the EAGLE-1 draft network (the shared plugin: specbuild.plugins.feature_draft.graph)."""

from __future__ import annotations

from specbuild.plugins.eagle.draft_net import Eagle1Net
from specbuild.plugins.feature_draft.graph import FeatureDraftPlugin


class EaglePlugin(FeatureDraftPlugin):
    name = "eagle"
    head_key = "eagle"
    net_class = Eagle1Net

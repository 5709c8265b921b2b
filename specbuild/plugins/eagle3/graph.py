"""`--speculative-mode eagle3`: EAGLE-3 drafting (fused low/mid/high features, reduced draft vocabulary)."""

from specbuild.plugins.eagle.graph import EaglePlugin


class Eagle3Plugin(EaglePlugin):
    name = "eagle3"
    head_key = "eagle3"

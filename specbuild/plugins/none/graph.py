"""`--speculative-mode none`: plain autoregressive decoding through the same step graph."""

from specbuild.builder.network.mode_plugin import ModePlugin


class NonePlugin(ModePlugin):
    name = "none"

    def __init__(self, checkpoint=None, net=None, settings=None):
        super().__init__()

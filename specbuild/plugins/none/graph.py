"""`--speculative-mode none`: plain autoregressive decoding through the same step graph."""

from specbuild.modes.base import ModePlugin


class NonePlugin(ModePlugin):
    name = "none"

    def __init__(self, checkpoint=None, net=None, settings=None):
        super().__init__()

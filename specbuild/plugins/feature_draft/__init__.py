"""What the feature-conditioned draft modes share (a draft network that reads the base model's features and
proposes a tree inside the step graph): their build options here, the network and tree expansion (`draft_net`),
the graph plugin (`graph`), head-converter checks (`convert`) and training-time-test training (`training`).

Not a mode itself: the registry lists only mode packages, which specialise these pieces. Light, like a mode's
`__init__`: no torch.
"""

from specbuild.modes.spec import MAX_DRAFT_LEN, TREE, TYPICAL_ACCEPTANCE, ModeOption

OPTIONS = (
    TREE,
    MAX_DRAFT_LEN,
    ModeOption("eagle_top_k", "int", "EAGLE-2 dynamic tree: top-k per expansion.", minimum=1),
    ModeOption("eagle_depth", "int", "EAGLE-2 dynamic tree: draft depth.", minimum=1),
    ModeOption("eagle_total_tokens", "int", "EAGLE-2 dynamic tree: nodes kept for verification.", minimum=2),
    TYPICAL_ACCEPTANCE,
)

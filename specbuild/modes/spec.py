"""What a speculative mode declares about itself (`ModeSpec`), read by the CLI, builder, runtime and benchmark.

A mode package `specbuild/plugins/<mode>/` defines `MODE = ModeSpec(...)` in its `__init__`. That module is light
(no torch, no builder): the runtime imports it to find the mode's drafter. Everything heavy is named by a
"module:attribute" string and imported only by whoever needs it: the graph plugin (torch, build time), the head
converter (build time), the trainer (training time) and the runtime drafter (numpy).
"""

from __future__ import annotations

import dataclasses

# mode families (docs/modes.md): who proposes the draft tokens
PLAIN = "plain"  # no drafts: autoregressive decoding through the same step graph (the baseline)
ENGINE_DRAFTED = "engine"  # the step graph drafts the next tree after acceptance (Medusa, EAGLE)
HOST_DRAFTED = "host"  # the runtime's drafter proposes tokens and a tree; the graph verifies them (n-gram)
FAMILIES = (PLAIN, ENGINE_DRAFTED, HOST_DRAFTED)


@dataclasses.dataclass(frozen=True)
class ModeOption:
    """A build option a mode reads: `--<name with dashes>` on `specbuild build`, a key in build recipes.

    kind: "int", "float", "text" (a string the mode parses, e.g. a tree) or "pair" (two numbers "A,B").
    minimum: the smallest accepted value of an int option (None: no bound here; the mode checks it).
    metavar: how --help shows the value (None: click's default for the kind)."""

    name: str
    kind: str
    help: str
    minimum: int | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """Everything the rest of specbuild knows about a mode."""

    name: str
    family: str
    summary: str
    graph_plugin: str  # "module:Class": the torch ModePlugin (graph pieces), build time only
    drafter: str  # "module:Class": the runtime drafter (numpy only)
    options: tuple[ModeOption, ...] = ()  # build options this mode reads (others are refused)
    heads: str | None = None  # what `specbuild convert --<name>-dir DIR` reads (help text); None: no heads
    # "module:function": (head_dir, model_config, base_tensors, base_dir=model_dir) -> (cfg, tensors)
    converter: str | None = None
    trainer: str | None = None  # "module:function": (recipe dict of load_recipe, log) -> metrics, `kind: <name>`
    demo: bool = False  # the mode `specbuild demo` shows beside plain decoding (shipped heads, speculates most on chat)
    features: str | None = None  # "module:attribute": the training.features.LayerFeatures its trainer reads
    # "module:function": (head dirs, hf_dir, corpus records, device, log) -> held-out metrics of each head
    # (`specbuild corpus compare-heads`)
    head_evaluator: str | None = None
    head_flag: str | None = None  # the `specbuild convert` flag of the heads (default --<name>-dir)
    # "module:function": (directory, target transformers model) -> the transformers model that drafts for it in
    # transformers' assisted generation (`specbuild bench --hf-assistant-dir`), or None when the directory is not one
    # of this mode's (a draft that borrows the target's embedding gets it here)
    hf_assistant: str | None = None
    shipped_name: str | None = None  # heads shipped for SmolLM2 live in data/heads/smollm2-<this> (default: name)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"mode {self.name}: family {self.family!r} is not one of {FAMILIES}")

    @property
    def baseline(self) -> bool:
        """Plain decoding: the engine speculative engines are compared with (and must reproduce)."""
        return self.family == PLAIN

    @property
    def head_option(self) -> str | None:
        if not self.heads:
            return None
        return self.head_flag or f"--{self.name}-dir"


# options several modes read
TREE = ModeOption(
    "tree", "text", "Draft tree: preset name, JSON choices ('[[0],[0,0]]') or a .json/.yaml file.", metavar="TREE"
)
NUM_DRAFT_TOKENS = ModeOption(
    "num_draft_tokens",
    "int",
    "Draft tokens per step (n-gram: per candidate continuation, default 10; draft-target: the draft model's chain, "
    "default chosen by measured cost).",
    minimum=1,
)
MAX_DRAFT_LEN = ModeOption("max_draft_len", "int", "Maximum number of draft tokens per step.", minimum=1)
TYPICAL_ACCEPTANCE = ModeOption(
    "typical_acceptance",
    "pair",
    "LOSSY: typical acceptance instead of rejection sampling; NOT distribution-preserving, opt-in only (the engine "
    "is marked lossless: false).",
    metavar="EPS,ALPHA",
)
# the drafter of every mode whose step graph proposes the next tree itself
GRAPH_DRAFTER = "specbuild.runtime.drafter:GraphDrafter"

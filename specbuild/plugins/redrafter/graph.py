"""The ReDrafter mode's graph side: options, and the drafting of the next tree after acceptance.

After the step graph verified and accepted, the drafter's beam search runs from the last accepted node's final
hidden state with the bonus token as every beam's root; the beams are merged by shared prefix into one tree whose
nodes, ancestor mask, depths, root-to-leaf paths (one per beam) and node count are the graph's outputs. They are
padded to 1 + beams x draft length nodes; the runtime's drafter verifies the first `next_num_tokens` of them.
"""

from __future__ import annotations

from specbuild import engine_format as ef
from specbuild.builder.network.mode_plugin import DraftContext, ModePlugin, OutputSpec
from specbuild.errors import SpecbuildError
from specbuild.plugins.redrafter import DEFAULT_DRAFT_LEN, DEFAULT_NUM_BEAMS, TOP_K_WARP
from specbuild.plugins.redrafter.drafter_net import RecurrentDrafter, beam_search, beams_to_tree
from specbuild.tree import MAX_TREE_SIZE

HEAD_KEY = "redrafter"
MAX_DRAFT_LEN_PER_BEAM = 16  # one drafter pass per token is unrolled in the graph


class RedrafterPlugin(ModePlugin):
    name = "redrafter"
    head_key = HEAD_KEY
    selects_rows = True
    # the head's config, for the manifest: the drafter built from it holds what the trace reads
    # (builder/export/trace_cache.py)
    untraced_attributes = ("cfg",)

    def draft_outputs(self) -> list[OutputSpec]:
        n, beams, depth = self.max_new_tokens_per_step(), self.num_beams, self.draft_len + 1
        return [
            OutputSpec(ef.NEXT_INPUT_IDS, "int64", ("B", n)),
            OutputSpec(ef.NEXT_TREE_MASK, "bool", ("B", n, n)),
            OutputSpec(ef.NEXT_POSITION_OFFSETS, "int64", ("B", n)),
            OutputSpec(ef.NEXT_PATHS, "int64", ("B", beams, depth)),
            OutputSpec(ef.NEXT_NUM_TOKENS, "int64", ("B",)),
        ]

    @classmethod
    def check_options(cls, checkpoint, options) -> dict:
        cfg = checkpoint.heads.get(HEAD_KEY)
        if cfg is None:
            raise SpecbuildError(
                f"{checkpoint.path}: checkpoint holds no ReDrafter drafter; convert with `--redrafter-dir DIR`"
            )
        defaults = {
            "redrafter_num_beams": DEFAULT_NUM_BEAMS,
            "redrafter_draft_len_per_beam": DEFAULT_DRAFT_LEN,
            **cls.recorded_defaults(checkpoint, options),
        }

        def pick(key):
            value = getattr(options, key, None)
            return int(defaults[key] if value is None else value)

        beams, length = pick("redrafter_num_beams"), pick("redrafter_draft_len_per_beam")
        rows = int(cfg.get("draft_vocab_size") or checkpoint.model.vocab_size)
        high = min(TOP_K_WARP, rows)
        if not 1 <= beams <= high:
            raise SpecbuildError(
                f"--redrafter-num-beams {beams} must be between 1 and {high} (the drafter keeps the top {TOP_K_WARP} "
                f"of {rows} tokens per step)"
            )
        if not 1 <= length <= MAX_DRAFT_LEN_PER_BEAM:
            raise SpecbuildError(
                f"--redrafter-draft-len-per-beam {length} must be between 1 and {MAX_DRAFT_LEN_PER_BEAM}"
            )
        drafts = beams * length
        if drafts + 1 > MAX_TREE_SIZE:
            raise SpecbuildError(
                f"--redrafter-num-beams {beams} x --redrafter-draft-len-per-beam {length} = {drafts} draft tokens: "
                f"at most {MAX_TREE_SIZE - 1} per step"
            )
        max_draft = getattr(options, "max_draft_len", None)
        if max_draft is not None and drafts > max_draft:
            raise SpecbuildError(
                f"--redrafter-num-beams {beams} x --redrafter-draft-len-per-beam {length} = {drafts} draft tokens but "
                f"--max-draft-len is {max_draft}"
            )
        return {"num_beams": beams, "draft_len": length, "tokens_per_step": 1 + drafts}

    def __init__(self, checkpoint, net, settings):
        super().__init__()
        self.num_beams, self.draft_len = settings["num_beams"], settings["draft_len"]
        self.cfg = checkpoint.heads[HEAD_KEY]
        self.drafter = RecurrentDrafter.from_config(self.cfg, net.cfg.hidden_size, net.cfg.vocab_size, TOP_K_WARP)
        self.drafter.load(checkpoint.head_tensors(HEAD_KEY))
        self.drafter.to(net.embed_tokens.weight.dtype)

    def tree(self):
        return None  # each call's tree is a graph output

    def max_new_tokens_per_step(self) -> int:
        return 1 + self.num_beams * self.draft_len

    def draft(self, ctx: DraftContext) -> dict:
        ctx = ctx.drafting()
        b, _, hsize = ctx.hidden.shape
        context = ctx.hidden.gather(1, ctx.last_node.view(b, 1, 1).expand(b, 1, hsize)).squeeze(1)  # [B,H]
        beams = beam_search(self.drafter, context, ctx.bonus, ctx.net.embed_tokens, self.num_beams, self.draft_len)
        tree = beams_to_tree(beams)
        return {
            ef.NEXT_INPUT_IDS: tree["tokens"],
            ef.NEXT_TREE_MASK: tree["mask"],
            ef.NEXT_POSITION_OFFSETS: tree["offsets"],
            ef.NEXT_PATHS: tree["paths"],
            ef.NEXT_NUM_TOKENS: tree["count"],
        }

    def manifest(self) -> dict:
        return {
            "num_beams": self.num_beams,
            "draft_len_per_beam": self.draft_len,
            "top_k_warp": TOP_K_WARP,
            "exit_dim": int(self.cfg["exit_dim"]),
            "draft_layers": int(self.cfg["num_layers"]),
            "rnn": bool(self.cfg["rnn"]),
            "draft_vocab_size": self.cfg.get("draft_vocab_size"),
        }

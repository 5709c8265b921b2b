"""`--speculative-mode eagle`: EAGLE-1 (static `--tree`) and EAGLE-2 (dynamic top-k tree) drafting in the graph.

The draft network's KV for accepted positions is engine state (`state_draft_kv`, committed by the runtime
at the accepted nodes like the base cache); expansion happens inside the graph after acceptance.
"""

from __future__ import annotations

from specbuild.errors import SpecbuildError
from specbuild.plugins.base import DraftContext, ModePlugin, StateSpec
from specbuild.plugins.eagle_draft import DraftNet, commit_pass, expand_dynamic, expand_static
from specbuild.tree import Tree, parse_tree

# EAGLE-2 published defaults (EaModel evaluation scripts): total_token 60, depth 5, top_k 10
PUBLISHED_DEFAULTS = {"eagle_top_k": 10, "eagle_depth": 5, "eagle_total_tokens": 60}


class EaglePlugin(ModePlugin):
    name = "eagle"
    head_key = "eagle"

    def __init__(self, checkpoint, net, options):
        super().__init__()
        cfg = checkpoint.heads.get(self.head_key)
        if cfg is None:
            raise SpecbuildError(
                f"{checkpoint.path}: checkpoint holds no {self.head_key} heads; convert with "
                f"`--{self.head_key}-dir DIR`"
            )
        version = int(cfg.get("version", 3 if self.head_key == "eagle3" else 1))
        self.drafter = DraftNet(cfg, net.cfg, version)
        self.drafter.load(checkpoint.head_tensors(self.head_key))
        self.drafter.to(net.embed_tokens.weight.dtype)
        if version == 3:
            self.capture_layers = tuple(int(i) for i in cfg["capture_layers"])
        defaults = {**PUBLISHED_DEFAULTS, **(cfg.get("defaults") or {})}
        tree_spec = getattr(options, "tree", None) or defaults.get("tree")
        max_draft = getattr(options, "max_draft_len", None)
        self._tree = None
        explicit_dynamic = any(getattr(options, k, None) is not None for k in PUBLISHED_DEFAULTS)
        if getattr(options, "tree", None) is not None or (tree_spec is not None and not explicit_dynamic):
            tree = parse_tree(tree_spec)
            tree.check(max_draft_len=max_draft, source="--tree")
            self._tree = tree
            self.expansion = {"type": "static", "tree_size": tree.size}
        else:

            def pick(key):
                value = getattr(options, key, None)
                return int(defaults[key] if value is None else value)

            k, depth, total = pick("eagle_top_k"), pick("eagle_depth"), pick("eagle_total_tokens")
            vocab = self.drafter.draft_vocab or net.cfg.vocab_size
            if not 1 <= k <= min(vocab, 3839):
                raise SpecbuildError(f"--eagle-top-k {k} must be between 1 and {min(vocab, 3839)}")
            if depth < 1:
                raise SpecbuildError(f"--eagle-depth {depth} must be at least 1")
            candidates = k + (depth - 1) * k * k
            if not 2 <= total <= candidates + 1:
                raise SpecbuildError(
                    f"--eagle-total-tokens {total} must be between 2 and {candidates + 1} (top-k {k}, depth {depth} "
                    f"draft {candidates} candidates)"
                )
            if max_draft is not None and total - 1 > max_draft:
                raise SpecbuildError(
                    f"--eagle-total-tokens {total} gives {total - 1} draft nodes but --max-draft-len is {max_draft}"
                )
            self.top_k, self.depth, self.total_tokens = k, depth, total
            self.expansion = {"type": "dynamic", "top_k": k, "depth": depth, "total_tokens": total}

    def tree(self) -> Tree | None:
        return self._tree

    def max_new_tokens_per_step(self) -> int:
        return self._tree.size if self._tree is not None else self.total_tokens

    def state_specs(self) -> list[StateSpec]:
        c = self.drafter.c
        return [
            StateSpec(
                "draft_kv",
                (self.drafter.num_layers, 2, "B", c["num_kv_heads"], "C", c["head_dim"]),
                "float32",
                0.0,
                grow_axis=4,
            )
        ]

    def draft(self, ctx: DraftContext) -> dict:
        draft_kv = ctx.states["draft_kv"]
        h_all, new_kv = commit_pass(self.drafter, ctx, draft_kv)
        if self._tree is not None:
            out = expand_static(self.drafter, ctx, h_all, draft_kv, new_kv, self._tree)
        else:
            out = expand_dynamic(self.drafter, ctx, h_all, draft_kv, new_kv, self.top_k, self.depth, self.total_tokens)
        out["new_state_draft_kv"] = new_kv
        return out

    def manifest(self) -> dict:
        out = {
            "draft_version": self.drafter.version,
            "draft_layers": self.drafter.num_layers,
            "draft_vocab_size": self.drafter.draft_vocab,
            "expansion": self.expansion,
        }
        if self.drafter.version == 3:  # speculators/vLLM heads: the layer's residual is hidden_norm(x), not x
            out["draft_norm_before_residual"] = self.drafter.c["norm_before_residual"]
        return out

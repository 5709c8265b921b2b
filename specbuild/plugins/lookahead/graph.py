"""The lookahead mode's graph side: the step graph verifies the pool's guesses the runtime's drafter proposes
(tokens, mask, positions and paths are inputs, as for n-gram trees) and returns every row's argmax
(ef.ROW_TOP_TOKENS): the window's next level. The window rows lie on no path, so they are never accepted and their
KV is never committed. (W, N, G, L) are checked before any work and recorded in engine.yaml."""

from __future__ import annotations

from specbuild import engine_format as ef
from specbuild.builder.network.acceptance import top_token
from specbuild.builder.network.mode_plugin import DraftContext, HostDraftedPlugin, OutputSpec
from specbuild.errors import SpecbuildError
from specbuild.plugins.lookahead import (
    DEFAULT_GUESSES,
    DEFAULT_LOOKUP,
    DEFAULT_NGRAM,
    DEFAULT_POOL,
    DEFAULT_WINDOW,
    MAX_GUESSES,
    MAX_LOOKUP,
    MAX_NGRAM,
    MAX_WINDOW,
    POOLS,
    step_rows,
)
from specbuild.tree import MAX_TREE_SIZE


class LookaheadPlugin(HostDraftedPlugin):
    name = "lookahead"

    @classmethod
    def check_options(cls, checkpoint, options) -> dict:
        def pick(name, default, most):
            value = getattr(options, name, None)
            value = default if value is None else int(value)
            if value > most:
                flag = "--" + name.replace("_", "-")
                raise SpecbuildError(f"{flag} {value} is invalid: expected at most {most}")
            return value

        w = pick("lookahead_window", DEFAULT_WINDOW, MAX_WINDOW)
        n = pick("lookahead_ngram", DEFAULT_NGRAM, MAX_NGRAM)
        g = pick("lookahead_guesses", DEFAULT_GUESSES, MAX_GUESSES)
        lookup = pick("lookahead_lookup", DEFAULT_LOOKUP, MAX_LOOKUP)
        pool = getattr(options, "lookahead_pool", None) or DEFAULT_POOL
        if pool not in POOLS:
            raise SpecbuildError(f"--lookahead-pool must be one of {', '.join(POOLS)}, got {pool!r}")
        rows = step_rows(w, n, g, lookup)
        if rows > MAX_TREE_SIZE:
            raise SpecbuildError(
                f"--lookahead-window {w}, --lookahead-ngram {n}, --lookahead-guesses {g}, --lookahead-lookup {lookup} "
                f"verify {rows} tokens per step: at most {MAX_TREE_SIZE}"
            )
        return {"window": w, "ngram": n, "guesses": g, "lookup": lookup, "pool": pool, "tokens_per_step": rows}

    def draft_outputs(self) -> list[OutputSpec]:
        return [*super().draft_outputs(), OutputSpec(ef.ROW_TOP_TOKENS, "int64", ("B", "W"))]

    def draft(self, ctx: DraftContext) -> dict:
        return {**super().draft(ctx), ef.ROW_TOP_TOKENS: top_token(ctx.logits)}

    def manifest(self) -> dict:
        s = self.settings
        return {
            "drafter": {
                "window": s["window"],
                "ngram": s["ngram"],
                "guesses": s["guesses"],
                "lookup": s["lookup"],
                "pool": s["pool"],
            }
        }

"""`--speculative-mode lookahead`: lookahead decoding. The model drafts for itself: a Jacobi window of guesses of
future tokens is refined by every engine call, the n-grams it completes go to a pool keyed by their first token,
and the pool's n-grams that start with the current token are verified in the same call (Fu et al. 2024,
arXiv:2402.02057; github.com/hao-ai-lab/LookaheadDecoding, llama.cpp's examples/lookahead). No heads, no draft
model: the runtime's drafter builds each call's rows, the step graph verifies the pool's guesses and returns each
row's argmax (ef.ROW_TOP_TOKENS), from which the drafter advances the window."""

from specbuild.modes.spec import HOST_DRAFTED, ModeOption, ModeSpec

# the defaults, chosen by measured speed (scripts/sweep-drafting.py on fresh prompts, never the benchmark's): a
# verified row costs little beside a one-token step and the window's n-grams are rarely accepted, so the cheapest
# window (one column) wins, with the context's continuation (lookup, below) and the context's n-grams in the pool
# (the sweep's numbers: docs/benchmarks/design-measurements.md). engine.yaml records the built values.
DEFAULT_WINDOW = 1
DEFAULT_NGRAM = 3
DEFAULT_GUESSES = 1
# what feeds the n-gram pool besides the window: nothing (LADE's default), the prompt's n-grams (LADE's
# POOL_FROM_PROMPT), or the prompt's and every committed token's (the context so far)
POOLS = ("window", "prompt", "context")
DEFAULT_POOL = "context"
# L: tokens of the context's own continuation (prompt lookup: what followed the longest earlier match of the latest
# tokens, as many as matched, at most L) verified beside the pool's guesses; a call with such a continuation leaves
# the window out (it would cost more rows than it gives there: measured). 0: the window and the pool alone (LADE's).
DEFAULT_LOOKUP = 10
LOOKUP_NGRAM = 3  # the longest suffix looked up in the context (prompt lookup's default)
MAX_LOOKUP = 64
MAX_NGRAM = 16  # bounds checked before any work
MAX_WINDOW = 64
MAX_GUESSES = 64


def step_rows(window: int, ngram: int, guesses: int, lookup: int = 0) -> int:
    """Most tokens one call verifies at (W, N, G, L), the root included. Without the lookup: 1 + the window's (W - 1)
    + (N - 2) W cells + G guesses of N - 1 tokens (TensorRT-LLM's max_draft_len + 1); N = 1 is plain decoding. A call
    holds either the window or the lookup's continuation (at most L), never both."""
    if ngram <= 1:
        return 1 + lookup
    return 1 + max((window - 1) + (ngram - 2) * window, lookup) + guesses * (ngram - 1)


MODE = ModeSpec(
    name="lookahead",
    family=HOST_DRAFTED,
    summary="lookahead decoding: a Jacobi window drafts n-grams into a pool; matching ones are verified (no heads)",
    graph_plugin="specbuild.plugins.lookahead.graph:LookaheadPlugin",
    drafter="specbuild.plugins.lookahead.drafter:LookaheadDrafter",
    options=(
        ModeOption(
            "lookahead_window",
            "int",
            f"lookahead: W, columns of the Jacobi window (default {DEFAULT_WINDOW}, measured).",
            minimum=1,
        ),
        ModeOption(
            "lookahead_ngram",
            "int",
            f"lookahead: N, the n-gram size (window levels + 1; 1 = plain decoding; default {DEFAULT_NGRAM}).",
            minimum=1,
        ),
        ModeOption(
            "lookahead_guesses",
            "int",
            f"lookahead: G, pool n-grams verified per step (and kept per first token; default {DEFAULT_GUESSES}).",
            minimum=0,
        ),
        ModeOption(
            "lookahead_lookup",
            "int",
            "lookahead: L, tokens of the context's continuation of its longest earlier match of the latest tokens "
            f"verified with the pool's guesses; 0 = window and pool only (default {DEFAULT_LOOKUP}, measured).",
            minimum=0,
        ),
        ModeOption(
            "lookahead_pool",
            "text",
            "lookahead: what feeds the n-gram pool besides the window: 'window' (nothing), 'prompt' (the prompt's "
            f"n-grams), 'context' (the prompt's and the output's; default {DEFAULT_POOL}, measured).",
            metavar="|".join(POOLS),
        ),
    ),
)

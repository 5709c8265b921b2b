"""`--speculative-mode lookahead`: lookahead decoding. The model drafts for itself: a Jacobi window of guesses of
future tokens is refined by every engine call, the n-grams it completes go to a pool keyed by their first token,
and the pool's n-grams that start with the current token are verified in the same call
(../shared/reference/algorithms-and-formats.md §5, serving-batching-draft-lookahead.md §6). No heads, no draft
model: the runtime's drafter builds each call's rows, the step graph verifies the pool's guesses and returns each
row's argmax (ef.ROW_TOP_TOKENS), from which the drafter advances the window."""

from specbuild.plugins.spec import HOST_DRAFTED, ModeOption, ModeSpec

# the defaults, chosen by measured speed (SmolLM2-135M, 2 CPU threads, fp32, fresh prompts: never the benchmark's):
# every verified row costs ~9 % of a one-token step there, so the cheapest window (one column) with the context's
# n-grams in the pool was fastest -- W 1, N 3, G 2: 1.50x `none` on two mixed sets, 1.18x on chat; TensorRT-LLM's
# W 4, N 3, G 4 (LADE's window-only pool): 0.90x (docs/benchmarks/2026-11-27-run-U-lookahead.md). engine.yaml
# records the built values.
DEFAULT_WINDOW = 1
DEFAULT_NGRAM = 3
DEFAULT_GUESSES = 2
# what feeds the n-gram pool besides the window: nothing (LADE's default), the prompt's n-grams (LADE's
# POOL_FROM_PROMPT), or the prompt's and every committed token's (the context so far)
POOLS = ("window", "prompt", "context")
DEFAULT_POOL = "context"
MAX_NGRAM = 16  # bounds checked before any work
MAX_WINDOW = 64
MAX_GUESSES = 64


def step_rows(window: int, ngram: int, guesses: int) -> int:
    """Tokens one call verifies at (W, N, G), the root included: 1 + the window's (W - 1) + (N - 2) W cells + G guesses
    of N - 1 tokens (TensorRT-LLM's max_draft_len + 1); N = 1 is plain decoding."""
    if ngram <= 1:
        return 1
    return 1 + (window - 1) + (ngram - 2) * window + guesses * (ngram - 1)


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
            "lookahead_pool",
            "text",
            "lookahead: what feeds the n-gram pool besides the window: 'window' (nothing), 'prompt' (the prompt's "
            f"n-grams), 'context' (the prompt's and the output's; default {DEFAULT_POOL}, measured).",
            metavar="|".join(POOLS),
        ),
    ),
)

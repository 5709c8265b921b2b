"""`--speculative-mode ngram`: prompt lookup decoding. The runtime drafts from n-grams of the prompt and the
generated text; the step graph only verifies (any base model, no heads)."""

from specbuild.modes.spec import HOST_DRAFTED, MAX_DRAFT_LEN, NUM_DRAFT_TOKENS, ModeOption, ModeSpec

DEFAULT_MAX_NGRAM_SIZE = 3  # prompt lookup decoding's defaults (github.com/apoorvumang/prompt-lookup-decoding)
DEFAULT_NUM_DRAFT_TOKENS = 10
DEFAULT_CANDIDATES = 1
DEFAULT_DRAFT_LENGTH = "match"
DRAFT_LENGTHS = ("match", "fixed")  # mode.drafter.draft_length / --ngram-draft-length

MODE = ModeSpec(
    name="ngram",
    family=HOST_DRAFTED,
    summary="prompt lookup decoding: drafts continue the longest earlier match of the latest tokens (no heads)",
    graph_plugin="specbuild.plugins.ngram.graph:NgramPlugin",
    drafter="specbuild.plugins.ngram.drafter:NgramDrafter",
    options=(
        ModeOption(
            "max_ngram_size",
            "int",
            f"n-gram: longest suffix matched against the context (default {DEFAULT_MAX_NGRAM_SIZE}).",
            minimum=1,
        ),
        NUM_DRAFT_TOKENS,
        ModeOption(
            "ngram_candidates",
            "int",
            f"n-gram: continuations verified together as one tree (default {DEFAULT_CANDIDATES} = one chain).",
            minimum=1,
        ),
        ModeOption(
            "ngram_draft_length",
            "text",
            "n-gram: 'match' drafts as many tokens as the context matched the earlier occurrence (at most "
            "--num-draft-tokens; the default) or 'fixed' always --num-draft-tokens.",
            metavar="match|fixed",
        ),
        MAX_DRAFT_LEN,
    ),
)

"""`--speculative-mode suffix`: suffix decoding (SuffixDecoding, arXiv 2411.04975). The runtime drafts trees from the
runs of tokens that followed the latest ones before: in the request's own prompt and output, and in a pool of the
responses the engine gave before (shared by the requests of one process, or one API key in `serve`, bounded in
memory, oldest responses evicted first); the step graph only verifies (any base model, no heads)."""

from specbuild.modes.spec import HOST_DRAFTED, MAX_DRAFT_LEN, NUM_DRAFT_TOKENS, ModeOption, ModeSpec

DEFAULT_DEPTH = 24  # runs of at most this many tokens are counted (vLLM's suffix_decoding_max_tree_depth)
DEFAULT_NUM_DRAFT_TOKENS = 16  # at most this many drafts a step (vLLM's and Arctic's 16-32)
DEFAULT_MIN_PROB = 0.1  # a draft token at least this probable (suffix_decoding_min_token_prob)
DEFAULT_SPEC_FACTOR = 1.0  # at most factor x match length drafts (suffix_decoding_max_spec_factor)
DEFAULT_SHAPE = "tree"
SHAPES = ("tree", "chain")  # best-first over every continuation, or the most probable child only
DEFAULT_POOL_NODES = 1_000_000  # the pool's bound: trie nodes and tokens, oldest responses evicted first

MODE = ModeSpec(
    name="suffix",
    family=HOST_DRAFTED,
    summary="suffix decoding: trees of what followed the latest tokens in the request and in earlier responses "
    "(no heads)",
    graph_plugin="specbuild.plugins.suffix.graph:SuffixPlugin",
    drafter="specbuild.plugins.suffix.drafter:SuffixDrafter",
    options=(
        NUM_DRAFT_TOKENS,
        ModeOption(
            "suffix_depth",
            "int",
            f"suffix: longest run of tokens counted and matched (default {DEFAULT_DEPTH}).",
            minimum=2,
        ),
        ModeOption(
            "suffix_min_prob",
            "float",
            f"suffix: least probability of a drafted token, estimated from counts (default {DEFAULT_MIN_PROB}).",
        ),
        ModeOption(
            "suffix_spec_factor",
            "float",
            f"suffix: at most this factor x the match length drafts a step (default {DEFAULT_SPEC_FACTOR}).",
        ),
        ModeOption(
            "suffix_shape",
            "text",
            "suffix: 'tree' (every probable continuation, best first; the default) or 'chain' (the most probable one).",
            metavar="tree|chain",
        ),
        ModeOption(
            "suffix_pool_nodes",
            "int",
            f"suffix: the pool of earlier responses holds at most this many trie nodes and response tokens (default "
            f"{DEFAULT_POOL_NODES:,}: 59 MB at most; 0: no pool, the request's own tokens only).",
            minimum=0,
        ),
        MAX_DRAFT_LEN,
    ),
)

"""`--speculative-mode recycle`: token recycling (Luo et al. 2024, arXiv:2408.08696). Every verification call
already computes, for each token it verifies, the model's next-token distribution; the graph returns each row's top
K candidates (ef.ROW_TOP_K), the runtime keeps them in a table of K candidates per vocabulary entry (the latest
call's, a few MB) and drafts each step's tree from it: a static tree of candidate ranks (which candidate of its
parent's token each node takes). No heads, no draft model, any base model; the table is shared by the requests of
one process (of one API key in `serve`) and warms as they run. Where the latest tokens occurred before in the
request, what followed them there is grafted onto the tree (prompt lookup), so copies are drafted too."""

from heapq import heappop, heappush

from specbuild.modes.spec import HOST_DRAFTED, MAX_DRAFT_LEN, NUM_DRAFT_TOKENS, ModeOption, ModeSpec

DEFAULT_NUM_DRAFT_TOKENS = 10  # nodes of the static tree besides the root (the paper's 80 is a GPU's; measured)
DEFAULT_TOP_K = 8  # candidates kept per token (the paper's k)
DEFAULT_DEPTH = 8  # the tree's deepest node
MAX_TOP_K = 64
# what a token's candidates are keyed by: the token alone (the paper's table), or also the token before it, where
# that pair was verified before (a hash of PAIR_SLOTS slots beside the table; the token's candidates otherwise)
CONTEXTS = ("token", "pair")
DEFAULT_CONTEXT = "pair"  # measured: more tokens accepted a step at the same tree (docs/modes.md)
PAIR_SLOTS = 1 << 18  # 262,144 pairs: 10 MB at K = 8
# each step the continuation of the context's longest earlier match of its latest tokens (prompt lookup) is grafted
# onto the tree, as many tokens as the match is long up to --recycle-copy (default: the tree's nodes; 0: none), the
# match found among the suffixes of up to COPY_NGRAM tokens (prompt lookup's default)
COPY_NGRAM = 3
# how likely the rank-r candidate of a token is the next one, given that token was: the static tree is the
# num_draft_tokens choices of highest product along their path (measured on fresh HumanEval and MT-Bench prompts
# with SmolLM2-135M-Instruct: docs/modes.md); ranks past the profile share its last value
RANK_PROFILE = (0.45, 0.095, 0.05, 0.03, 0.027, 0.025, 0.011, 0.008)

MODE = ModeSpec(
    name="recycle",
    family=HOST_DRAFTED,
    summary="token recycling: a static tree drafted from the model's own top-k candidates of earlier steps (no heads)",
    graph_plugin="specbuild.plugins.recycle.graph:RecyclePlugin",
    drafter="specbuild.plugins.recycle.drafter:RecycleDrafter",
    options=(
        NUM_DRAFT_TOKENS,
        ModeOption(
            "recycle_top_k",
            "int",
            f"recycle: candidates kept per token, the tree's widest branching (default {DEFAULT_TOP_K}).",
            minimum=1,
        ),
        ModeOption(
            "recycle_context",
            "text",
            f"recycle: a token's candidates keyed by the token ('token') or also by the one before it where that pair "
            f"was seen ('pair'; default {DEFAULT_CONTEXT}).",
            metavar="token|pair",
        ),
        ModeOption(
            "recycle_depth",
            "int",
            f"recycle: the static tree's greatest depth (default {DEFAULT_DEPTH}).",
            minimum=1,
        ),
        ModeOption(
            "recycle_copy",
            "int",
            "recycle: graft the continuation of the latest tokens' earlier match in the prompt and output (prompt "
            "lookup), up to this many tokens, onto each tree (default: --num-draft-tokens; 0: the table's tree alone).",
            minimum=0,
        ),
        MAX_DRAFT_LEN,
    ),
)


def static_tree(num_draft: int, top_k: int, depth: int) -> list[tuple[int, ...]]:
    """The `num_draft` choices (rank paths) of highest expected acceptance under RANK_PROFILE, best first, at most
    `top_k` wide and `depth` deep: a prefix-closed tree, grown lazily (a node's value bounds its children's and its
    later siblings')."""

    def rank_p(r):
        return RANK_PROFILE[min(r, len(RANK_PROFILE) - 1)]

    heap = [(-rank_p(0), (0,))]
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_draft:
        negative, choice = heappop(heap)
        chosen.append(choice)
        value = -negative
        if len(choice) < depth:
            heappush(heap, (-value * rank_p(0), (*choice, 0)))
        if choice[-1] + 1 < top_k:
            sibling = value / rank_p(choice[-1]) * rank_p(choice[-1] + 1)
            heappush(heap, (-sibling, (*choice[:-1], choice[-1] + 1)))
    return chosen

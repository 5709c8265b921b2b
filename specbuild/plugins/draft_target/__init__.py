"""`--speculative-mode draft-target`: a small draft model with the target's tokenizer proposes a chain of tokens
from its own graph and KV cache (a second graph in the engine directory, role `draft`), or a top-k tree along that
chain (--draft-top-k); the target graph verifies it as it verifies every mode's drafts: a draft is accepted when it
is the target's own draw at its position (greedy: its argmax), sampled drafts being drawn with the target's number
for that position so that they often are (runtime/sampling.position_uniforms)."""

from specbuild.modes.spec import HOST_DRAFTED, NUM_DRAFT_TOKENS, ModeOption, ModeSpec

DRAFT_ENGINE_DIR = "draft"  # the draft's own engine directory, inside the engine directory
DRAFT_VOCAB_FILE = "draft_vocab.json"  # optional beside a draft model: {"token_ids": [...]} most frequent first
DRAFT_VOCAB_TENSOR = "specbuild.draft_vocab"  # the list in the checkpoint's heads/draft-target.safetensors
# a draft model dir whose config.json has {"specbuild": {"embeddings": "target"}} ships without its embedding
# (model.embed_tokens.weight): convert takes the target's (the shipped SmolLM2 draft does this to stay small)
EMBEDDINGS_FROM_TARGET = "target"

MODE = ModeSpec(
    name="draft-target",
    family=HOST_DRAFTED,
    summary="draft-target speculation: a small draft model with the same tokenizer proposes a chain (no heads)",
    graph_plugin="specbuild.plugins.draft_target.graph:DraftTargetPlugin",
    drafter="specbuild.plugins.draft_target.drafter:DraftModelDrafter",
    options=(
        NUM_DRAFT_TOKENS,
        ModeOption(
            "draft_depth",
            "int",
            "draft-target: the draft's chain length, i.e. draft model calls per step (the same as --num-draft-tokens "
            "for a chain; default: the measured choice recorded with the draft).",
            minimum=1,
        ),
        ModeOption(
            "draft_top_k",
            "int",
            "draft-target: a top-k tree: at each depth of the chain the draft's K most likely tokens (sampled: its "
            "draw and the K - 1 tokens next to it in the draft's CDF) are verified, the chain going on from the "
            "first (1 + K x depth tokens a step; default: the measured choice recorded with the draft, else 1 = a "
            "chain).",
            minimum=1,
        ),
        ModeOption(
            "draft_weights",
            "text",
            "draft-target: the draft graph's weights (fp32, fp16, int8, int4; int8/int4 run with int8 activations: "
            "the draft's roundings never change the output; default: the measured choice recorded with the draft, "
            "else the target's --weights).",
            metavar="fp32|fp16|int8|int4",
        ),
        ModeOption(
            "draft_vocab_size",
            "int",
            "draft-target: the draft projects onto its N most frequent tokens (the draft model's draft_vocab.json) "
            "instead of the whole vocabulary; the target draws every token, so the output is unchanged (default: the "
            "measured choice recorded with the draft, else the whole vocabulary).",
            minimum=1,
        ),
    ),
    heads="Draft model directory: a Hugging Face Llama checkpoint with the target's tokenizer (draft-target).",
    head_flag="--draft-model-dir",
    shipped_name="draft",
    hf_assistant="specbuild.plugins.draft_target.convert:load_hf_assistant",
    converter="specbuild.plugins.draft_target.convert:convert_draft_model",
    trainer="specbuild.plugins.draft_target.training:run_draft_recipe",
)

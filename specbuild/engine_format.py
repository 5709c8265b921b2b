"""Names and versions of the on-disk formats: canonical checkpoint and engine directory (docs/engine-format.md)."""

CHECKPOINT_FORMAT = "specbuild-checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
ENGINE_FORMAT = "specbuild-engine"
ENGINE_FORMAT_VERSION = 2  # 2: engine.yaml lists graphs (role, backend, file, KV layout, weights, I/O)

CHECKPOINT_CONFIG = "config.yaml"
CHECKPOINT_WEIGHTS = "model.safetensors"
HEADS_DIR = "heads"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
ENGINE_MANIFEST = "engine.yaml"
ENGINE_ONNX = "model.onnx"  # the portable standard-op graph (TensorRT parses it; ONNX Runtime runs it too)
ENGINE_WEIGHTS = "weights.bin"  # the tensors of every graph, each distinct byte string once (weights_file)
ENGINE_ORT_ONNX = "model.ort.onnx"  # the ONNX Runtime graph (its fused CPU kernels)
ENGINE_PLAN = "model.plan"

# Graph roles and backends (engine.yaml `graphs`), and how a graph holds the KV cache:
#   stacked: kv_cache input [L,2,B,Hkv,C,D] read-only, new_kv output [L,2,B,Hkv,T,D]; the runtime appends accepted
#   shared:  past_key_i / past_value_i [B,Hkv,C,D] per layer, bound to present_key_i / present_value_i (the graph
#            writes the T new tokens at [past_length, past_length + T)); the runtime moves accepted nodes down
ROLE_TARGET = "target"
ROLE_DRAFT = "draft"  # a draft model's graph (draft-target): its own engine directory inside the engine's
BACKEND_ONNXRUNTIME = "onnxruntime"
BACKEND_TENSORRT = "tensorrt"
BACKENDS = (BACKEND_ONNXRUNTIME, BACKEND_TENSORRT)
KV_STACKED = "stacked"
KV_SHARED = "shared"
WEIGHTS = ("fp32", "fp16", "int8", "int4")
BLOCKWISE_WEIGHTS = ("int8", "int4")  # MatMulNBits blocks in the ONNX Runtime graph
BLOCKWISE_BITS = {"int8": 8, "int4": 4}  # bits per weight of each
# weights only the onnxruntime graph takes (TensorRT's ONNX parser takes blockwise weights in int4 only; int8 with int8
# activations is ONNX Runtime's integer GEMM): a build of them with the tensorrt backend is refused
ONNXRUNTIME_ONLY_WEIGHTS = ("int8",)
# graphs[].kv_cache_dtype: the KV cache's element type in the fused graph (int8: scaled per layer,
# builder/quantize/kv_int8.py; float: the engine's dtype, also where the field is absent)
GRAPH_KV_CACHE_DTYPE = "kv_cache_dtype"
# engine.yaml: true where `lossless` rests on specbuild's ordered attention (runtime/kernels): branching trees with
# int8 activations; without it such an engine runs only labelled lossy (runtime/exactness.py)
NEEDS_ORDERED_ATTENTION = "needs_ordered_attention"
KV_CACHE_FLOAT, KV_CACHE_INT8 = "float", "int8"
KV_CACHE_DTYPES = (KV_CACHE_FLOAT, KV_CACHE_INT8)
# --head-weights: the heads' own matmuls stay float, or become blockwise (int8 activations) in the onnxruntime graph
FLOAT_HEADS = "float"
HEAD_WEIGHTS = (FLOAT_HEADS, *BLOCKWISE_WEIGHTS)

# Step-graph I/O (stable names; recorded in engine.yaml).
BATCH = "num_sequences"  # the B dimension: sequences advanced by one call (each with its own length, tree and KV slot)
MAX_BATCH_SIZE = 256  # the largest --max-batch-size a graph is exported for
INPUT_IDS = "input_ids"  # [B,T] int64
POSITION_IDS = "position_ids"  # [B,T] int64
TREE_MASK = "tree_mask"  # [B,T,T] bool
PAST_LENGTH = "past_length"  # [B] int64
KV_CACHE = "kv_cache"  # [L,2,B,Hkv,C,D] float
PATHS = "paths"  # [B,NP,DP] int64, -1 padded
TEMPERATURE = "temperature"  # [B] float32, 0 = greedy
MIN_TEMPERATURE = 1e-5  # smallest sampling temperature: the graph divides by max(temperature, 1e-5)
TOP_K = "top_k"  # [B] int64, 0 = off
MAX_TOP_K = 2048  # top-k and the top-p nucleus work over the 2048 most likely tokens (a constant-K TopK)
TOP_P = "top_p"  # [B] float32, 1 = off
RAND_ACCEPT = "rand_accept"  # [B,W] float32 uniform [0,1): one draw per verified node
# W, the dimension WINDOW of rand_accept: the graph verifies the last W of the T new tokens (they alone get logits and
# acceptance): the whole tree in decode, the last prompt token in prefill. The runtime chooses W by this input's shape.
WINDOW = "window"
UNIFORMS_PER_POSITION = "by_position"  # engine.yaml sampling.uniforms: rand_accept[b, i] is position_ids[b, i] + 1's
RAND_SAMPLE = "rand_sample"  # [B] float32 uniform [0,1): the bonus/residual draw
# [M] bool, values unused (int8-activation ONNX Runtime graphs): every row-wise kernel of the call sees at least M
# rows (copies of the last token pad a shorter call); M chosen at load by runtime/row_invariance.py
MIN_ROWS = "min_rows"
# [R] int64: the rows (sequences) whose next tree the graph drafts, in order; the next-tree outputs (NEXT_*) have R
# rows, the i-th being row DRAFT_ROWS[i]'s. Empty: the call only verifies, and an engine-drafted mode skips its
# drafting (what plain decoding under load needs; the draft network's state is still committed for every row).
# Graphs of modes that draft in the graph have it; the dimension is named DRAFTED.
DRAFT_ROWS = "draft_rows"
# [B,W,V] float32, in draft-target graphs built before sampled drafts were coupled to the target's draws (2026-12-06):
# the q each verified node was drawn from, accepted with min(1, p(x)/q(x)). Today's graphs have no such input; the
# runtime feeds an older graph zeros and gives its sampled requests no drafts (plugins/draft_target/drafter.py)
DRAFT_PROBS = "draft_probs"
# [B] bool (engines of a LongRoPE model built past original_max_position_embeddings): the row rotates with the long
# factors. A sequence longer than that length is rotated with them at every position, its cache recomputed once when
# it grows past it (runtime/scheduler.py), as transformers' Phi-3 does; engine.yaml's ROPE_SWITCH holds the length
ROPE_LONG = "rope_long"
ROPE_SWITCH = "rope_switch"
DRAFTED = "drafted_sequences"

ACCEPTED_TOKENS = "accepted_tokens"  # [B,DP] int64
NUM_ACCEPTED = "num_accepted"  # [B] int64 (accepted drafts + bonus)
ACCEPTED_NODES = "accepted_nodes"  # [B,DP] int64 (which new tokens' KV to keep, in order)
NEW_KV = "new_kv"  # [L,2,B,Hkv,T,D]
# The ONNX Runtime graph's KV cache: one buffer per layer and kind, [B,Hkv,C,D], bound as both the past input and
# the present output (written in place at [past_length, past_length + T); the runtime compacts accepted nodes).
PAST_KEY = "past_key_{}"
PAST_VALUE = "past_value_{}"
PRESENT_KEY = "present_key_{}"
PRESENT_VALUE = "present_value_{}"
NEXT_INPUT_IDS = "next_input_ids"  # [B,N] int64: root (bonus) token + next draft tree
# dynamic trees (the graph drafts the tree's shape too): the next call's tree, as Proposal takes it
NEXT_TREE_MASK = "next_tree_mask"  # [B,N,N] bool
NEXT_POSITION_OFFSETS = "next_position_offsets"  # [B,N] int64 (depth of each node)
NEXT_PATHS = "next_paths"  # [B,NP,DP] int64, -1 padded
# [B,W] int64: each window row's most likely next token (its logits' argmax), for drafters that iterate guesses of
# future tokens through the graph (a Jacobi window): the rows are not accepted, only read
ROW_TOP_TOKENS = "row_top_tokens"
# [B,W,K] int64: each window row's K most likely next tokens, most likely first (token recycling's candidates)
ROW_TOP_K = "row_top_k"
NEXT_NUM_TOKENS = "next_num_tokens"  # [B] int64: how many of the N next tokens are real (the rest is padding)
LOGITS = "logits"  # optional [B,T,V]

# MatMulNBits accuracy levels of quantized graphs (engine.yaml graphs[].quantization.accuracy_level): float32
# activations, or activations quantized to int8 inside the kernel (--int8-activations)
ACCURACY_FLOAT32 = 1
ACCURACY_INT8 = 4

# Graph file metadata (ONNX metadata_props, values are strings): what a graph can do, inside the hashed file itself
GRAPH_MAX_POSITIONS = "specbuild.max_positions"  # positions the graph can address (rotary tables / the model)

# Mode state (plugins' StateSpec): input "state_<name>"; the output is either the whole next value
# "next_state_<name>" or, for a state that grows like the KV cache (grow_axis), the rows of this call's T new tokens
# "new_state_<name>", of which the runtime appends the accepted nodes' rows.
STATE_PREFIX = "state_"
NEXT_STATE_PREFIX = "next_state_"
NEW_STATE_PREFIX = "new_state_"

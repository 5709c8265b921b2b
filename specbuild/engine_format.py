"""Names and versions of the on-disk formats: canonical checkpoint and engine directory (see DESIGN.md)."""

CHECKPOINT_FORMAT = "specbuild-checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
ENGINE_FORMAT = "specbuild-engine"
ENGINE_FORMAT_VERSION = 1

CHECKPOINT_CONFIG = "config.yaml"
CHECKPOINT_WEIGHTS = "model.safetensors"
HEADS_DIR = "heads"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
ENGINE_MANIFEST = "engine.yaml"
ENGINE_ONNX = "model.onnx"
ENGINE_ONNX_DATA = "model.onnx.data"
ENGINE_PLAN = "model.plan"

# Step-graph I/O (stable names; recorded in engine.yaml).
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
RAND_ACCEPT = "rand_accept"  # [B,T] float32 uniform [0,1): one draw per tree node
RAND_SAMPLE = "rand_sample"  # [B] float32 uniform [0,1): the bonus/residual draw

ACCEPTED_TOKENS = "accepted_tokens"  # [B,DP] int64
NUM_ACCEPTED = "num_accepted"  # [B] int64 (accepted drafts + bonus)
ACCEPTED_NODES = "accepted_nodes"  # [B,DP] int64 (which new tokens' KV to keep, in order)
NEW_KV = "new_kv"  # [L,2,B,Hkv,T,D]
NEXT_INPUT_IDS = "next_input_ids"  # [B,N] int64: root (bonus) token + next draft tree
LOGITS = "logits"  # optional [B,T,V]

STATE_PREFIX = "state_"  # mode state inputs; outputs are "next_" + input name

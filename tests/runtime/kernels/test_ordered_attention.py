"""OrderedAttention (runtime/kernels): close to a float64 numpy reference and to ONNX Runtime's GroupQueryAttention
on every kind of call the engines make (causal chains, trees with a bias and positions, sliding windows, softcap and
scale, float and int8 caches), the new keys and values written bit for bit as the reference writes them; a tree node
gets the bits one-token decoding gives the same token, whatever cache columns its keys sit in and whatever the call's
other rows and sequences; every instruction-set path gives the same bits; the rewrite takes the engines' attention
nodes and nothing it cannot compute."""

from __future__ import annotations

import hashlib

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from specbuild.runtime import kernels
from specbuild.runtime.kernels.rewrite import DOMAIN, use_kernels
from tests.runtime.kernels.reference import attention_feeds, attention_model, attention_reference, on_isa

CAPACITY, POSITIONS = 160, 176  # a cache past 64 columns: several blocks of the value pass
K_SCALE, V_SCALE = 0.05, 0.04
# (name, heads, kv_heads, head_dim, options of attention_model)
CASES = [
    ("chain", 4, 2, 64, {}),
    ("smollm2 group of 3", 9, 3, 64, {}),
    ("window", 4, 2, 32, dict(window=5)),
    ("softcap and scale", 4, 1, 32, dict(softcap=5.0, scale=0.3)),
    ("int8 cache", 4, 2, 64, dict(int8=True)),
    ("tree", 4, 2, 64, dict(positions=True, bias=True)),
    ("int8 tree", 9, 3, 64, dict(int8=True, positions=True, bias=True)),
    ("tree in a window", 4, 2, 32, dict(positions=True, bias=True, bias_window=4)),  # the window in the bias
]
# a tree of 5 nodes after the cache: node -> parent (-1: the root's parent is the cache)
PARENTS = [-1, 0, 0, 2, 1]


def _model(heads: int, kv_heads: int, dim: int, kernel: bool, options: dict):
    return attention_model(heads, kv_heads, dim, kernel, **{k: v for k, v in options.items() if k != "bias_window"})


def _session(model, kernel: bool = True):
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 2, 3
    if kernel:
        kernels.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _tables(dim: int):
    angles = np.random.default_rng(7).uniform(0, 6.3, size=(POSITIONS, dim // 2)).astype(np.float32)
    return np.cos(angles), np.sin(angles)


def _cache(rng, batch: int, kv_heads: int, dim: int, int8: bool):
    k, v = rng.standard_normal((2, batch, kv_heads, CAPACITY, dim)).astype(np.float32)
    if int8:
        return (np.clip(np.rint(x / s), -128, 127).astype(np.int8) for x, s in ((k, K_SCALE), (v, V_SCALE)))
    return k, v


def _ancestors(node: int) -> list[int]:
    chain = []
    while node >= 0:
        chain.append(node)
        node = PARENTS[node]
    return chain[::-1]


def _tree_inputs(past: np.ndarray, tokens: int, window: int = -1):
    """position_ids [B, T] and the additive bias [B, 1, T, C] of PARENTS (a chain where tokens != len(PARENTS))."""
    batch = len(past)
    parents = PARENTS if tokens == len(PARENTS) else list(range(-1, tokens - 1))
    depth = [len(_ancestors(n)) - 1 if parents is PARENTS else n for n in range(tokens)]
    positions = past[:, None] + np.asarray(depth)[None, :]
    bias = np.full((batch, 1, tokens, CAPACITY), -np.inf, np.float32)
    for b in range(batch):
        for node in range(tokens):
            seen = list(range(past[b])) + [
                past[b] + a for a in (_ancestors(node) if parents is PARENTS else range(node + 1))
            ]
            seen = [
                j
                for j in seen
                if window <= 0 or (j if j < past[b] else positions[b, j - past[b]]) > positions[b, node] - window
            ]
            bias[b, 0, node, seen] = 0.0
    return positions, bias


def _case_feeds(case, seed: int = 0):
    name, heads, kv_heads, dim, options = case
    rng = np.random.default_rng(seed)
    past = np.array([9, 0, 137])
    tokens = len(PARENTS)
    qkv = rng.standard_normal((len(past), tokens, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    pk, pv = _cache(rng, len(past), kv_heads, dim, options.get("int8", False))
    window = options.get("bias_window", -1)
    positions, bias = _tree_inputs(past, tokens, window) if options.get("bias") else (None, None)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if options.get("int8") else {}
    return attention_feeds(qkv, pk, pv, past, *_tables(dim), positions, bias, **scales)


@pytest.fixture(scope="module")
def library():
    if kernels.library() is None:
        pytest.skip(kernels.description())
    return kernels.library()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_it_computes_attention_as_the_reference_and_onnx_runtime_do(library, case):
    name, heads, kv_heads, dim, options = case
    feeds = _case_feeds(case)
    ours = _session(_model(heads, kv_heads, dim, True, options)).run(None, feeds)
    stock = _session(_model(heads, kv_heads, dim, False, options), kernel=False).run(None, feeds)
    attrs = {k: options[k] for k in ("window", "softcap", "scale") if k in options}
    out, keys, values = attention_reference(feeds, heads, kv_heads, **attrs)
    np.testing.assert_allclose(ours[0], out, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(stock[0], out, rtol=1e-5, atol=2e-6)  # the reference is GroupQueryAttention's contract
    assert np.array_equal(ours[1], keys) and np.array_equal(ours[2], values)  # rotated, quantized: bit for bit
    past = feeds["seqlens_k"] + 1 - feeds["qkv"].shape[1]
    for b, end in enumerate(past + feeds["qkv"].shape[1]):  # the stock kernel's new keys: within a rounding
        tol = 1 if options.get("int8") else 1e-6
        assert np.abs(stock[1][b, :, :end].astype(np.float32) - keys[b, :, :end].astype(np.float32)).max() <= tol


def _decoded(session, feeds_of, qkv_rows, pk, pv, past: int, pad: bool):
    """Outputs of one-token decoding of qkv_rows [n, W] after `past` cached tokens (each step a call of its own,
    padded to 2 rows by a copy of the token as the engines' attention padding does, or alone)."""
    outs = []
    for row in qkv_rows:
        step = np.stack([row, row])[None] if pad else row[None, None]
        out, pk, pv = session.run(None, feeds_of(step, pk, pv, np.array([past])))
        outs.append(out[0, 0])
        past += 1
    return np.stack(outs)


@pytest.mark.parametrize("int8", [False, True], ids=["float cache", "int8 cache"])
def test_a_tree_node_gets_the_bits_decoding_gives_its_token(library, int8):
    heads, kv_heads, dim = 9, 3, 64
    rng = np.random.default_rng(3)
    cos, sin = _tables(dim)
    past = 13
    pk, pv = _cache(rng, 1, kv_heads, dim, int8)
    qkv = rng.standard_normal((1, len(PARENTS), (heads + 2 * kv_heads) * dim)).astype(np.float32)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if int8 else {}
    tree = _session(attention_model(heads, kv_heads, dim, True, int8=int8, positions=True, bias=True))
    chain = _session(attention_model(heads, kv_heads, dim, True, int8=int8))
    positions, bias = _tree_inputs(np.array([past]), len(PARENTS))
    tree_out = tree.run(None, attention_feeds(qkv, pk, pv, [past], cos, sin, positions, bias, **scales))[0]

    def feeds_of(step, k, v, at):
        return attention_feeds(step, k, v, at, cos, sin, **scales)

    for leaf in (3, 4):  # each root-to-leaf path decoded token by token, padded or not, and verified as one chain
        path = _ancestors(leaf)
        for pad in (False, True):
            decoded = _decoded(chain, feeds_of, qkv[0, path], pk, pv, past, pad)
            assert np.array_equal(decoded, tree_out[0, path]), (leaf, pad)
        verified = chain.run(None, feeds_of(qkv[:, path], pk, pv, np.array([past])))[0]
        assert np.array_equal(verified[0], tree_out[0, path]), leaf


def test_a_sequence_gets_the_same_bits_alone_and_batched(library):
    case = CASES[-2]  # the int8 tree
    _, heads, kv_heads, dim, options = case
    feeds = _case_feeds(case, seed=5)
    session = _session(_model(heads, kv_heads, dim, True, options))
    together = session.run(None, feeds)
    for b in range(feeds["qkv"].shape[0]):
        shared = ("cos", "sin", "k_scale", "v_scale", "total")
        alone = session.run(None, {k: v if k in shared else v[b : b + 1] for k, v in feeds.items()})
        for got, want in zip(alone, together):
            assert np.array_equal(got[0], want[b]), b


def _digests_on(isa: str) -> dict:
    """sha256 of every case's outputs in a process whose kernels run on `isa` (fixed when the library loads)."""
    code = (
        "import hashlib, json\n"
        "from tests.runtime.kernels.test_ordered_attention import CASES, _case_feeds, _model, _session\n"
        "from specbuild.runtime import kernels\n"
        "out = {}\n"
        "for case in CASES:\n"
        "    name, heads, kv_heads, dim, options = case\n"
        "    got = _session(_model(heads, kv_heads, dim, True, options)).run(None, _case_feeds(case))\n"
        "    out[name] = [hashlib.sha256(x.tobytes()).hexdigest() for x in got]\n"
        "print(json.dumps({'isa': kernels.description(), 'out': out}))\n"
    )
    return on_isa(code, isa)


def test_every_instruction_set_gives_the_same_bits(library):
    here = {}
    for case in CASES:
        name, heads, kv_heads, dim, options = case
        got = _session(_model(heads, kv_heads, dim, True, options)).run(None, _case_feeds(case))
        here[name] = [hashlib.sha256(x.tobytes()).hexdigest() for x in got]
    scalar = _digests_on("scalar")
    assert scalar["isa"] == "specbuild kernels (scalar)" and scalar["out"] == here
    assert _digests_on("avx2")["out"] == here


def test_the_rewrite_takes_the_attention_it_computes_and_nothing_else(library):
    def gqa(inputs, **attrs):
        return helper.make_node("GroupQueryAttention", inputs, ["o", "k", "v"], domain="com.microsoft", **attrs)

    base = ["qkv", "", "", "pk", "pv", "sk", "tot", "cos", "sin"]
    int8 = dict(kv_cache_bit_width=8, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR")
    taken = [
        gqa(base, num_heads=4, kv_num_heads=2, do_rotary=1),
        gqa([*base, "pos", "bias", "", "ks", "vs", "", "", "ql"], num_heads=4, kv_num_heads=2, do_rotary=1, **int8),
        gqa(base, num_heads=4, kv_num_heads=2, do_rotary=1, local_window_size=8, softcap=30.0, scale=0.1),
    ]
    kept = [
        gqa(base, num_heads=4, kv_num_heads=2),  # no rotary in the kernel
        gqa(base, num_heads=4, kv_num_heads=2, do_rotary=1, rotary_interleaved=1),
        gqa(["qkv", "k", "v", *base[3:]], num_heads=4, kv_num_heads=2, do_rotary=1),  # separate K and V
        gqa([*base, "", "", "sink"], num_heads=4, kv_num_heads=2, do_rotary=1),  # head sinks
        gqa(base, num_heads=4, kv_num_heads=2, do_rotary=1, smooth_softmax=1),
        gqa([*base, "", "", "", "ks", "vs"], num_heads=4, kv_num_heads=2, do_rotary=1, kv_cache_bit_width=4),
    ]
    for node in taken + kept:
        model = helper.make_model(helper.make_graph([node], "g", [], []))
        changed = use_kernels(model, matmuls=None)
        out = model.graph.node[0]
        if node in taken:
            assert changed == 1 and out.domain == DOMAIN and len(out.input) == 17, node
            attrs = {a.name: helper.get_attribute_value(a) for a in out.attribute}
            assert set(attrs) == {"num_heads", "kv_num_heads", "scale", "softcap", "local_window_size"}
            assert out.op_type == ("OrderedAttentionInt8" if "kv_cache_bit_width" in str(node) else "OrderedAttention")
        else:
            assert changed == 0 and out.op_type == "GroupQueryAttention", node
    model = helper.make_model(helper.make_graph([taken[0]], "g", [], []))
    assert use_kernels(model, attention=False) == 0  # asked for the matmuls alone

"""In-graph tree verification and acceptance (greedy exact, sampling lossless, typical opt-in lossy).

All drafts are treated as deterministic (point-mass) proposals, which is what Medusa top-k, EAGLE-2/3 top-k
trees, static choice trees and prompt lookup are. For such drafts recursive rejection sampling (child x accepted
with probability p(x) / (1 - p of earlier, rejected siblings); the bonus from the residual) accepts exactly when the
token the target would sample at that position is one of the children, and then that child. So every node draws
the target's next token y = F^-1(u) by inverse CDF from its processed distribution, with the uniform number u of
the *sequence position* y would take (rand_accept[b, i] belongs to position position_ids[b, i] + 1: the runtime
draws one number per position of each request, engine.yaml sampling.uniforms = per_position); a child is accepted
when its token is its parent's y, and the bonus is the last accepted node's y. Each generated token is then
F^-1(u_q) of the target distribution at its position q: the output is a sample of the base model, with the same
acceptance rate as the rejection rule, and it is the same whatever was drafted, alone or batched (only the
logits' rounding could differ). Temperature 0 uses p = one-hot(argmax), which turns the rule into exact greedy
verification. A drafter that samples (a draft model) draws each draft with the number of the position it takes,
from its own distribution over the same token order (plugins/draft_target/drafter.py): then too the draft is
accepted exactly when it is the target's own draw, and the output does not depend on what was drafted.

Written with CumSum/compare formulations only (no CumProd, no bool Where chains) so the graph exports
to plain ONNX that TensorRT parses.
"""

from __future__ import annotations

import torch

from specbuild import engine_format as ef

TOP_K_CAP = ef.MAX_TOP_K  # top-k and the top-p nucleus are limited to the 2048 most likely tokens


def at_least(x, lo: int):
    """Integer max(x, lo) without Clip (TensorRT's Clip takes floats only)."""
    return torch.where(x < lo, torch.full_like(x, lo), x)


def at_most(x, hi: int):
    return torch.where(x > hi, torch.full_like(x, hi), x)


def branch(pred, true_fn, false_fn, operands, module=None):
    """`torch.cond` (an ONNX If once exported) without its torch.compile detour.

    torch.cond hands every call to dynamo, which re-traces the branch functions before export traces them again,
    and the acceptance graphs nest up to five Ifs (the bulk of a small model's export time:
    docs/benchmarks/design-measurements.md). The branch functions here take every tensor they read as an operand, so the
    export's tracer can take them directly (the cond operator itself); eagerly the predicate is a concrete tensor and
    one branch simply runs.

    module: the branches also read this module's parameters and buffers (a network run inside a branch): under
    export they become operands of the operator too (each storage once: tied weights stay one), swapped into the
    module while a branch is traced, so that its nodes keep their module paths (builder/quantize/blockwise.mode_nodes).

    A branch must not make a tensor from Python data (torch.tensor(...), or float() of one): under export that is a
    constant the exporter's functionalization of the branch cannot take ("Attempting to use FunctionalTensor on its
    own"). Make such tensors before the graph is traced and read them as the module's buffers (operands then)."""
    if not torch.compiler.is_exporting():
        return true_fn(*operands) if bool(pred) else false_fn(*operands)
    try:
        from torch._higher_order_ops.cond import cond_op
        from torch.utils import _pytree
    except ImportError:  # a torch without the operator under this name: the public (slower) form
        return torch.cond(pred, true_fn, false_fn, tuple(operands))

    structure = []
    operands = _owned(operands)
    names, weights = _unaliased(module) if module is not None else ([], [])

    def flat(fn):  # the operator returns a flat tuple of tensors, each its own (cond's no-aliasing rule)
        def run(*args):
            own, given = args[: len(operands)], args[len(operands) :]
            if module is None:
                out = fn(*own)
            else:
                from torch.nn.utils.stateless import _reparametrize_module

                with _reparametrize_module(module, dict(zip(names, given)), tie_weights=True):
                    out = fn(*own)
            leaves, spec = _pytree.tree_flatten(out)
            structure.append(spec)
            return tuple(leaf.clone() for leaf in leaves)

        return run

    leaves = cond_op(pred, flat(true_fn), flat(false_fn), (*operands, *weights))
    return _pytree.tree_unflatten(list(leaves), structure[0])


def _owned(operands) -> tuple:
    """The operands, each tensor as its own copy: an operand of the cond operator must be no view of another tensor
    (a view's symbolic stride has no ONNX form) and alias no other operand (the copies are Identity nodes, which the
    exporter's optimizer removes)."""
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in operands)


def _unaliased(module) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of the module's parameters and buffers, one per storage (tied weights: the first name; a
    weight that is a view of another's storage is left as it is, and a branch must not read it)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    names, tensors, seen = [], [], set()
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
        key = StorageWeakRef(tensor.untyped_storage())
        if key in seen:  # tied, or a view of a packed weight (gate/up of gate_up_proj): the branches read the first
            continue
        seen.add(key)
        names.append(name)
        tensors.append(tensor)
    return names, tensors


def top_token(logits):
    """argmax over the last axis (the first of equal maxima). The exported graph computes it as TopK with k = 1:
    ONNX Runtime's CPU TopK takes ~25 % less time than its ArgMax on a vocabulary-wide row, and ONNX TopK puts the
    lower index first among equal values, as argmax does."""
    if torch.onnx.is_in_onnx_export():
        return torch.topk(logits, 1, dim=-1).indices.squeeze(-1)
    return logits.argmax(-1)


def _onehot_argmax(logits):
    v = logits.shape[-1]
    argmax = logits.argmax(dim=-1, keepdim=True)
    return (torch.arange(v, device=logits.device).view(1, 1, v) == argmax).float()


def _plain_probs(scaled, top_k, top_p):
    return torch.softmax(scaled, dim=-1)


def _filtered_probs(scaled, top_k, top_p):
    """top-k then top-p over the TOP_K_CAP most likely tokens (a constant-K TopK: TensorRT needs K <= 3840)."""
    b, w, v = scaled.shape
    cap = min(v, TOP_K_CAP)
    sorted_vals, _ = torch.topk(scaled, k=cap, dim=-1)
    k = at_most(torch.where(top_k > 0, top_k, torch.full_like(top_k, cap)), cap)
    kth = sorted_vals.gather(2, (k - 1).view(b, 1, 1).expand(b, w, 1))
    sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, float("-inf"))
    # top-p over the sorted, top-k-filtered distribution: keep a token if the mass strictly above it < top_p
    sorted_probs = torch.softmax(sorted_vals, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = (mass_before < top_p.view(b, 1, 1)) & (sorted_vals >= kth)
    n_keep = at_least(keep_sorted.to(torch.int64).sum(-1, keepdim=True), 1)
    threshold = sorted_vals.gather(2, n_keep - 1)  # the smallest kept logit
    filtering = ((top_k > 0) | (top_p < 1.0)).view(b, 1, 1)
    threshold = torch.where(filtering, threshold, torch.full_like(threshold, float("-inf")))
    return torch.softmax(scaled.masked_fill(scaled < threshold, float("-inf")), dim=-1)


def target_probs(logits, temperature, top_k, top_p):
    """Processed target distribution [B,W,V] (float32): temperature -> top-k -> top-p; one-hot argmax in rows at
    temperature 0. Only the sampled branches call it (greedy verification never builds a distribution).

    With top-k and top-p off, the full softmax is used; filtering works over the TOP_K_CAP most likely tokens, behind
    a data-dependent branch (ONNX If) that skips the sort when no row filters.
    """
    logits = logits.float()
    b = logits.shape[0]
    scaled = logits / torch.clamp(temperature, min=ef.MIN_TEMPERATURE).view(b, 1, 1)
    filtering = ((top_k > 0) | (top_p < 1.0)).any()
    probs = branch(filtering, _filtered_probs, _plain_probs, (scaled, top_k, top_p))
    return torch.where((temperature <= 0).view(b, 1, 1), _onehot_argmax(logits), probs)


def typical_probs(logits, temperature, epsilon, alpha):
    """Lossy typical acceptance (Medusa): a draft x is accepted when p(x) > min(eps, alpha * exp(-H(p)))."""
    probs = torch.softmax(logits.float() / torch.clamp(temperature, min=ef.MIN_TEMPERATURE).view(-1, 1, 1), dim=-1)
    entropy = -(probs * torch.log(probs + 1e-10)).sum(-1, keepdim=True)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), alpha * torch.exp(-entropy))
    return probs, threshold


def tree_structure(tree_mask):
    """From an ancestor mask [B,W,W]: depth [B,W], parent one-hot [B,W,W] (row n: its parent), earlier siblings."""
    m = tree_mask.float()
    depth = m.sum(-1) - 1.0  # [B,W]
    parent = m * (depth.unsqueeze(1) == (depth.unsqueeze(2) - 1.0)).float()  # [B,n,m]
    w = tree_mask.shape[1]
    idx = torch.arange(w, device=tree_mask.device)
    earlier = (idx.view(1, w) < idx.view(w, 1)).float().unsqueeze(0)  # [1,n,m]: m < n
    same_parent = torch.matmul(parent, parent.transpose(1, 2))  # [B,n,m] 1 if same parent (both non-root)
    siblings_before = same_parent * earlier
    return depth, parent, siblings_before


def accept(
    logits,
    tokens,
    tree_mask,
    paths,
    temperature,
    top_k,
    top_p,
    rand_accept,
    rand_sample,
    typical=None,
):
    """Verify a draft tree.

    logits [B,W,V] of the window nodes; tokens [B,W] (node tokens; node 0 of a path is the root);
    tree_mask [B,W,W]; paths [B,NP,DP] window node indices (-1 padded). Returns
    (accepted_tokens [B,DP], num_accepted [B], accepted_nodes [B,DP] window indices (-1 padded),
    last_node [B] the deepest accepted node).

    When every row is greedy an ONNX If runs the greedy verification alone: a node is accepted when its token is
    its parent's argmax and the bonus is the last accepted node's argmax -- the general rule below at temperature 0,
    without its vocabulary-wide probability, residual and CDF passes.

    Every draft is verified as a point mass: a drafter that samples its drafts draws each with the uniform number
    of the position it takes (runtime/sampling.position_uniforms), so that it is accepted exactly when it is the
    target's own draw there and a seed gives the same tokens whatever was drafted.
    """
    if typical is not None:
        return _accept_typical(
            logits, tokens, tree_mask, paths, temperature, top_k, top_p, rand_accept, rand_sample, typical=typical
        )
    greedy = (temperature <= 0).all()
    # tokens is a window (a view) of the step's input_ids; an If-branch operand must own its memory (a view's
    # symbolic stride has no ONNX form), and index_select always copies
    tokens = tokens.index_select(1, torch.arange(tokens.shape[1], device=tokens.device))
    depth, parent, siblings_before = tree_structure(tree_mask)
    operands = (
        logits,
        tokens,
        parent,
        siblings_before,
        depth,
        paths,
        temperature,
        top_k,
        top_p,
        rand_accept,
        rand_sample,
    )
    # one If for the whole walk: the greedy branch never touches a probability
    return branch(greedy, _accept_greedy, _accept_sampled, operands)


def _accept_greedy(logits, tokens, parent, siblings_before, depth, paths, *sampling):
    """Temperature 0: one argmax per window node serves both the flags (a node's token is its parent's argmax) and the
    bonus (the last accepted node's argmax)."""
    best = top_token(logits)  # [B,W]
    flags = _greedy_flags(best, tokens, parent)
    best_len, best_path, last_node = _walk(flags, depth, siblings_before, paths)
    bonus = best.gather(1, last_node.unsqueeze(1)).squeeze(1)
    return _accepted(tokens, best_len, best_path, last_node, bonus)


def _accept_sampled(
    logits, tokens, parent, siblings_before, depth, paths, temperature, top_k, top_p, rand_accept, rand_sample
):
    """Each node's next token drawn with its position's uniform (the module docstring); then the greedy walk."""
    probs = target_probs(logits, temperature, top_k, top_p)  # [B,W,V]
    drawn = inverse_cdf(probs, rand_accept)  # [B,W]
    flags = _greedy_flags(drawn, tokens, parent)
    best_len, best_path, last_node = _walk(flags, depth, siblings_before, paths)
    bonus = drawn.gather(1, last_node.unsqueeze(1)).squeeze(1)
    return _accepted(tokens, best_len, best_path, last_node, bonus)


def inverse_cdf(probs, uniforms):
    """[B,W] draws from probs [B,W,V] (unnormalised rows allowed) with uniforms [B,W] in [0, 1): the first token whose
    cumulative mass exceeds u * total (so never a token of zero probability)."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf.narrow(-1, probs.shape[-1] - 1, 1)
    return (cdf <= uniforms.unsqueeze(-1) * total).to(torch.int64).sum(-1)


def _walk(flags, depth, siblings_before, paths):
    """From each node's acceptance flag [B,W]: the first accepted child of each node, then the longest accepted path
    (see _best_path)."""
    accepted_flag = flags * (depth > 0).float()
    earlier_accepted = (siblings_before * accepted_flag.unsqueeze(1)).sum(-1)
    chosen = accepted_flag * (earlier_accepted == 0).float()  # [B,W]: the first accepted child of each node
    return _best_path(chosen, paths)


def accept_root(logits, temperature, top_k, top_p, rand_accept):
    """`accept` for a window whose last node is a lone root (plain decoding; earlier window nodes are prompt tokens
    whose logits are only reported): the bonus token alone, drawn as `accept` draws it for a childless root (argmax
    at temperature 0, else the inverse-CDF sample with the last node's uniform), without the tree bookkeeping --
    ~100 small nodes, a cost per step on CPU."""
    w = logits.shape[1]
    last_index = torch.full((1,), w - 1, dtype=torch.int64, device=logits.device)
    last = logits.index_select(1, last_index)  # a copy
    operands = (last.squeeze(1), temperature, top_k, top_p, rand_accept.index_select(1, last_index).squeeze(1))
    bonus = branch((temperature <= 0).all(), _greedy_root, _sampled_root, operands)
    last_node = torch.zeros_like(bonus) + (w - 1)
    return bonus.unsqueeze(1), torch.ones_like(bonus), last_node.unsqueeze(1), last_node


def _greedy_root(last_logits, temperature, top_k, top_p, rand_sample):
    return top_token(last_logits)


def _sampled_root(last_logits, temperature, top_k, top_p, uniform):
    probs = target_probs(last_logits.unsqueeze(1), temperature, top_k, top_p)
    return inverse_cdf(probs, uniform.unsqueeze(1)).squeeze(1)


def _greedy_flags(best, tokens, parent):
    """Node n is accepted when its token is its parent's argmax (`best` [B,W]; float matmul: exact for ids below
    2**24)."""
    parent_argmax = torch.matmul(parent, best.float().unsqueeze(-1)).squeeze(-1)  # [B,n]
    return (tokens.float() == parent_argmax).float()


def _accept_typical(
    logits, tokens, tree_mask, paths, temperature, top_k, top_p, rand_accept, rand_sample, typical=None
):
    b, w, v = logits.shape
    probs, threshold = typical_probs(logits, temperature, *typical)
    depth, parent, siblings_before = tree_structure(tree_mask)
    tok_probs = probs.gather(2, tokens.unsqueeze(1).expand(b, w, w))
    p_node = (parent * tok_probs.transpose(1, 2)).sum(-1)
    thr_parent = (parent * threshold.squeeze(-1).unsqueeze(1)).sum(-1)
    greedy = (temperature <= 0).view(b, 1).float()
    tok_argmax = probs.argmax(-1)  # [B,m]
    is_argmax = (parent * (tok_argmax.unsqueeze(1) == tokens.unsqueeze(2)).float()).sum(-1)
    accepted_flag = greedy * is_argmax + (1 - greedy) * (p_node > thr_parent).float()
    accepted_flag = accepted_flag * (depth > 0).float()
    earlier_accepted = (siblings_before * accepted_flag.unsqueeze(1)).sum(-1)
    chosen = accepted_flag * (earlier_accepted == 0).float()
    best_len, best_path, last_node = _best_path(chosen, paths)
    last_probs = probs.gather(1, last_node.view(b, 1, 1).expand(b, 1, v)).squeeze(1)
    # typical acceptance samples the bonus from the plain distribution (greedy: argmax)
    residual = torch.where(
        (temperature <= 0).view(b, 1),
        (last_probs.argmax(-1, keepdim=True) == torch.arange(v).view(1, v)).float(),
        last_probs,
    )
    bonus = _sample(residual, last_probs, rand_sample)
    return _accepted(tokens, best_len, best_path, last_node, bonus)


def _best_path(chosen, paths):
    """The path with the longest accepted prefix (first path wins ties): (drafts accepted [B], path [B,DP], last
    accepted node [B])."""
    b, _, dp = paths.shape
    valid = paths >= 0
    safe_paths = at_least(paths, 0)
    path_chosen = chosen.gather(1, safe_paths.view(b, -1)).view(paths.shape) * valid.float()
    is_root = (torch.arange(dp, device=paths.device) == 0).float().view(1, 1, dp)
    ok = is_root + (1.0 - is_root) * path_chosen  # the root always counts (avoids empty tensors when DP = 1)
    rejected_so_far = torch.cumsum(1.0 - ok, dim=-1)
    length = (rejected_so_far == 0).float().sum(-1) - 1.0  # [B,NP] accepted drafts per path
    best = length.argmax(dim=-1)  # first path wins ties
    best_len = length.gather(1, best.unsqueeze(1)).squeeze(1).to(torch.int64)  # [B]
    best_path = safe_paths.gather(1, best.view(b, 1, 1).expand(b, 1, dp)).squeeze(1)  # [B,DP]
    last_node = best_path.gather(1, best_len.unsqueeze(1)).squeeze(1)  # [B]
    return best_len, best_path, last_node


def _sample(residual, fallback_probs, rand_sample):
    """One draw from the (unnormalised) residual with the uniform rand_sample; argmax when the residual is empty."""
    b, v = residual.shape
    total = residual.sum(-1, keepdim=True)
    cdf = torch.cumsum(residual, dim=-1)
    sampled = at_most((cdf <= rand_sample.view(b, 1) * total).to(torch.int64).sum(-1), v - 1)
    return torch.where(total.squeeze(-1) > 0, sampled, fallback_probs.argmax(-1))


def _accepted(tokens, best_len, best_path, last_node, bonus):
    b, dp = best_path.shape
    j = torch.arange(dp, device=tokens.device).view(1, dp)
    next_in_path = torch.cat([best_path[:, 1:], best_path[:, :1]], dim=1)
    draft_tokens = tokens.gather(1, next_in_path)
    accepted_tokens = torch.where(j < best_len.unsqueeze(1), draft_tokens, bonus.unsqueeze(1))
    in_range = j <= best_len.unsqueeze(1)
    accepted_tokens = torch.where(in_range, accepted_tokens, torch.full_like(accepted_tokens, -1))
    accepted_nodes = torch.where(in_range, best_path, torch.full_like(best_path, -1))
    return accepted_tokens, best_len + 1, accepted_nodes, last_node

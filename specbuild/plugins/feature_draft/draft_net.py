"""Feature-conditioned draft networks (the base class the EAGLE generations specialise) and the in-graph tree
expansion.

Per engine call, after acceptance:
1. commit pass: the draft runs over all T new nodes on (feature of node i, token after node i) pairs at node i's
   position, attending to its own cache (positions < past_length) and the tree; its KV for the T nodes is an
   output that the runtime commits at the accepted nodes, exactly like the base KV.
2. expansion from the last accepted node's draft output: EAGLE-2 dynamic top-k (frontier by cumulative
   log-probability, then the best total_tokens-1 candidates reranked into the next tree) or a static choice
   tree. Expansion KV is scratch and never leaves the graph.
"""

from __future__ import annotations

import torch
from torch import nn

from specbuild import engine_format as ef
from specbuild.builder.network.llama import Attention


class DraftAttention(Attention):
    """The base attention over a list of memories (draft cache, accepted path, expansion nodes) plus itself."""

    def forward(self, x, cos, sin, mem_k, mem_v, mem_mask, self_mask):
        """x [B,n,in]; mem_k/v lists of [B,Hkv,M,D]; mem_mask list of [B,n,M] bool; self_mask [B,n,n] bool."""
        q, k, v = self.project(x, cos, sin)
        mask = torch.cat([*mem_mask, self_mask], dim=2).unsqueeze(1).unsqueeze(1)  # [B,1,1,n,M]
        out = self.attend(q, [*mem_k, k], [*mem_v, v], mask)
        return out, k, v


class DraftMLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftNet(nn.Module):
    """A draft network over (feature, next token) pairs: `layers` of draft decoder layers after an input step.

    A subclass builds its layers (and fc / norm / lm_head) after this __init__ and defines `graph_features` (the
    per-node feature the step graph gives it), `project` (feature -> the layers' width), `layer_input` (token
    embedding and projected feature -> the first layer's input) and `logits`. `version` is recorded in the
    manifest."""

    version = 0

    def __init__(self, head_cfg: dict, base_cfg):
        super().__init__()
        h = base_cfg.hidden_size
        c = {
            "hidden": h,
            "num_heads": head_cfg.get("num_heads") or base_cfg.num_heads,
            "num_kv_heads": head_cfg.get("num_kv_heads") or base_cfg.num_kv_heads,
            "head_dim": head_cfg.get("head_dim") or base_cfg.head_dim,
            "intermediate_size": head_cfg.get("intermediate_size") or base_cfg.intermediate_size,
            "rms_norm_eps": float(head_cfg.get("rms_norm_eps") or base_cfg.rms_norm_eps),
            "qkv_bias": bool(head_cfg.get("qkv_bias", False)),
            "norm_before_residual": bool(head_cfg.get("norm_before_residual", False)),
        }
        self.c = c
        theta = float(head_cfg.get("rope_theta") or base_cfg.rope_theta)
        d = c["head_dim"]
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, d, 2).float() / d)), persistent=False)
        self.draft_vocab = head_cfg.get("draft_vocab_size") or None
        self.embed_tokens = nn.Embedding(base_cfg.vocab_size, h) if head_cfg.get("has_embed") else None
        self.register_buffer("d2t", torch.zeros(self.draft_vocab or 1, dtype=torch.long), persistent=True)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def load(self, tensors: dict):
        state = dict(tensors)
        if "d2t" not in state:
            state["d2t"] = self.d2t
        self.load_state_dict({k: v for k, v in state.items()}, strict=True)

    def graph_features(self, ctx):
        raise NotImplementedError

    def project(self, feats):
        return feats

    def layer_input(self, emb, feats):
        return feats

    def logits(self, h, net):
        raise NotImplementedError

    def features(self, ctx):
        """Features of the T new nodes of a step, projected to the layers' width."""
        return self.project(self.graph_features(ctx))

    def embed(self, tokens, net):
        return (self.embed_tokens or net.embed_tokens)(tokens)

    def rope(self, positions, dtype):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def run(self, tokens, feats, positions, net, mem_k, mem_v, mem_mask, self_mask):
        """One draft pass over n nodes. mem_k/v: per draft layer, a list of memories. Returns (h, [k], [v])."""
        emb = self.embed(tokens, net)
        x = self.layer_input(emb, feats)
        cos, sin = self.rope(positions, x.dtype)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, emb, cos, sin, mem_k[i], mem_v[i], mem_mask, self_mask)
            new_k.append(k)
            new_v.append(v)
        return x, new_k, new_v

    def logprobs(self, h, net):
        return torch.log_softmax(self.logits(h, net).float(), dim=-1)

    def to_target(self, ids):
        if self.draft_vocab is None:
            return ids
        return ids + self.d2t[ids]


def stable_topk(x, k: int):
    """Top-k of a short last axis where equal values keep the lower index first (ONNX TopK's tie rule).

    torch.topk leaves tie order unspecified and a stable sort does not export, so ranks come from a pairwise
    comparison (n <= a few hundred candidates). A parent ties with its child only when the child's
    log-probability rounds to 0; the parent has the lower index, so the reranked tree stays prefix-closed.
    """
    n = x.shape[-1]
    xi, xj = x.unsqueeze(-1), x.unsqueeze(-2)
    idx = torch.arange(n, device=x.device)
    earlier = (idx.view(1, n) < idx.view(n, 1)).view(*([1] * (x.dim() - 1)), n, n)
    before = (xj > xi) | ((xj == xi) & earlier)
    rank = before.to(torch.int64).sum(-1)  # stable descending position of each element
    slots = torch.arange(k, device=x.device)
    indices = (rank.unsqueeze(-1) == slots).to(torch.float32).argmax(dim=-2)  # [..., k]
    return x.gather(-1, indices), indices


def _gather_rows(x, idx):
    """x [B,N,...], idx [B,M] -> [B,M,...]."""
    b, m = idx.shape
    shape = (b, m) + tuple(x.shape[2:])
    flat = idx.view(b, m, *([1] * (x.dim() - 2))).expand(shape)
    return x.gather(1, flat)


def _cached(past_length, valid, n: int):
    """[B,n,C] the draft-cache positions n nodes attend to: below past_length and held (`valid` [B,C], the
    draft_valid state: False where a call skipped the draft network)."""
    b, cap = valid.shape
    below = torch.arange(cap, device=valid.device).view(1, 1, cap) < past_length.view(b, 1, 1)
    return (below & valid.unsqueeze(1)).expand(b, n, cap)


def commit_pass(draft: DraftNet, ctx, draft_kv, valid):
    """Draft over all T new nodes (valid [B,C]: the positions the draft cache holds). Returns (h [B,T,H], new draft
    kv [Ld,2,B,Hkv,T,D])."""
    input_ids, acc_nodes, acc_tokens = ctx.input_ids, ctx.accepted_nodes, ctx.accepted_tokens
    b, t = input_ids.shape
    shifted = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
    node_idx = torch.arange(t, device=input_ids.device).view(1, t, 1)
    hit = acc_nodes.unsqueeze(1) == node_idx  # [B,T,DP]
    from_accepted = (hit.to(torch.int64) * acc_tokens.unsqueeze(1)).sum(-1)
    next_tokens = torch.where(hit.to(torch.int64).sum(-1) > 0, from_accepted, shifted)
    feats = draft.features(ctx)
    past = _cached(ctx.past_length, valid, t)
    tree_mask = ctx.tree_mask
    mem_k = [[draft_kv[i, 0]] for i in range(draft.num_layers)]
    mem_v = [[draft_kv[i, 1]] for i in range(draft.num_layers)]
    h, ks, vs = draft.run(next_tokens, feats, ctx.position_ids, ctx.net, mem_k, mem_v, [past], tree_mask)
    new_kv = torch.stack([torch.stack(ks), torch.stack(vs)], dim=1)
    return h, new_kv


def _expansion_memories(draft, ctx, draft_kv, valid, new_kv, n):
    """Memories every expansion node sees: the draft cache (where `valid`) and the accepted path's new draft KV.

    Returns (mem_k, mem_v, masks) with masks [B,n,M] for n nodes."""
    b = ctx.input_ids.shape[0]
    t = ctx.input_ids.shape[1]
    past = _cached(ctx.past_length, valid, n)
    on_path = ctx.tree_mask.gather(1, ctx.last_node.view(b, 1, 1).expand(b, 1, t)).expand(b, n, t)
    mem_k = [[draft_kv[i, 0], new_kv[i, 0]] for i in range(draft.num_layers)]
    mem_v = [[draft_kv[i, 1], new_kv[i, 1]] for i in range(draft.num_layers)]
    return mem_k, mem_v, [past, on_path]


def expand_dynamic(draft: DraftNet, ctx, h_all, draft_kv, valid, new_kv, top_k: int, depth: int, total_tokens: int):
    """EAGLE-2: returns next_input_ids [B,N], next_tree_mask [B,N,N], next_position_offsets [B,N],
    next_paths [B,N,depth+1] (one path per node; prefixes of longer paths are harmless)."""
    net = ctx.net
    b = h_all.shape[0]
    hsize = h_all.shape[2]
    k, n_sel = top_k, total_tokens - 1
    n_cand = k + (depth - 1) * k * k
    cand = torch.arange(n_cand, device=h_all.device)
    eye = (cand.unsqueeze(-1) == cand).to(h_all.dtype)  # [n_cand,n_cand] identity (eye's decomposition, traced once)
    h_root = h_all.gather(1, ctx.last_node.view(b, 1, 1).expand(b, 1, hsize))  # [B,1,H]
    root_pos = ctx.position_ids.gather(1, ctx.last_node.view(b, 1)) + 1  # [B,1]
    logp = draft.logprobs(h_root, net).squeeze(1)  # [B,Vd]
    scores, ids = torch.topk(logp, k, dim=-1)  # [B,k]
    cand_tokens, cand_scores = [ids], [scores]
    cand_anc = [eye[:k].unsqueeze(0).expand(b, k, n_cand)]  # ancestor rows (incl. self) over candidates
    frontier_idx = torch.arange(k).view(1, k).expand(b, k)
    frontier_tokens, frontier_scores = ids, scores
    frontier_feat = h_root.expand(b, k, hsize)
    frontier_anc = cand_anc[0]
    mem_k, mem_v, mem_mask = _expansion_memories(draft, ctx, draft_kv, valid, new_kv, k)
    exp_idx: list = []
    offset = k
    for it in range(depth - 1):
        masks = list(mem_mask)
        if exp_idx:
            prev = torch.cat(exp_idx, dim=1)  # [B,M] candidate index of each expansion memory entry
            masks.append(frontier_anc.gather(2, prev.unsqueeze(1).expand(b, k, prev.shape[1])) > 0)
        self_mask = (torch.arange(k).unsqueeze(-1) == torch.arange(k)).unsqueeze(0).expand(b, k, k)
        positions = (root_pos + it).expand(b, k)
        h_f, ks, vs = draft.run(
            draft.to_target(frontier_tokens), frontier_feat, positions, net, mem_k, mem_v, masks, self_mask
        )
        for i in range(draft.num_layers):
            mem_k[i] = mem_k[i] + [ks[i]]
            mem_v[i] = mem_v[i] + [vs[i]]
        exp_idx.append(frontier_idx)
        lp = draft.logprobs(h_f, net)  # [B,k,Vd]
        child_scores, child_ids = torch.topk(lp, k, dim=-1)  # [B,k,k]
        child_scores = (frontier_scores.unsqueeze(2) + child_scores).reshape(b, k * k)
        child_ids = child_ids.reshape(b, k * k)
        parent_anc = frontier_anc.unsqueeze(2).expand(b, k, k, n_cand).reshape(b, k * k, n_cand)
        child_anc = parent_anc + eye[offset : offset + k * k].unsqueeze(0)
        cand_tokens.append(child_ids)
        cand_scores.append(child_scores)
        cand_anc.append(child_anc)
        if it < depth - 2:
            best_scores, best = stable_topk(child_scores, k)  # [B,k] indices into k*k
            frontier_idx = best + offset
            frontier_tokens = child_ids.gather(1, best)
            frontier_scores = best_scores
            frontier_feat = _gather_rows(h_f, torch.div(best, k, rounding_mode="floor"))
            frontier_anc = _gather_rows(child_anc, best)
        offset += k * k
    all_tokens = torch.cat(cand_tokens, dim=1)  # [B,n_cand]
    all_scores = torch.cat(cand_scores, dim=1)
    all_anc = torch.cat(cand_anc, dim=1)  # [B,n_cand,n_cand]
    _, sel = stable_topk(all_scores, n_sel)
    sel = (-torch.topk(-sel.float(), n_sel, dim=-1).values).to(torch.int64)  # ascending: parents first
    tokens = draft.to_target(all_tokens.gather(1, sel))
    anc = _gather_rows(all_anc, sel).gather(2, sel.unsqueeze(1).expand(b, n_sel, n_sel)) > 0  # [B,n,n]
    n = n_sel + 1
    root_col = torch.ones(b, n, 1, dtype=torch.bool)
    top_row = torch.cat([torch.ones(b, 1, 1, dtype=torch.bool), torch.zeros(b, 1, n_sel, dtype=torch.bool)], dim=2)
    mask = torch.cat([top_row, torch.cat([root_col[:, 1:], anc], dim=2)], dim=1)  # [B,n,n]
    depths = mask.to(torch.int64).sum(-1) - 1  # [B,n]
    d_range = torch.arange(depth + 1).view(1, 1, depth + 1, 1)
    at_depth = mask.unsqueeze(2) & (depths.view(b, 1, 1, n) == d_range)  # [B,node,d,m]
    path_node = at_depth.to(torch.int64).argmax(-1)  # [B,n,depth+1]
    valid = d_range.view(1, 1, depth + 1) <= depths.unsqueeze(2)
    paths = torch.where(valid, path_node, torch.full_like(path_node, -1))
    next_ids = torch.cat([ctx.bonus.unsqueeze(1), tokens], dim=1)
    return {
        ef.NEXT_INPUT_IDS: next_ids,
        ef.NEXT_TREE_MASK: mask,
        ef.NEXT_POSITION_OFFSETS: depths,
        ef.NEXT_PATHS: paths,
    }


def static_levels(tree):
    """For each depth d of a static tree: (d, the nodes at d, those the draft runs on (not leaves), the nodes it ran
    on at the depths above, in that order)."""
    ran: list[int] = []
    for d in range(1, tree.depth + 1):
        level = [i for i in range(tree.size) if tree.depths[i] == d]
        run_nodes = [i for i in level if not tree.is_leaf[i]]
        yield d, level, run_nodes, list(ran)
        ran += run_nodes


def static_relations(tree) -> dict[int, torch.Tensor]:
    """{depth: [n, m] bool}: whether each node the draft runs on at that depth descends from each node it ran on
    above (the expansion's attention among its own nodes). Made once, outside the traced graph: the plugin keeps
    them as buffers, since a tensor made from Python data inside the drafting's If does not export."""
    ancestors = tree.ancestor_mask
    return {
        d: torch.tensor([[bool(ancestors[i, j]) for j in ran] for i in run_nodes], dtype=torch.bool)
        for d, _, run_nodes, ran in static_levels(tree)
        if run_nodes and ran
    }


def expand_static(draft: DraftNet, ctx, h_all, draft_kv, valid, new_kv, tree, relations: dict):
    """EAGLE-1 static choices: each node's children are the top-ranked tokens of the draft run on that node.
    relations: static_relations(tree), as the module holds them."""
    net = ctx.net
    b, _, hsize = h_all.shape
    h_root = h_all.gather(1, ctx.last_node.view(b, 1, 1).expand(b, 1, hsize))
    root_pos = ctx.position_ids.gather(1, ctx.last_node.view(b, 1)) + 1
    parents, ranks = tree.parents, tree.ranks
    node_h = {0: h_root[:, 0]}
    tokens = {}
    mem_k, mem_v, path_masks = _expansion_memories(draft, ctx, draft_kv, valid, new_kv, 1)
    for d, level, run_nodes, ran in static_levels(tree):
        by_parent: dict[int, list[int]] = {}
        for i in level:
            by_parent.setdefault(int(parents[i]), []).append(i)
        for p, kids in by_parent.items():
            kmax = max(int(ranks[i]) for i in kids) + 1
            ids = torch.topk(draft.logprobs(node_h[p], net), kmax, dim=-1).indices  # [B,kmax]
            for i in kids:
                tokens[i] = draft.to_target(ids[:, int(ranks[i])])
        if not run_nodes:
            continue
        n = len(run_nodes)
        masks = [m.expand(b, n, m.shape[2]) for m in path_masks]
        if ran:
            masks.append(relations[d].unsqueeze(0).expand(b, n, len(ran)))
        tok = torch.stack([tokens[i] for i in run_nodes], dim=1)
        feats = torch.stack([node_h[int(parents[i])] for i in run_nodes], dim=1)
        positions = (root_pos + d - 1).expand(b, n)
        self_mask = (torch.arange(n).unsqueeze(-1) == torch.arange(n)).unsqueeze(0).expand(b, n, n)
        h, ks, vs = draft.run(tok, feats, positions, net, mem_k, mem_v, masks, self_mask)
        for li in range(draft.num_layers):
            mem_k[li] = mem_k[li] + [ks[li]]
            mem_v[li] = mem_v[li] + [vs[li]]
        for j, i in enumerate(run_nodes):
            node_h[i] = h[:, j]
    drafts = [tokens[i] for i in range(1, tree.size)]
    next_ids = torch.stack([ctx.bonus] + drafts, dim=1) if drafts else ctx.bonus.unsqueeze(1)
    return {ef.NEXT_INPUT_IDS: next_ids}

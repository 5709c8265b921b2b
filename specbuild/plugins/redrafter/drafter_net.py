"""The recurrent drafter (torch): its network, the beam search that drafts M beams of L tokens from one hidden
state, and the merge of the beams' shared prefixes into one tree. Used by the step graph (build time) and by the
trainer; the same code is what gets exported.

Drafter(x) = lm_head(ResBlock^n(input_proj?(x))), x = concat(context, state) (width 2H), ResBlock(y) = y + SiLU(Wy+b);
the state starts at 0 and follows each drafted token: SiLU(rnn_w(E[tok]) + rnn_u(state)) with the RNN, else
E[tok] + state, E the base model's embedding. Each step's logits are shifted by their maximum, masked to the top-50
(the reference's warp, -50000 elsewhere) and log-softmaxed; the beams grow by the best M of M x V extensions.
"""

from __future__ import annotations

import torch
from torch import nn

LOG_0 = -50000.0  # log-probability of masked tokens and of the initially empty beams (the reference's value)


class RecurrentDrafter(nn.Module):
    def __init__(self, hidden: int, exit_dim: int, num_layers: int, rnn: bool, rows: int, top_k_warp: int = 50):
        """rows: the vocabulary projection's rows (the base vocabulary, or a draft vocabulary's size)."""
        super().__init__()
        self.hidden, self.exit_dim, self.rows, self.top_k_warp = hidden, exit_dim, rows, top_k_warp
        self.input_proj = nn.Linear(2 * hidden, exit_dim) if exit_dim != 2 * hidden else None
        self.blocks = nn.ModuleList(nn.Linear(exit_dim, exit_dim) for _ in range(num_layers))
        self.lm_head = nn.Linear(exit_dim, rows, bias=False)
        self.rnn_u = nn.Linear(hidden, hidden) if rnn else None
        self.rnn_w = nn.Linear(hidden, hidden, bias=False) if rnn else None
        self.register_buffer("draft_ids", torch.zeros(0, dtype=torch.long), persistent=False)

    @classmethod
    def from_config(cls, head_cfg: dict, hidden: int, vocab: int, top_k_warp: int = 50) -> RecurrentDrafter:
        rows = int(head_cfg.get("draft_vocab_size") or vocab)
        return cls(hidden, int(head_cfg["exit_dim"]), int(head_cfg["num_layers"]), bool(head_cfg["rnn"]), rows,
                   top_k_warp)  # fmt: skip

    def load(self, tensors: dict) -> None:
        state = {k: v for k, v in tensors.items() if k != "draft_vocab"}
        self.load_state_dict(state, strict=True)
        if "draft_vocab" in tensors:
            self.draft_ids = tensors["draft_vocab"].to(torch.long)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> base token ids."""
        return self.draft_ids[ids] if self.draft_ids.numel() else ids

    def next_state(self, emb: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        if self.rnn_w is None:
            return emb + state
        return nn.functional.silu(self.rnn_w(emb) + self.rnn_u(state))

    def logits(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Raw drafter logits [..., rows] (float32) for concat(context, state)."""
        x = torch.cat([context, state], dim=-1)
        if self.input_proj is not None:
            x = self.input_proj(x)
        for block in self.blocks:
            x = x + nn.functional.silu(block(x))
        return self.lm_head(x).float()

    def log_probs(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The warped drafting distribution: max-shifted, top-k masked to LOG_0, log-softmax."""
        logits = self.logits(context, state)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        k = min(self.top_k_warp, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        return torch.log_softmax(logits.masked_fill(logits < kth, LOG_0), dim=-1)


def _gather_beams(x: torch.Tensor, beam: torch.Tensor) -> torch.Tensor:
    """x [B,M,...], beam [B,M] -> x[b, beam[b, m], ...]."""
    index = beam.view(*beam.shape, *([1] * (x.dim() - 2))).expand(*beam.shape, *x.shape[2:])
    return x.gather(1, index)


def beam_search(drafter: RecurrentDrafter, context, root, embed, num_beams: int, length: int) -> torch.Tensor:
    """beams [B,M,length+1] of base token ids: the root (the token the target just emitted) then `length` drafts.

    context [B,H]: the target's final hidden state that produced `root` [B]; embed: the base embedding."""
    b, h = context.shape
    m = num_beams
    log_p = torch.full((b, m), LOG_0, dtype=torch.float32, device=context.device)
    log_p = torch.cat([torch.zeros_like(log_p[:, :1]), log_p[:, 1:]], dim=1)  # only beam 0 grows at step 1
    ctx = context.unsqueeze(1).expand(b, m, h)
    last = root.unsqueeze(1).expand(b, m)
    state = torch.zeros(b, m, h, dtype=context.dtype, device=context.device)
    columns = [last]
    for _ in range(length):
        state = drafter.next_state(embed(last), state)
        lp = drafter.log_probs(ctx, state)  # [B,M,V']
        v = lp.shape[-1]
        log_p, index = torch.topk((lp + log_p.unsqueeze(2)).reshape(b, m * v), m, dim=-1)
        beam = torch.div(index, v, rounding_mode="floor")
        token = drafter.to_target(index - beam * v)
        columns = [c.gather(1, beam) for c in columns] + [token]
        state = _gather_beams(state, beam)
        last = token
    return torch.stack(columns, dim=-1)


def beams_to_tree(beams: torch.Tensor) -> dict[str, torch.Tensor]:
    """Merge beams [B,M,L+1] (column 0: the shared root) by shared prefix into one tree of at most 1 + M*L nodes.

    Node (beam i, depth j) is new when no earlier beam has the same first j+1 tokens; new nodes are numbered beam by
    beam (the root is 0), so a parent always precedes its children. Returns, padded to N = 1 + M*L nodes:
    tokens [B,N], mask [B,N,N] (ancestors and self; padding nodes see only themselves), offsets [B,N] (depth),
    paths [B,M,L+1] (each beam's node indices) and count [B] (nodes in use: the first `count` of every array).
    Float arithmetic on ids and counts (exact below 2**24) keeps the graph to ops TensorRT takes."""
    b, m, width = beams.shape
    length = width - 1
    n = 1 + m * length
    same = (beams.unsqueeze(2) == beams.unsqueeze(1)).float()  # [B,i,k,j]: beam i and beam k agree at column j
    prefix = torch.cumsum(1.0 - same, dim=-1) == 0  # ... on columns 0..j
    first = prefix.float().argmax(dim=2)  # [B,i,j]: the first beam sharing beam i's prefix through column j
    beam_index = torch.arange(m, device=beams.device).view(1, m, 1)
    new = (first[:, :, 1:] == beam_index).float()  # [B,M,L]
    number = torch.cumsum(new.reshape(b, m * length), dim=-1)  # node index of each new node (root is 0)
    column = torch.arange(length, device=beams.device).view(1, 1, length)
    owner = first[:, :, 1:] * length + column  # flat (beam, column) of the node that holds each beam's prefix
    nodes = number.gather(1, owner.reshape(b, m * length)).reshape(b, m, length).to(torch.int64)
    paths = torch.cat([torch.zeros_like(nodes[:, :, :1]), nodes], dim=2)  # [B,M,L+1]
    slots = torch.arange(n, device=beams.device).view(1, 1, 1, n)
    onehot = (paths.unsqueeze(-1) == slots).float()  # [B,M,L+1,N]
    reach = torch.cumsum(onehot, dim=2)  # [B,M,j,N]: nodes on beam i at columns <= j
    ancestors = torch.matmul(onehot.transpose(2, 3), reach).sum(1) > 0  # [B,N,N]
    eye = (slots.view(n, 1) == slots.view(1, n)).unsqueeze(0)  # [1,N,N] identity
    mask = ancestors | eye
    offsets = mask.to(torch.int64).sum(-1) - 1
    tokens = (onehot * beams.float().unsqueeze(-1)).amax(dim=(1, 2)).to(torch.int64)  # [B,N] (0 for padding)
    count = (1.0 + new.sum(dim=(1, 2))).to(torch.int64)
    return {"tokens": tokens, "mask": mask, "offsets": offsets, "paths": paths, "count": count}

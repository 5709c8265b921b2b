"""The draft-target runtime drafter (numpy): a draft model's engine, inside the engine directory, proposes a chain.

Each sequence keeps a session of its own on the draft engine (its own KV slot). Per step:
1. after the target accepted `step.tokens`, the draft's cache keeps the longest prefix it has seen that the target
   committed (the drafts that were accepted stay: they are not recomputed); the tokens it has not seen yet (the
   last draft, if accepted, and the bonus token: one or two) are fed in one call, which gives q of the first draft;
2. each further draft is one call of one token (the previous draft).
Greedy requests draft the draft's argmax. Sampled ones draw each draft coupled to the target's own draw: the target
graph draws the token at position q by inverse CDF of its distribution p with the request's uniform number u_q
(runtime/sampling.position_uniforms) and accepts a draft when it is that token (builder/network/acceptance.py), so the
draft for position q is the inverse CDF of the draft's distribution (after the request's temperature, top-k and top-p,
over the target's token order) at the same u_q. Each output token is then the one plain decoding draws at its
position, whatever was drafted: a seed gives the same tokens alone, batched, drafted or not (the rejection rule
min(1, p/q) accepted a little more often, but drew drafted positions with other numbers than plain ones). A draft
projected onto a vocabulary subset (vocab_ids) has q = 0 outside it. Host work per step is O(accepted + drafted
tokens) (and O(V) a sampled draft).

A top-k tree (top_k K > 1) verifies K children at each depth of the chain, the chain going on from the first: the
draft's K most likely tokens (greedy), or (sampled) the coupled draw and the K - 1 tokens whose intervals of the
draft's CDF lie nearest u_q (where p's CDF differs a little from q's, the target's draw lands on a neighbour). The
siblings are leaves: the draft never computes past them, so its calls and its cache are the chain's.

Engines built before the coupling verify sampled drafts against q (their graphs take ef.DRAFT_PROBS): there sampled
requests verify roots only (plain decoding, reproducible); greedy requests draft as always.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime.drafter import Drafter, Proposal, StepResult
from specbuild.runtime.manifest import check_fields, file_name, integer
from specbuild.runtime.sampling import SamplingParams, position_uniforms
from specbuild.runtime.session import Session
from specbuild.tree import Tree


class DraftTiming:
    """A running mean of what one draft token costs (its draft engine call), shared by an engine's sequences."""

    WEIGHT = 0.1

    def __init__(self):
        self.ms = 0.0

    def add(self, ms: float) -> None:
        self.ms = ms if self.ms == 0.0 else self.ms + self.WEIGHT * (ms - self.ms)


@dataclasses.dataclass(frozen=True)
class DraftModelSettings:
    num_draft: int
    engine: Any  # the draft model's runtime/engine.Engine
    vocab_ids: np.ndarray | None  # token id of each row of the draft's logits (None: the whole vocabulary)
    vocab_size: int  # the target's
    timing: DraftTiming = dataclasses.field(default_factory=DraftTiming)
    top_k: int = 1  # tokens verified at each depth of the chain (1: a chain; engines written before the key: 1)
    positions: int = 0  # the target's max_seq_len + 1: the length of a request's table of position uniforms
    coupled: bool = True  # sampled drafts are verified as point masses (False: an older graph that takes a q)
    by_token: np.ndarray | None = None  # the rows of the draft's logits in ascending token id (None: already so)


class DraftModelDrafter(Drafter):
    paid_drafts = True
    SCHEMA = {
        "mode": {
            "drafter": {
                "num_draft_tokens": integer(1),
                "top_k": integer(1, optional=True),
                "engine": file_name(),
                "vocab_ids": file_name(optional=True, nullable=True),
            }
        }
    }

    @classmethod
    def load_settings(cls, engine) -> DraftModelSettings:
        """engine.yaml's drafter fields, and the draft's own engine loaded beside the target's."""
        from specbuild.runtime.engine import Engine

        source = engine.path / ef.ENGINE_MANIFEST
        check_fields(engine.manifest, cls.SCHEMA, str(source))
        fields = engine.manifest["mode"]["drafter"]
        draft_dir = engine.path / fields["engine"]
        # the draft's roundings never change the output (the target decides every token): load it whatever the CPU
        draft = Engine(
            draft_dir, threads=engine.threads or None, allow_lossy=True, speculation="off", shared_cores=True
        )
        vocab = engine.manifest["model"]["vocab_size"]
        ids = by_token = None
        if fields.get("vocab_ids"):
            ids = _read_ids(draft_dir / fields["vocab_ids"], vocab)
            by_token = np.argsort(ids, kind="stable")
        return DraftModelSettings(
            fields["num_draft_tokens"], draft, ids, vocab, top_k=fields.get("top_k", 1),
            positions=engine.layout.max_seq_len + 1, coupled=not engine.layout.draft_probs_vocab, by_token=by_token,
        )  # fmt: skip

    @classmethod
    def narrowed(cls, settings: DraftModelSettings, options: Mapping[str, Any]) -> DraftModelSettings:
        """A request's own chain length (`depth`) and tree width (`top_k`), at most the engine's."""
        fields = {}
        for name, value in options.items():
            field = {"depth": "num_draft", "top_k": "top_k"}.get(name)
            if field is None:
                raise SpecbuildError(f"drafting option {name!r} is not one of depth, top_k (draft-target)")
            built = getattr(settings, field)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= built:
                raise SpecbuildError(
                    f"drafting option {name} must be an integer from 1 to {built} (the engine's), got {value!r}"
                )
            fields[field] = value
        return dataclasses.replace(settings, **fields)

    def __init__(self, settings: DraftModelSettings, prompt: Sequence[int], sampling: SamplingParams | None = None):
        super().__init__(settings, prompt, sampling)
        sampling = sampling or SamplingParams()
        self.sampling = sampling
        self.greedy = sampling.temperature <= 0
        # the target's number for each position (sampled): the draft for position q is drawn with number q
        self.uniforms = None if self.greedy else position_uniforms(sampling.seed, settings.positions)
        engine = settings.engine
        # the draft engine decodes greedily; sampled drafts are drawn here from its logits
        self.session = Session(engine.layout, engine.backend, SamplingParams(), len(prompt) + settings.num_draft + 2)
        self.max_len = engine.layout.max_seq_len
        self.context = list(prompt)  # committed tokens (prompt + accepted)
        self.fed: list[int] = []  # tokens in the draft's cache, in order: a prefix of context, then drafts
        self.drafts: list[int] = []

    def propose(self, step: StepResult) -> Proposal:
        self.context.extend(step.tokens)
        keep = self._kept_prefix()
        del self.fed[keep:]
        self.session.batch.kv.lengths[0] = keep
        pending = self.context[keep:]
        k = min(self.settings.num_draft, self.max_len - keep - len(pending))
        if not self.greedy and not self.settings.coupled:  # an older graph: sampled drafts would take another path
            k = 0
        top_k = self.settings.top_k
        if self.limit is not None:  # the scheduler's budget under load: a narrower tree, then a shorter chain
            budget = self.limit - 1
            k = min(k, budget)
            top_k = max(1, min(top_k, budget // max(k, 1)))
            k = min(k, budget // top_k)
        if k <= 0:
            self.drafts = []
            return Proposal.root(self.context[-1])
        chain, siblings = [self.context[-1]], []
        feed = pending
        before = self.session.engine_s
        for depth in range(1, k + 1):
            logits = self.session.prefill(feed).outputs[ef.LOGITS][0, -1]
            self.fed.extend(feed)
            tokens = self._draw(logits, top_k, position=len(self.context) - 1 + depth)
            chain.append(tokens[0])
            siblings.append(tokens[1:])
            feed = [tokens[0]]
        self.drafts = chain[1:]
        self.settings.timing.add(1000 * (self.session.engine_s - before) / k)
        if top_k == 1:
            return Proposal.chain(chain)
        return self._tree(chain, siblings, top_k)

    def draft_ms(self) -> float:
        return self.settings.timing.ms

    def _kept_prefix(self) -> int:
        """How many tokens of the draft's cache the committed context still starts with: the committed part it was
        fed, plus the drafts the target accepted (only the drafts are compared: O(drafts))."""
        fed, context = self.fed, self.context
        keep = len(fed) - len(self.drafts[:-1]) if self.drafts else len(fed)
        while keep < len(fed) and keep < len(context) and fed[keep] == context[keep]:
            keep += 1
        return keep

    def _draw(self, logits: np.ndarray, count: int, position: int) -> list[int]:
        """The `count` draft tokens for `position` (the chain's first): the draft's most likely tokens, most likely
        first (greedy), or the coupled draw and its nearest neighbours (sampled: `coupled_rows`)."""
        if self.greedy:
            if count == 1:
                rows = [int(np.argmax(logits))]
            else:  # by logit, the lower row first among equals (as argmax)
                top = np.argpartition(-logits, count - 1)[:count]
                rows = top[np.lexsort((top, -logits[top]))].tolist()
        else:
            q = processed_probs(logits, self.sampling)
            u = float(self.uniforms[min(position, len(self.uniforms) - 1)])
            rows = coupled_rows(q, u, count, self.settings.by_token)
        ids = self.settings.vocab_ids
        return [int(ids[r]) if ids is not None else int(r) for r in rows]

    def _tree(self, chain: list[int], siblings: list[list[int]], top_k: int) -> Proposal:
        """The chain with the other tokens of each depth as leaf siblings of its node there (the chain's node first)."""
        tree = _top_k_tree(len(chain) - 1, top_k)
        tokens = [0] * tree.size
        tokens[0] = chain[0]
        for depth in range(1, len(chain)):
            for rank, token in enumerate([chain[depth], *siblings[depth - 1]]):
                tokens[tree.node_index((0,) * (depth - 1) + (rank,))] = token
        return Proposal.from_tree(tokens, tree)


@functools.lru_cache(maxsize=64)
def _top_k_tree(depth: int, top_k: int) -> Tree:
    """`top_k` children at each depth of a chain of `depth`: the first carries the chain on, the others are leaves."""
    return Tree.from_choices([[0] * (d - 1) + [r] for d in range(1, depth + 1) for r in range(top_k)])


def coupled_rows(q: np.ndarray, u: float, count: int, by_token: np.ndarray | None = None) -> list[int]:
    """The rows of q (a distribution over the draft's rows) to draft with the uniform number u: first the inverse CDF
    of q at u over the target's token order (`by_token`: the rows by ascending token id; None: rows are token ids),
    the token the target draws with u where p = q; then the count - 1 rows whose CDF intervals [F - q, F) lie
    nearest u * total (the tokens p's CDF hands u to where it differs a little from q's), nearer and lower first."""
    ordered = q if by_token is None else q[by_token]
    cdf = np.cumsum(ordered, dtype=np.float64)
    v = u * cdf[-1]
    first = min(int(np.searchsorted(cdf, v, side="right")), len(cdf) - 1)
    while ordered[first] <= 0 and first > 0:  # never a token of probability 0 (rounding at the CDF's end)
        first -= 1
    chosen = [first]
    if count > 1:
        distance = np.maximum(cdf - ordered - v, 0.0) + np.maximum(v - cdf, 0.0)  # 0 inside the interval
        distance[first] = np.inf
        near = np.argpartition(distance, count - 2)[: count - 1]
        chosen += near[np.lexsort((near, distance[near]))].tolist()
    return chosen if by_token is None else by_token[chosen].tolist()


def processed_probs(logits: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    """The distribution a sampled request draws from: logits / temperature, then top-k, then top-p (float32)."""
    scaled = logits.astype(np.float64) / max(sampling.temperature, ef.MIN_TEMPERATURE)
    if sampling.top_k and sampling.top_k < len(scaled):
        kth = np.partition(scaled, -sampling.top_k)[-sampling.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if sampling.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        drop = order[before >= sampling.top_p]
        probs[drop] = 0.0
        probs /= probs.sum()
    return probs.astype(np.float32)


def _read_ids(file, vocab: int) -> np.ndarray:
    try:
        ids = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise SpecbuildError(f"{file}: cannot read the draft's token ids ({exc})") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or not len(ids) or ids.min() < 0 or ids.max() >= vocab:
        raise SpecbuildError(f"{file}: expected a list of token ids below the vocabulary size {vocab}")
    return ids.astype(np.int64)

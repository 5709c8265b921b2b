"""The interface every speculative mode implements: graph pieces (drafting), state, static tree, manifest."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from specbuild import engine_format as ef
from specbuild.builder.checkpoint.canonical import build_weights, defaults_for_weights
from specbuild.builder.checkpoint.torch_dtypes import TORCH_DTYPES
from specbuild.errors import SpecbuildError
from specbuild.modes.spec import TYPICAL_ACCEPTANCE
from specbuild.tree import Tree


@dataclasses.dataclass
class StateSpec:
    """A tensor carried between engine calls: input `state_<name>`, output `next_state_<name>`.

    shape uses ints and symbolic names ("B", "C" = the KV capacity, which grows like the base cache along
    `grow_axis`); the runtime creates the initial value filled with `fill`.
    """

    name: str
    shape: tuple
    dtype: str = "float32"
    fill: float = 0.0
    grow_axis: int | None = None

    @property
    def output_name(self) -> str:
        """The graph output that carries the state to the next call (see engine_format)."""
        return (ef.NEW_STATE_PREFIX if self.grow_axis is not None else ef.NEXT_STATE_PREFIX) + self.name


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """A step-graph output a mode adds (its draft of the next call): name (an ef constant), dtype, and shape in
    ints and symbolic names ("B" = the batch, "W" = the acceptance window's tokens, ef.WINDOW)."""

    name: str
    dtype: str
    shape: tuple


@dataclasses.dataclass
class DraftContext:
    """What drafting sees after acceptance (all indices are full new-token indices)."""

    net: Any
    hidden: torch.Tensor  # [B,T,H] final-normed hidden states of the new tokens
    captured: list  # inputs of the layers in plugin.capture_layers, each [B,T,H]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    tree_mask: torch.Tensor  # [B,T,T]
    past_length: torch.Tensor
    accepted_tokens: torch.Tensor  # [B,DP] (-1 padded)
    num_accepted: torch.Tensor  # [B]
    accepted_nodes: torch.Tensor  # [B,DP] (-1 padded)
    last_node: torch.Tensor  # [B]
    bonus: torch.Tensor  # [B] next root token
    states: dict
    draft_rows: torch.Tensor | None = None  # [R] the rows to draft for (ef.DRAFT_ROWS; None: every row)
    logits: torch.Tensor | None = None  # [B,W,V] the acceptance window's logits (the last W new tokens)

    def drafting(self) -> DraftContext:
        """This context narrowed to the rows to draft for (the draft outputs have R rows): a plugin that drafts in
        the graph (`selects_rows`) drafts from it, after committing what every row's state needs."""
        if self.draft_rows is None:
            return self
        pick = self.select_rows
        return dataclasses.replace(
            self,
            hidden=pick(self.hidden),
            captured=[pick(c) for c in self.captured],
            input_ids=pick(self.input_ids),
            position_ids=pick(self.position_ids),
            tree_mask=pick(self.tree_mask),
            past_length=pick(self.past_length),
            accepted_tokens=pick(self.accepted_tokens),
            num_accepted=pick(self.num_accepted),
            accepted_nodes=pick(self.accepted_nodes),
            last_node=pick(self.last_node),
            bonus=pick(self.bonus),
            logits=None if self.logits is None else pick(self.logits),
            states={},
            draft_rows=None,
        )

    def select_rows(self, x: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """x's rows (on its batch axis) that are drafted for."""
        return x if self.draft_rows is None else x.index_select(axis, self.draft_rows)


class ModePlugin(nn.Module):
    """Plain decoding's behaviour; speculative modes override draft(), draft_outputs(), tree(), state_specs().

    Constructed as `Plugin(checkpoint, net, settings)` with the settings check_options resolved."""

    name = "plain"  # the mode's name in messages: each mode's plugin sets its own
    head_key = ""  # the checkpoint's heads this mode drafts with (checkpoint.heads[head_key]; "": none)
    capture_layers: tuple = ()
    # drafting happens in the graph and can be skipped per row: the graph takes ef.DRAFT_ROWS and draft() drafts
    # from ctx.drafting() (its draft outputs have one row per drafted row)
    selects_rows = False

    def draft_outputs(self) -> list[OutputSpec]:
        """The outputs draft() returns besides the state outputs, in graph order (export reads this declaration)."""
        return [OutputSpec(ef.NEXT_INPUT_IDS, "int64", ("B", 1))]

    def state_output_names(self) -> list[str]:
        """The graph outputs of state_specs(), in graph order, after draft_outputs()."""
        return [spec.output_name for spec in self.state_specs()]

    def chain_drafts(self) -> bool:
        """Whether every tree this mode verifies is a chain (ONNX Runtime's causal attention then serves)."""
        tree = self.tree()
        return tree is not None and tree.is_chain

    @classmethod
    def typical_acceptance(cls, options) -> tuple[float, float] | None:
        """(EPS, ALPHA) of typical acceptance (lossy), when the mode reads the option and it is given; None:
        rejection sampling (distribution-preserving)."""
        value = getattr(options, TYPICAL_ACCEPTANCE.name, None)
        if value is None:
            return None
        eps, alpha = value
        if not (0 < eps <= 1 and 0 <= alpha <= 1):
            raise SpecbuildError(
                f"{TYPICAL_ACCEPTANCE.flag} {eps},{alpha} is invalid: expected {TYPICAL_ACCEPTANCE.metavar} with "
                "0 < EPS <= 1 and 0 <= ALPHA <= 1 (e.g. 0.09,0.3)"
            )
        return tuple(value)

    @classmethod
    def check_options(cls, checkpoint, options) -> dict[str, Any]:
        """Resolve this mode's build options and check their bounds from the checkpoint's configs alone (no weights
        are loaded), so a bad value fails before any work. Returns the settings the plugin builds with; the key
        `tokens_per_step` is the largest number of new tokens one engine call verifies (root included)."""
        return {"tokens_per_step": 1}

    @classmethod
    def recorded_defaults(cls, checkpoint, options) -> dict:
        """The build settings the heads' recipe measured fastest for a build with `options` (their
        specbuild_defaults, kept by convert in the heads' `defaults`, with the by_weights entry of the build's
        weights applied); {} without heads."""
        cfg = checkpoint.heads.get(cls.head_key) if cls.head_key else None
        return defaults_for_weights((cfg or {}).get("defaults"), build_weights(checkpoint, options))

    def tree(self) -> Tree | None:
        """The static tree the next call verifies (None for modes whose tree is an engine output)."""
        return Tree.from_choices([])

    def state_specs(self) -> list[StateSpec]:
        return []

    def draft(self, ctx: DraftContext) -> dict[str, torch.Tensor]:
        """Return at least `next_input_ids` [B,N]: the root (bonus) token then the draft nodes."""
        return {ef.NEXT_INPUT_IDS: ctx.bonus.unsqueeze(1)}

    def skipped_draft(self, ctx: DraftContext) -> dict[str, torch.Tensor]:
        """What draft() returns for a call that drafts for no row (`selects_rows` graphs; the step graph runs one or
        the other behind an If on the number of draft rows): the draft outputs with no rows, each growing state's new
        rows (one per new token) at its `fill`, every other state passed through. A mode whose growing state must
        say which positions the drafting saw (EAGLE's draft KV) keeps a flag state of its own for that."""
        b, t = ctx.input_ids.shape
        w = ctx.logits.shape[1] if ctx.logits is not None else 1
        sizes = {"B": 0, "W": w}
        out = {}
        for spec in self.draft_outputs():
            shape = [sizes[d] if isinstance(d, str) else d for d in spec.shape]
            out[spec.name] = torch.zeros(shape, dtype=TORCH_DTYPES[spec.dtype])
        for spec in self.state_specs():
            if spec.grow_axis is None:
                out[spec.output_name] = ctx.states[spec.name].clone()
                continue
            shape = [{"B": b}.get(d, d) if isinstance(d, str) else d for d in spec.shape]
            shape[spec.grow_axis] = t
            out[spec.output_name] = torch.full(shape, spec.fill, dtype=TORCH_DTYPES[spec.dtype])
        return out

    def manifest(self) -> dict[str, Any]:
        return {}

    def companion_engines(self, plan) -> list:
        """Engines built inside this engine's directory beside its step graph: (subdirectory, BuildPlan, network,
        {file name: numpy array written there}) for each (draft-target: the draft model's own engine); their graphs
        are listed with role ef.ROLE_DRAFT."""
        return []

    def max_new_tokens_per_step(self) -> int:
        tree = self.tree()
        return tree.size if tree is not None else 1


class HostDraftedPlugin(ModePlugin):
    """A mode whose runtime drafter proposes each call's tokens and tree (inputs of the step graph, no static tree):
    its settings are what check_options resolved, with at most settings["tokens_per_step"] tokens a call."""

    # the checkpoint is read for the manifest and companion engines, never by the traced step
    # (builder/export/trace_cache.py)
    untraced_attributes = ("checkpoint",)

    def __init__(self, checkpoint, net, settings):
        super().__init__()
        self.checkpoint = checkpoint
        self.settings = settings

    def tree(self):
        return None  # the runtime's drafter gives each call's tokens and tree

    def max_new_tokens_per_step(self) -> int:
        return self.settings["tokens_per_step"]

"""The one step graph: base network -> tree acceptance -> mode drafting, as a torch module to export.

Two graph layouts share everything but how the KV cache is passed: `StepModule` (portable, standard ops, the cache
stacked in one input and the new entries in one output) and `FusedStepModule` (ONNX Runtime's fused kernels, one
in-place buffer per layer and kind). Each layout says where its inputs go (`arrange`), so that export builds the
example inputs, the dynamic shapes and the I/O names from the same parts without asking which layout it has.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils import _pytree

from specbuild import engine_format as ef
from specbuild.builder.network.acceptance import accept, accept_root, branch
from specbuild.builder.network.mode_plugin import DraftContext, ModePlugin
from specbuild.errors import SpecbuildError

HEAD_INPUTS = [ef.INPUT_IDS, ef.POSITION_IDS, ef.TREE_MASK, ef.PAST_LENGTH]
SAMPLING_INPUTS = [ef.TEMPERATURE, ef.TOP_K, ef.TOP_P, ef.RAND_ACCEPT, ef.RAND_SAMPLE]
ACCEPTANCE_OUTPUTS = [ef.ACCEPTED_TOKENS, ef.NUM_ACCEPTED, ef.ACCEPTED_NODES]


class StepModule(nn.Module):
    """The portable step graph. forward(input_ids, position_ids, tree_mask, past_length, kv_cache, paths,
    temperature, top_k, top_p, rand_accept, rand_sample, [rope_long], *states) -> (accepted_tokens, num_accepted,
    accepted_nodes, new_kv, *plugin outputs, [logits]).

    The logits/acceptance window is the last W new tokens, W = rand_accept.shape[1] (ef.WINDOW): the whole tree in
    decode, only the last prompt token in prefill (so prefill never computes a [T,V] logits matrix it does not need).
    """

    row_padding = False  # a min_rows input (FusedStepModule only)

    def __init__(self, net, plugin: ModePlugin, output_logits: bool = False, typical: tuple | None = None):
        super().__init__()
        self.net = net
        self.plugin = plugin
        self.output_logits = output_logits
        self.typical = typical
        self.state_names = [s.name for s in plugin.state_specs()]
        self.draft_output_names = [o.name for o in plugin.draft_outputs()] + plugin.state_output_names()
        self.selects_rows = plugin.selects_rows  # an ef.DRAFT_ROWS input, last
        # a mode that never drafts verifies a lone root: the acceptance block reduces to drawing the next token
        self.root_only = plugin.max_new_tokens_per_step() == 1 and typical is None

    # ---- the layout: where the KV cache goes (export reads these)
    def arrange(
        self, head: list, kv: list, paths: list, sampling: list, min_rows: list, states: list, rows: list, rope: list
    ):
        """(fixed inputs, var-positional inputs) in forward's order, from the parts of one call (rows: the
        draft_rows input, taken where `selects_rows`; rope: the rope_long input, where the network takes it)."""
        return [*head, *kv, *paths, *sampling], [*self._rope(rope), *states, *(rows if self.selects_rows else [])]

    def _rope(self, rope: list) -> list:
        return rope if self.net.long_rope else []

    def split_rope(self, tail) -> tuple[torch.Tensor | None, tuple]:
        """(rope_long or None, the rest) from the start of forward's var-positional inputs after the step padding."""
        return (tail[0], tail[1:]) if self.net.long_rope else (None, tail)

    def split_states(self, tail) -> tuple[list, torch.Tensor | None]:
        """(mode states, draft_rows or None) from the end of forward's var-positional inputs."""
        tail = list(tail)
        rows = tail.pop() if self.selects_rows else None
        return tail, rows

    def kv_inputs(self, kv: torch.Tensor) -> list:
        """The KV cache [L,2,B,Hkv,C,D] as this layout takes it."""
        return [kv]

    def kv_input_names(self) -> list[str]:
        return [ef.KV_CACHE]

    def kv_output_names(self) -> list[str]:
        return [ef.NEW_KV]

    def kv_dims(self, batch, capacity) -> list[dict]:
        return [{2: batch, 4: capacity}]

    def output_names(self) -> list[str]:
        logits = [ef.LOGITS] if self.output_logits else []
        return ACCEPTANCE_OUTPUTS + self.kv_output_names() + self.draft_output_names + logits

    def forward(
        self,
        input_ids,
        position_ids,
        tree_mask,
        past_length,
        kv_cache,
        paths,
        temperature,
        top_k,
        top_p,
        rand_accept,
        rand_sample,
        *states,
    ):
        long_rope, states = self.split_rope(states)
        hidden, new_kv, captured = self.net(
            input_ids, position_ids, tree_mask, past_length, kv_cache, self.plugin.capture_layers, long_rope
        )
        states, draft_rows = self.split_states(states)
        return self.accept_and_draft(
            hidden, captured, [new_kv], input_ids, position_ids, tree_mask, past_length, paths,
            (temperature, top_k, top_p, rand_accept, rand_sample), states, draft_rows=draft_rows,
        )  # fmt: skip

    def accept_and_draft(
        self, hidden, captured, kv_out, input_ids, position_ids, tree_mask, past_length, paths, sampling, states,
        min_rows=None, draft_rows=None,
    ):  # fmt: skip
        """Verification of the new tokens' tree, acceptance and the mode's drafting of the next tree (both graphs):
        the graph's outputs in output_names() order.

        min_rows: as in the network's forward_fused, the lm_head sees at least M rows (copies of the window's last)."""
        temperature, top_k, top_p, rand_accept, rand_sample = sampling
        t = input_ids.shape[1]
        w = rand_accept.shape[1]  # ef.WINDOW
        off = t - w
        window = hidden.narrow(1, off, w)
        if min_rows is None:
            logits = self.net.logits(window)
        else:
            rows = torch.arange(torch.sym_max(w, min_rows.shape[0])).clamp(max=w - 1)
            logits = self.net.logits(window.index_select(1, rows)).narrow(1, 0, w)
        if self.root_only:
            acc_tokens, num_acc, acc_nodes_w, last_w = accept_root(logits, temperature, top_k, top_p, rand_accept)
        else:
            tree = (  # the window's tokens, their mask and the paths in window indices
                input_ids.narrow(1, off, w),
                tree_mask.narrow(1, off, w).narrow(2, off, w),
                torch.where(paths >= 0, paths - off, torch.full_like(paths, -1)),
            )
            sampling = (temperature, top_k, top_p, rand_accept, rand_sample)
            acc_tokens, num_acc, acc_nodes_w, last_w = accept(logits, *tree, *sampling, typical=self.typical)
        acc_nodes = torch.where(acc_nodes_w >= 0, acc_nodes_w + off, torch.full_like(acc_nodes_w, -1))
        ctx = DraftContext(
            net=self.net,
            hidden=hidden,
            captured=captured,
            input_ids=input_ids,
            tree_mask=tree_mask,
            position_ids=position_ids,
            past_length=past_length,
            accepted_tokens=acc_tokens,
            num_accepted=num_acc,
            accepted_nodes=acc_nodes,
            last_node=last_w + off,
            bonus=acc_tokens.gather(1, (num_acc - 1).unsqueeze(1)).squeeze(1),
            states=dict(zip(self.state_names, states)),
            draft_rows=draft_rows,
            logits=logits,
        )
        drafted = self.draft(ctx)
        logits_out = [logits] if self.output_logits else []
        return (acc_tokens, num_acc, acc_nodes, *kv_out, *drafted, *logits_out)

    def draft(self, ctx: DraftContext) -> list:
        """The mode's draft outputs and states (draft_output_names order). A graph that drafts per row runs the
        drafting behind one If on the number of draft rows: a call that drafts for none (plain decoding under load)
        costs what the `none` graph costs, the mode's skipped_draft() giving its outputs."""
        if ctx.draft_rows is None:
            return self._declared(self.plugin.draft(ctx))
        fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx) if f.name != "net"}
        leaves, spec = _pytree.tree_flatten(fields)

        def on(fn):
            def run(*args):
                return self._declared(fn(dataclasses.replace(ctx, **_pytree.tree_unflatten(list(args), spec))))

            return run

        drafting = torch.ones_like(ctx.draft_rows).sum() > 0
        return branch(drafting, on(self.plugin.draft), on(self.plugin.skipped_draft), leaves, module=self)

    def _declared(self, drafted: dict) -> list:
        if set(drafted) != set(self.draft_output_names):
            raise SpecbuildError(
                f"the {self.plugin.name} plugin drafted {sorted(drafted)} but declares "
                f"{sorted(self.draft_output_names)} (draft_outputs() and state_specs())"
            )
        return [drafted[n] for n in self.draft_output_names]


class FusedStepModule(StepModule):
    """The step graph for ONNX Runtime: the same acceptance and drafting over the network's fused form.

    forward(input_ids, position_ids, tree_mask, past_length, paths, temperature, top_k, top_p, rand_accept,
    rand_sample, [min_rows], [rope_long], past_key_0, past_value_0, ..., *states) -> (accepted_tokens, num_accepted,
    accepted_nodes, present_key_0, present_value_0, ..., *plugin outputs, [logits]). Each present buffer is its past
    buffer with the new tokens' keys/values written at [past_length, past_length + T) (the runtime binds them to one
    buffer). min_rows (row_padding graphs): its length M pads every call to at least M rows (ort_kernels).
    """

    def __init__(
        self,
        net,
        plugin: ModePlugin,
        output_logits: bool = False,
        typical=None,
        attention_pad: int = 0,
        chain_drafts: bool = False,
        row_padding: bool = False,
    ):
        super().__init__(net, plugin, output_logits=output_logits, typical=typical)
        self.attention_pad = attention_pad  # copies a one-token call attends after its token (ort_kernels: padding)
        self.row_padding = row_padding  # a min_rows input: the runtime pads every call to at least M rows
        # every call's tokens form a causal chain at positions past..past+T-1 (plain decoding, chain drafts): the
        # attention kernel's own causal mask and positions serve, without the mask's ~25 nodes and bias reads
        self.causal_chain = chain_drafts or plugin.max_new_tokens_per_step() == 1

    def arrange(
        self, head: list, kv: list, paths: list, sampling: list, min_rows: list, states: list, rows: list, rope: list
    ):
        padding = list(min_rows) if self.row_padding else []
        drafted = rows if self.selects_rows else []
        return [*head, *paths, *sampling], [*padding, *self._rope(rope), *kv, *states, *drafted]

    def kv_inputs(self, kv: torch.Tensor) -> list:
        return [kv[i, j].clone() for i in range(kv.shape[0]) for j in range(2)]

    def kv_input_names(self) -> list[str]:
        return [name.format(i) for i in range(len(self.net.layers)) for name in (ef.PAST_KEY, ef.PAST_VALUE)]

    def kv_output_names(self) -> list[str]:
        return [name.format(i) for i in range(len(self.net.layers)) for name in (ef.PRESENT_KEY, ef.PRESENT_VALUE)]

    def kv_dims(self, batch, capacity) -> list[dict]:
        return [{0: batch, 2: capacity}] * (2 * len(self.net.layers))

    def forward(
        self,
        input_ids,
        position_ids,
        tree_mask,
        past_length,
        paths,
        temperature,
        top_k,
        top_p,
        rand_accept,
        rand_sample,
        *buffers_and_states,
    ):
        min_rows = buffers_and_states[0] if self.row_padding else None
        tail = buffers_and_states[1:] if self.row_padding else buffers_and_states
        long_rope, tail = self.split_rope(tail)
        n_kv = 2 * len(self.net.layers)
        hidden, presents, captured = self.net.forward_fused(
            input_ids,
            position_ids,
            tree_mask,
            past_length,
            list(tail[:n_kv]),
            capture_layers=self.plugin.capture_layers,
            causal_chain=self.causal_chain,
            attention_pad=self.attention_pad,
            min_rows=min_rows,
            long_rope=long_rope,
        )
        states, draft_rows = self.split_states(tail[n_kv:])
        return self.accept_and_draft(
            hidden, captured, presents, input_ids, position_ids, tree_mask, past_length, paths,
            (temperature, top_k, top_p, rand_accept, rand_sample), states, min_rows, draft_rows,
        )  # fmt: skip

"""The one step graph: base network -> tree acceptance -> mode drafting, as a torch module to export."""

from __future__ import annotations

import torch
from torch import nn

from specbuild import engine_format as ef
from specbuild.builder.acceptance import accept, accept_root
from specbuild.plugins.base import DraftContext, ModePlugin

BASE_INPUTS = [
    ef.INPUT_IDS,
    ef.POSITION_IDS,
    ef.TREE_MASK,
    ef.PAST_LENGTH,
    ef.KV_CACHE,
    ef.PATHS,
    ef.TEMPERATURE,
    ef.TOP_K,
    ef.TOP_P,
    ef.RAND_ACCEPT,
    ef.RAND_SAMPLE,
]
BASE_OUTPUTS = [ef.ACCEPTED_TOKENS, ef.NUM_ACCEPTED, ef.ACCEPTED_NODES, ef.NEW_KV]


class StepModule(nn.Module):
    """forward(*BASE_INPUTS, *states) -> (*BASE_OUTPUTS, *plugin outputs, [logits]).

    The logits/acceptance window is the last W = rand_accept.shape[1] new tokens: the whole tree in decode,
    only the last prompt token in prefill (so prefill never computes a [T,V] logits matrix it does not need).
    """

    def __init__(self, net, plugin: ModePlugin, output_logits: bool = False, typical: tuple | None = None):
        super().__init__()
        self.net = net
        self.plugin = plugin
        self.output_logits = output_logits
        self.typical = typical
        self.state_names = [s.name for s in plugin.state_specs()]
        self.draft_output_names: list[str] = []
        # a mode that never drafts verifies a lone root: the acceptance block reduces to drawing the next token
        self.root_only = plugin.max_new_tokens_per_step() == 1 and typical is None

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
        hidden, new_kv, captured = self.net(
            input_ids, position_ids, tree_mask, past_length, kv_cache, capture_layers=self.plugin.capture_layers
        )
        acc_tokens, num_acc, acc_nodes, drafted, logits = self.accept_and_draft(
            hidden, captured, input_ids, position_ids, tree_mask, past_length, paths,
            (temperature, top_k, top_p, rand_accept, rand_sample), states,
        )  # fmt: skip
        outs = [acc_tokens, num_acc, acc_nodes, new_kv, *drafted.values()]
        if self.output_logits:
            outs.append(logits)
        return tuple(outs)

    def accept_and_draft(
        self, hidden, captured, input_ids, position_ids, tree_mask, past_length, paths, sampling, states, min_rows=None
    ):
        """Verification of the new tokens' tree, acceptance and the mode's drafting of the next tree (both graphs).

        min_rows: as in the network's forward_fused, the lm_head sees at least M rows (copies of the window's last)."""
        temperature, top_k, top_p, rand_accept, rand_sample = sampling
        t = input_ids.shape[1]
        w = rand_accept.shape[1]
        off = t - w
        window = hidden.narrow(1, off, w)
        if min_rows is None:
            logits = self.net.lm_head(window)
        else:
            rows = torch.arange(torch.sym_max(w, min_rows.shape[0])).clamp(max=w - 1)
            logits = self.net.lm_head(window.index_select(1, rows)).narrow(1, 0, w)
        if self.root_only:
            acc_tokens, num_acc, acc_nodes_w, last_w = accept_root(logits, temperature, top_k, top_p, rand_sample)
        else:
            acc_tokens, num_acc, acc_nodes_w, last_w = accept(
                logits,
                input_ids.narrow(1, off, w),
                tree_mask.narrow(1, off, w).narrow(2, off, w),
                torch.where(paths >= 0, paths - off, torch.full_like(paths, -1)),
                temperature,
                top_k,
                top_p,
                rand_accept,
                rand_sample,
                typical=self.typical,
            )
        acc_nodes = torch.where(acc_nodes_w >= 0, acc_nodes_w + off, torch.full_like(acc_nodes_w, -1))
        last_node = last_w + off
        bonus = acc_tokens.gather(1, (num_acc - 1).unsqueeze(1)).squeeze(1)
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
            last_node=last_node,
            bonus=bonus,
            states=dict(zip(self.state_names, states)),
        )
        drafted = self.plugin.draft(ctx)
        self.draft_output_names = list(drafted)
        return acc_tokens, num_acc, acc_nodes, drafted, logits


class FusedStepModule(StepModule):
    """The step graph for ONNX Runtime: the same acceptance and drafting over the network's fused form.

    forward(input_ids, position_ids, tree_mask, past_length, paths, temperature, top_k, top_p, rand_accept,
    rand_sample, [min_rows], past_key_0, past_value_0, ..., *states) -> (accepted_tokens, num_accepted,
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
        min_rows = None
        if self.row_padding:
            min_rows, buffers_and_states = buffers_and_states[0], buffers_and_states[1:]
        n_kv = 2 * len(self.net.layers)
        kv, states = buffers_and_states[:n_kv], buffers_and_states[n_kv:]
        hidden, presents, captured = self.net.forward_fused(
            input_ids,
            position_ids,
            tree_mask,
            past_length,
            list(kv),
            capture_layers=self.plugin.capture_layers,
            causal_chain=self.causal_chain,
            attention_pad=self.attention_pad,
            min_rows=min_rows,
        )
        acc_tokens, num_acc, acc_nodes, drafted, logits = self.accept_and_draft(
            hidden, captured, input_ids, position_ids, tree_mask, past_length, paths,
            (temperature, top_k, top_p, rand_accept, rand_sample), states, min_rows,
        )  # fmt: skip
        outs = [acc_tokens, num_acc, acc_nodes, *presents, *drafted.values()]
        if self.output_logits:
            outs.append(logits)
        return tuple(outs)

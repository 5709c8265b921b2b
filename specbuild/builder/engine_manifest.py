"""engine.yaml from the build plan, the mode plugin and the graph entries (schema: runtime/manifest.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from specbuild import __version__
from specbuild import engine_format as ef
from specbuild.builder.export.weights_file import WEIGHTS_FILE
from specbuild.builder.plan import BuildPlan


def write_manifest(plan: BuildPlan, plugin, graphs: list[dict], directory: Path, build_seconds: float) -> dict:
    """Write directory/engine.yaml after every other file (its checksums cover them); return its contents."""
    from specbuild.runtime.integrity import record_files

    manifest = engine_fields(plan, plugin, graphs, directory)
    manifest["build_seconds"] = build_seconds
    manifest["checksums"] = record_files(directory)  # size + sha256 of every file written before (load checks sizes)
    (directory / ef.ENGINE_MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
    return manifest


def engine_fields(plan: BuildPlan, plugin, graphs: list[dict], directory: Path) -> dict:
    lossy = lossy_reason(plan, plugin.chain_drafts())
    tree = plugin.tree()
    return {
        "format": ef.ENGINE_FORMAT,
        "format_version": ef.ENGINE_FORMAT_VERSION,
        "specbuild_version": __version__,
        "speculative_mode": plan.mode,
        "dtype": plan.engine_dtype,
        "checkpoint_dtype": plan.checkpoint.dtype,
        "lossless": lossy is None,
        "lossy_reason": lossy,
        # int8 activations or an int8 cache: exact only where the kernels are row-invariant (with padding), checked at
        # every load; branching trees there also on specbuild's ordered attention (runtime/kernels)
        "lossless_condition": lossless_condition(plan, plugin.chain_drafts()) if lossy is None else None,
        ef.NEEDS_ORDERED_ATTENTION: needs_ordered_attention(plan, plugin.chain_drafts()) and lossy is None,
        "typical_acceptance": list(plan.typical) if plan.typical else None,
        # sampled acceptance draws the token at sequence position q from the request's uniform number q, so a seeded
        # request gives the same tokens alone or batched, whatever was drafted (builder/network/acceptance.py)
        "sampling": {"uniforms": ef.UNIFORMS_PER_POSITION},
        "model": model_fields(plan.model),
        "limits": {
            "max_seq_len": plan.max_seq_len,
            "max_batch_size": plan.options.max_batch_size,
            "max_new_tokens_per_step": plugin.max_new_tokens_per_step(),
            # LongRoPE: sequences longer than this rotate with the long factors, their cache recomputed once
            **({ef.ROPE_SWITCH: plan.rope_switch} if plan.rope_switch is not None else {}),
        },
        "tree": {"choices": tree.to_list(), "size": tree.size, "depth": tree.depth}
        if tree is not None
        else {"dynamic": True},
        "mode": plugin.manifest(),
        "states": [dataclasses.asdict(s) for s in plugin.state_specs()],
        "graphs": graphs,
        "files": {
            "tokenizer": ef.TOKENIZER_FILE if (directory / ef.TOKENIZER_FILE).is_file() else None,
            "plan": ef.ENGINE_PLAN if (directory / ef.ENGINE_PLAN).is_file() else None,
        },
        "chat_template": plan.checkpoint.chat_template,
        "validation": {
            "max_abs_diff": max(g["validation"]["max_abs_diff"] for g in graphs),
            "tolerance": plan.tolerance,
            # calls whose token outputs differed where torch chose at a near-tie (validation.validate_export)
            "near_ties": sum(g["validation"].get("near_ties", 0) for g in graphs),
        },
        "weights": {
            "precision": plan.weights,
            "activations": "int8" if plan.options.int8_activations else "float",
            # int8: the onnxruntime graph's KV cache in 8 bits (builder/quantize/kv_int8.py)
            ef.GRAPH_KV_CACHE_DTYPE: plan.options.kv_cache,
            # heads and draft layers: the engine's float dtype unless --head-weights or the heads' recorded choice
            # quantizes them (onnxruntime graph only: plan.resolve_head_weights)
            "mode_weights": plan.head_weights or plan.engine_dtype,
            "file": WEIGHTS_FILE,
            "bytes": (directory / WEIGHTS_FILE).stat().st_size,
        },
    }


def model_fields(cfg) -> dict:
    return {
        "architecture": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "sliding_window": cfg.sliding_window if cfg.sliding_layers else None,
        "sliding_layers": cfg.sliding_layers,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_ids": cfg.eos_token_ids,
    }


def needs_ordered_attention(plan: BuildPlan, chain_drafts: bool) -> bool:
    """Branching trees with int8 activations or an int8 KV cache: a tree node's keys sit in other cache columns than
    in one-token decoding, and only an attention that reduces them in position order (runtime/kernels) gives the node
    the bits decoding gives the token -- ONNX Runtime's sums them in column order, and the int8 roundings that follow
    (of the next layer's input, of the keys and values cached) turn the difference into other tokens."""
    return (plan.options.int8_activations or plan.options.kv_cache == ef.KV_CACHE_INT8) and not chain_drafts


def lossless_condition(plan: BuildPlan, chain_drafts: bool) -> str | None:
    if needs_ordered_attention(plan, chain_drafts):
        return "specbuild's ordered attention and row-invariant kernels on the running CPU, checked at load"
    if plan.options.int8_activations or plan.options.kv_cache == ef.KV_CACHE_INT8:
        return "row-invariant kernels on the running CPU, probed at load"
    return None


def lossy_reason(plan: BuildPlan, chain_drafts: bool) -> str | None:
    if plan.typical is not None:
        return "typical acceptance (not distribution-preserving)"
    return None

"""What a session needs to know of its engine, read once at load: the KV cache and mode-state layout, the lengths,
and the rows every call is padded to. Immutable: the batch, its staging prefills and every sequence share one."""

from __future__ import annotations

import dataclasses

import numpy as np

from specbuild import engine_format as ef

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "bool": np.bool_, "int8": np.int8}


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """One mode state (engine.yaml `states`): shape with 1 for the batch and 0 for the capacity dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: type
    fill: float
    grow_axis: int | None  # the axis that grows like the KV cache (None: replaced whole every call)
    batch_axis: int  # the axis of the sequences (engine.yaml "B")


@dataclasses.dataclass(frozen=True)
class Layout:
    kv_cache: str  # ef.KV_STACKED or ef.KV_SHARED
    num_layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: type
    max_seq_len: int
    step_tokens: int  # the most tokens one call verifies (limits.max_new_tokens_per_step)
    min_rows: int  # every call is padded to this many rows (row-invariant kernels, runtime/exactness.py)
    scratch_rows: int  # rows the graph writes after each call's tokens: the cache keeps room for them
    states: tuple[StateLayout, ...]
    max_batch_size: int  # KV slots (limits.max_batch_size; 1 for engines built before batching)
    per_position_uniforms: (
        bool  # sampling.uniforms: rand_accept is drawn per sequence position (builder/network/acceptance)
    )
    selects_rows: bool  # the graph drafts only for the rows in ef.DRAFT_ROWS (engine-drafted modes built since)
    draft_probs_vocab: int = 0  # V of the graph's ef.DRAFT_PROBS input [B,W,V] (0: the graph has none)
    # LongRoPE: a sequence longer than this rotates with the long factors (the graph's ef.ROPE_LONG); None: no switch
    rope_switch: int | None = None

    @classmethod
    def read(cls, manifest: dict, graph: dict, min_rows: int) -> Layout:
        """From a validated engine.yaml, the graph entry the backend runs and the padding exactness decided."""
        model, inputs = manifest["model"], graph["io"]["inputs"]
        float_dtype = NUMPY_DTYPES["float16" if manifest["dtype"] == "float16" else "float32"]
        kv_dtype = kv_cache_dtype(graph) or float_dtype
        return cls(
            kv_cache=graph["kv_cache"],
            num_layers=model["num_layers"],
            kv_heads=model["num_kv_heads"],
            head_dim=model["head_dim"],
            kv_dtype=kv_dtype,
            max_seq_len=int(manifest["limits"]["max_seq_len"]),
            step_tokens=int(manifest["limits"]["max_new_tokens_per_step"]),
            min_rows=min_rows,
            scratch_rows=max(int(graph.get("attention_pad_rows", 0)), min_rows - 1),
            states=tuple(_state(spec, float_dtype) for spec in manifest.get("states") or []),
            max_batch_size=int(manifest["limits"].get("max_batch_size", 1)),
            per_position_uniforms=(manifest.get("sampling") or {}).get("uniforms") == ef.UNIFORMS_PER_POSITION,
            selects_rows=_takes(inputs, ef.DRAFT_ROWS),
            draft_probs_vocab=model["vocab_size"] if _takes(inputs, ef.DRAFT_PROBS) else 0,
            rope_switch=manifest["limits"].get(ef.ROPE_SWITCH) if _takes(inputs, ef.ROPE_LONG) else None,
        )

    @property
    def max_capacity(self) -> int:
        return self.max_seq_len + self.scratch_rows

    @property
    def shared_kv(self) -> bool:
        return self.kv_cache == ef.KV_SHARED

    def long_rope(self, length: int) -> bool:
        """Whether a sequence of `length` tokens rotates with LongRoPE's long factors (all its positions)."""
        return self.rope_switch is not None and length > self.rope_switch


def _takes(inputs: list[dict], name: str) -> bool:
    return any(i["name"] == name for i in inputs)


def kv_cache_dtype(graph: dict):
    """The numpy dtype of a graph's KV cache where it is not the engine's float dtype (graphs[].kv_cache_dtype), or
    None."""
    name = graph.get(ef.GRAPH_KV_CACHE_DTYPE, ef.KV_CACHE_FLOAT)
    return None if name == ef.KV_CACHE_FLOAT else NUMPY_DTYPES[name]


def _state(spec: dict, float_dtype) -> StateLayout:
    dtype = NUMPY_DTYPES[spec["dtype"]]
    if spec["dtype"] == "float32" and float_dtype == np.float16:
        dtype = np.float16  # float states follow the engine's dtype
    shape = tuple(1 if d == "B" else (0 if d == "C" else d) for d in spec["shape"])
    batch_axis = spec["shape"].index("B") if "B" in spec["shape"] else 0
    return StateLayout(spec["name"], shape, dtype, spec.get("fill", 0), spec.get("grow_axis"), batch_axis)


def kv_memory(manifest: dict) -> dict[str, int]:
    """Bytes the engine's caches take: per position of one sequence (base KV + growing mode states), per KV slot at
    max_seq_len, and for every slot (limits.max_batch_size) at max_seq_len -- what a full batch of full-length
    sequences holds."""
    model, limits = manifest["model"], manifest["limits"]
    itemsize = 2 if manifest["dtype"] == "float16" else 4
    kv_dtypes = [kv_cache_dtype(g) for g in manifest["graphs"] if g["role"] == ef.ROLE_TARGET]
    kv_itemsize = max((itemsize if d is None else np.dtype(d).itemsize for d in kv_dtypes), default=itemsize)
    per_position = model["num_layers"] * 2 * model["num_kv_heads"] * model["head_dim"] * kv_itemsize
    for spec in manifest.get("states") or []:
        if spec.get("grow_axis") is not None:
            size = int(np.prod([d for d in spec["shape"] if not isinstance(d, str)]))
            per_position += size * (itemsize if spec["dtype"] in ("float32", "float16") else 8)
    slots = int(limits.get("max_batch_size", 1))
    per_slot = per_position * int(limits["max_seq_len"])
    return {"per_position": per_position, "per_slot": per_slot, "slots": slots, "all_slots": per_slot * slots}

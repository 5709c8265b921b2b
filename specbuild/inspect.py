"""`specbuild inspect PATH`: describe a canonical checkpoint or an engine directory as a dict, and render it with rich.

Reads only metadata (config.yaml / engine.yaml and safetensors headers); never loads weights or an engine session.
Loading an engine's manifest checks the recorded file sizes; `verify=True` (`inspect --verify`) also reads every
engine file and checks its sha256 against engine.yaml. For an engine whose exactness depends on the CPU (int8
activations), `this_machine` says what holds here: the row-invariance probe's verdict (runtime/exactness.py), kept
in the user cache after its first measurement.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def describe(path, verify: bool = False) -> dict[str, Any]:
    """A JSON-serializable description of a checkpoint (config.yaml) or engine (engine.yaml) directory.

    verify: check every engine file's sha256 against engine.yaml (a SpecbuildError names the first mismatch).
    """
    path = Path(path)
    if not path.exists():
        raise SpecbuildError(f"{path}: does not exist")
    if (path / ef.ENGINE_MANIFEST).is_file():
        return describe_engine(path, verify=verify)
    if (path / ef.CHECKPOINT_CONFIG).is_file():
        if verify:
            raise SpecbuildError(f"{path}: --verify checks engine directories; a checkpoint records no checksums")
        return describe_checkpoint(path)
    raise SpecbuildError(
        f"{path}: neither a specbuild engine ({ef.ENGINE_MANIFEST}) nor a checkpoint ({ef.CHECKPOINT_CONFIG})"
    )


def safetensors_summary(file: Path) -> dict[str, Any]:
    """Tensor count, dtypes and byte size from a safetensors header (the 8-byte length + JSON header)."""
    try:
        with open(file, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecbuildError(f"{file}: cannot read the safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    dtypes: dict[str, int] = {}
    nbytes = params = 0
    for info in header.values():
        start, end = info["data_offsets"]
        nbytes += end - start
        count = 1
        for d in info["shape"]:
            count *= d
        params += count
        dtypes[info["dtype"]] = dtypes.get(info["dtype"], 0) + 1
    return {"file": file.name, "tensors": len(header), "parameters": params, "bytes": nbytes, "dtypes": dtypes}


def describe_checkpoint(path: Path) -> dict[str, Any]:
    from specbuild.builder.checkpoint.canonical import Checkpoint

    ckpt = Checkpoint.load(path)
    m = ckpt.model
    weights = safetensors_summary(path / ef.CHECKPOINT_WEIGHTS)
    heads = {}
    for name, cfg in ckpt.heads.items():
        file = path / ef.HEADS_DIR / f"{name}.safetensors"
        heads[name] = {"config": cfg, **(safetensors_summary(file) if file.is_file() else {"missing": str(file)})}
    return {
        "kind": "checkpoint",
        "path": str(path),
        "architecture": m.architecture,
        "layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_heads": m.num_heads,
        "num_kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab_size,
        "dtype": ckpt.dtype,
        "tie_word_embeddings": m.tie_word_embeddings,
        "rope": {"theta": m.rope_theta, "scaling": m.rope_scaling},
        "sliding_window": {"window": m.sliding_window, "layers": m.sliding_layers} if m.sliding_layers else None,
        "biases": {"qkv": m.attention_bias, "o_proj": m.o_proj_bias, "mlp": m.mlp_bias},
        "max_position_embeddings": m.max_position_embeddings,
        "eos_token_ids": m.eos_token_ids,
        "heads": heads,
        "tensors": weights["tensors"] + sum(h.get("tensors", 0) for h in heads.values()),
        "bytes": weights["bytes"] + sum(h.get("bytes", 0) for h in heads.values()),
        "weights": weights,
        "tokenizer": ckpt.tokenizer_file is not None,
        "chat_template": ckpt.chat_template is not None,
    }


def _window(sliding: dict | None) -> str:
    if not sliding:
        return "none (full attention)"
    return f"{sliding['window']} tokens on layers {', '.join(map(str, sliding['layers']))}"


def _files(path: Path) -> dict[str, int]:
    """Every file of the directory, subdirectories' (a draft model's engine) included, by relative path."""
    return {p.relative_to(path).as_posix(): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def _role_memory(path: Path, man: dict) -> dict[str, dict]:
    """KV memory of the graphs of other roles (a draft model's engine in its own directory), by role."""
    from specbuild.runtime.layout import kv_memory
    from specbuild.runtime.manifest import load_manifest

    out = {}
    for graph in man["graphs"]:
        if graph["role"] != ef.ROLE_TARGET and graph["role"] not in out:
            out[graph["role"]] = kv_memory(load_manifest(path / Path(graph["file"]).parent))
    return out


# what describe_engine shows of each engine.yaml graph entry (and its io)
GRAPH_FIELDS = ("role", "backend", "file", "kv_cache", ef.GRAPH_KV_CACHE_DTYPE, "weights", "head_quantization",
                "kv_quantization", "validation")  # fmt: skip


def describe_engine(path: Path, verify: bool = False) -> dict[str, Any]:
    from specbuild.runtime import exactness
    from specbuild.runtime.backends.base import resolve_threads
    from specbuild.runtime.backends.factory import select_graph
    from specbuild.runtime.integrity import verify_hashes
    from specbuild.runtime.layout import kv_memory
    from specbuild.runtime.manifest import load_manifest

    man = load_manifest(path)  # schema + recorded sizes
    checksums = man["checksums"]
    verified = dict(verify_hashes(path, checksums)) if verify else None
    graph = select_graph(man, ef.BACKEND_ONNXRUNTIME, path)
    here = exactness.decide(path, man, graph, ef.BACKEND_ONNXRUNTIME, resolve_threads(), allow_lossy=True)
    tree = man.get("tree") or {}
    tree_info = {"dynamic": True} if tree.get("dynamic") else {"size": tree.get("size"), "depth": tree.get("depth")}
    files = _files(path)
    return {
        "kind": "engine",
        "path": str(path),
        "format_version": man.get("format_version"),
        "specbuild_version": man.get("specbuild_version"),
        "speculative_mode": man.get("speculative_mode"),
        "dtype": man.get("dtype"),
        "lossless": man.get("lossless", True),
        "lossy_reason": man.get("lossy_reason"),
        "this_machine": here.to_dict(),  # ONNX Runtime on this CPU
        "typical_acceptance": man.get("typical_acceptance"),
        "model": man.get("model"),
        "limits": man.get("limits"),
        "kv_memory": kv_memory(man),
        "role_kv_memory": _role_memory(path, man),
        "tree": tree_info,
        "mode": man.get("mode") or {},
        "states": man.get("states") or [],
        "graphs": [{k: g.get(k) for k in GRAPH_FIELDS} | {"io": g.get("io")} for g in man["graphs"]],
        "files": files,
        "checksums": checksums,
        "verified": sorted(verified) if verified is not None else None,
        "total_bytes": sum(files.values()),
        "plan": (man.get("files") or {}).get("plan"),
        "validation": man.get("validation"),
        "build_seconds": man.get("build_seconds"),
    }


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _shape(shape) -> str:
    from rich.markup import escape

    return escape("[" + ", ".join(str(d) for d in shape) + "]")


def make_console():
    """A rich Console; when stdout is not a terminal (a pipe, a file), wide enough that tables do not wrap."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def render(info: dict[str, Any], console=None) -> None:
    """Print `describe()` output as rich tables."""
    from rich.table import Table

    console = console or make_console()
    kv = Table(show_header=False, title=f"{info['kind']}: {info['path']}", title_justify="left")
    kv.add_column(style="bold")
    kv.add_column()
    if info["kind"] == "checkpoint":
        rows = [
            ("architecture", info["architecture"]),
            ("layers", info["layers"]),
            ("hidden / intermediate", f"{info['hidden_size']} / {info['intermediate_size']}"),
            ("heads / kv heads / head dim", f"{info['num_heads']} / {info['num_kv_heads']} / {info['head_dim']}"),
            ("vocab", info["vocab_size"]),
            ("dtype", info["dtype"]),
            ("tied embeddings", info["tie_word_embeddings"]),
            ("rope", f"theta {info['rope']['theta']:g}, scaling {info['rope']['scaling'] or '(none)'}"),
            ("max positions", info["max_position_embeddings"]),
            ("sliding window", _window(info["sliding_window"])),
            ("speculative heads", ", ".join(info["heads"]) or "(none)"),
            ("tensors", f"{info['tensors']} ({info['weights']['parameters']:,} base parameters)"),
            ("size", _size(info["bytes"])),
            ("tokenizer / chat template", f"{info['tokenizer']} / {info['chat_template']}"),
        ]
    else:
        limits = info["limits"] or {}
        tree = info["tree"]
        validation = info["validation"] or {}
        rows = [
            ("mode", info["speculative_mode"]),
            ("dtype", info["dtype"]),
            ("lossless (build)", "yes" if info["lossless"] else f"NO ({info.get('lossy_reason')})"),
            (
                "on this machine",
                f"{'lossless' if info['this_machine']['lossless'] else 'LOSSY'}: {info['this_machine']['verified']}",
            ),
            *([("kernels", info["this_machine"]["kernels"])] if info["this_machine"].get("kernels") else []),
            ("limits", ", ".join(f"{k} {v}" for k, v in limits.items())),
            (
                "KV memory",
                f"{_size(info['kv_memory']['per_position'])} per position; {_size(info['kv_memory']['per_slot'])} per "
                f"sequence at max_seq_len; {_size(info['kv_memory']['all_slots'])} for all "
                f"{info['kv_memory']['slots']} slots (max_batch_size)",
            ),
            *(
                (f"{role} KV memory", f"{_size(m['per_position'])} per position; {_size(m['per_slot'])} per sequence")
                for role, m in info["role_kv_memory"].items()
            ),
            ("tree", "dynamic" if tree.get("dynamic") else f"{tree['size']} nodes, depth {tree['depth']}"),
            ("states", ", ".join(s["name"] for s in info["states"]) or "(none)"),
            (
                "graphs",
                "; ".join(
                    f"{g['role']} {g['backend']}: {g['file']} ({g['weights']}{_heads(g)}, {g['kv_cache']}{_kv(g)} KV, "
                    f"{_size(info['files'].get(g['file'], 0))})"
                    for g in info["graphs"]
                ),
            ),
            ("TensorRT plan", info["plan"] or "(none)"),
            (
                "validation",
                f"max abs diff {validation.get('max_abs_diff', float('nan')):.3g} "
                f"(tolerance {validation.get('tolerance', float('nan')):g})",
            ),
            ("format / built by", f"v{info['format_version']} / specbuild {info['specbuild_version']}"),
        ]
        if info["mode"]:
            rows.insert(5, ("mode settings", json.dumps(info["mode"])))
    from rich.markup import escape

    for key, value in rows:
        kv.add_row(key, escape(str(value)))
    console.print(kv)
    if info["kind"] == "engine":
        for graph in info["graphs"]:
            io = Table(
                title=f"I/O of the {graph['role']} {graph['backend']} graph ({graph['file']})", title_justify="left"
            )
            for col in ("", "name", "dtype", "shape"):
                io.add_column(col)
            for direction in ("inputs", "outputs"):
                for item in (graph["io"] or {}).get(direction, []):
                    io.add_row(direction[:-1], item["name"], item["dtype"], _shape(item["shape"]))
            console.print(io)
        files = Table(title=f"files ({_size(info['total_bytes'])})", title_justify="left")
        files.add_column("file")
        files.add_column("size", justify="right")
        files.add_column("sha256")
        records = info.get("checksums") or {}
        verified = info.get("verified")
        for name, size in info["files"].items():
            if name not in records:
                check = "manifest" if name == ef.ENGINE_MANIFEST else "not recorded"
            elif verified is not None:
                check = "OK" if name in verified else "?"
            else:
                check = "size OK (--verify checks hashes)"
            files.add_row(name, _size(size), check)
        console.print(files)
    elif info["heads"]:
        heads = Table(title="heads", title_justify="left")
        for col in ("mode", "tensors", "size", "config"):
            heads.add_column(col)
        for name, h in info["heads"].items():
            heads.add_row(name, str(h.get("tensors", "?")), _size(h.get("bytes", 0)), escape(json.dumps(h["config"])))
        console.print(heads)


def _kv(graph: dict) -> str:
    """The KV cache's precision where it is not the engine's float (--kv-cache int8), else nothing."""
    dtype = graph.get(ef.GRAPH_KV_CACHE_DTYPE) or ef.KV_CACHE_FLOAT  # None where the entry predates the field
    return "" if dtype == ef.KV_CACHE_FLOAT else f" {dtype}"


def _heads(graph: dict) -> str:
    """The heads' precision where the build quantized the mode's own matmuls (--head-weights), else nothing."""
    q = graph.get("head_quantization")
    return f", heads int{q['bits']}" if q else ""

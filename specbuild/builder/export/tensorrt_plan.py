"""Compile an exported step graph into a TensorRT plan through polygraphy (GPU hosts only).

Kept thin and import-safe: neither ``tensorrt`` nor polygraphy's TensorRT backend is imported until
:func:`build_tensorrt_plan` runs, so CPU hosts can import this module and get a clear error instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime.backends.tensorrt import tensorrt_available  # noqa: F401 - re-exported for the builder

TENSORRT_MISSING = "--tensorrt needs the TensorRT Python package (pip install specbuild[trt]) on an NVIDIA GPU host"

Shape = Sequence[int]


def _tensorrt_major() -> int:
    import tensorrt

    return int(str(tensorrt.__version__).split(".")[0])


def build_tensorrt_plan(
    onnx_path: str | Path,
    plan_path: str | Path,
    fp16: bool = False,
    profiles: Mapping[str, tuple[Shape, Shape, Shape]] | None = None,
    *,
    strongly_typed: bool = False,
    check_ops: bool = True,
) -> Path:
    """Build ``plan_path`` from ``onnx_path``; ``profiles`` maps each dynamic input to (min, opt, max) shapes.

    ``fp16`` sets TensorRT 10's weak-typing FP16 flag (TensorRT 11 removed it: bake fp16 into the ONNX and use
    ``strongly_typed=True``). With ``check_ops`` the graph is linted against the parser's operator list first.
    """
    if not tensorrt_available():
        raise SpecbuildError(TENSORRT_MISSING)
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    if not onnx_path.is_file():
        raise SpecbuildError(f"ONNX file {str(onnx_path)!r} does not exist")
    if check_ops:
        from specbuild.builder.export.trt_compat import assert_tensorrt_clean

        assert_tensorrt_clean(onnx_path)
    if fp16 and _tensorrt_major() >= 11:
        raise SpecbuildError(
            "fp16=True needs TensorRT 10 (weak typing); TensorRT 11 networks are strongly typed: export the ONNX in "
            "fp16 and build with strongly_typed=True"
        )

    from polygraphy.backend.trt import CreateConfig, Profile, engine_from_network, network_from_onnx_path, save_engine

    trt_profiles = []
    if profiles:
        profile = Profile()
        for name, shapes in profiles.items():
            if len(shapes) != 3:
                raise SpecbuildError(
                    f"TensorRT profile for input {name!r} must be (min, opt, max) shapes, got {shapes}"
                )
            lo, opt, hi = (tuple(int(d) for d in s) for s in shapes)
            profile.add(name, min=lo, opt=opt, max=hi)
        trt_profiles.append(profile)
    network_kwargs = {"strongly_typed": True} if strongly_typed else {}
    config_kwargs = {"fp16": True} if fp16 else {}
    try:
        network = network_from_onnx_path(str(onnx_path), **network_kwargs)
        engine = engine_from_network(network, config=CreateConfig(profiles=trt_profiles or None, **config_kwargs))
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        save_engine(engine, path=str(plan_path))
    except SpecbuildError:
        raise
    except Exception as exc:  # noqa: BLE001 - polygraphy/TensorRT failures become one user-facing line
        raise SpecbuildError(f"TensorRT could not build a plan from {str(onnx_path)!r}: {exc}") from None
    return plan_path


def optimization_profiles(cfg, plugin, max_seq_len: int, max_batch_size: int = 1, long_rope: bool = False) -> dict:
    """min/opt/max shapes per dynamic input of the portable graph for the TensorRT optimization profile: 1 to
    max_batch_size sequences (opt: one full step of min(4, max_batch_size) sequences). long_rope: the graph takes
    ef.ROPE_LONG (BuildPlan.rope_switch)."""
    n = plugin.max_new_tokens_per_step()
    b = max_batch_size
    o = min(4, b)
    kv = (cfg.num_layers, 2)
    h, d = cfg.num_kv_heads, cfg.head_dim
    depth = max(1, plugin.tree().depth + 1 if plugin.tree() is not None else n)
    per_sequence = {name: ((1,), (o,), (b,)) for name in (ef.PAST_LENGTH, ef.TEMPERATURE, ef.TOP_K, ef.TOP_P)}
    if long_rope:  # LongRoPE past its switch: a flag per row
        per_sequence[ef.ROPE_LONG] = ((1,), (o,), (b,))
    if plugin.selects_rows:  # from no row drafted (plain calls) to every row
        per_sequence[ef.DRAFT_ROWS] = ((0,), (o,), (b,))
    return {
        ef.INPUT_IDS: ((1, 1), (o, n), (b, max_seq_len)),
        ef.POSITION_IDS: ((1, 1), (o, n), (b, max_seq_len)),
        ef.TREE_MASK: ((1, 1, 1), (o, n, n), (b, max_seq_len, max_seq_len)),
        ef.KV_CACHE: ((*kv, 1, h, 1, d), (*kv, o, h, min(1024, max_seq_len), d), (*kv, b, h, max_seq_len, d)),
        ef.PATHS: ((1, 1, 1), (o, n, depth), (b, n, depth)),
        ef.RAND_ACCEPT: ((1, 1), (o, n), (b, n)),
        ef.RAND_SAMPLE: ((1,), (o,), (b,)),
        **per_sequence,
    }

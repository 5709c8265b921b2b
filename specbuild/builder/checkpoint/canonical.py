"""The canonical checkpoint directory: config.yaml, model.safetensors, heads/*.safetensors, tokenizer.json."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from specbuild import engine_format as ef
from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.errors import SpecbuildError

DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass
class Checkpoint:
    """A loaded canonical checkpoint. Tensors are read lazily from safetensors."""

    path: Path
    model: ModelConfig
    dtype: str
    heads: dict[str, dict[str, Any]]
    chat_template: str | None = None

    @classmethod
    def load(cls, path) -> Checkpoint:
        path = Path(path)
        cfg_file = path / ef.CHECKPOINT_CONFIG
        if not cfg_file.is_file():
            raise SpecbuildError(
                f"{path}: not a specbuild checkpoint (no {ef.CHECKPOINT_CONFIG}); run `specbuild convert`"
            )
        try:
            cfg = yaml.safe_load(cfg_file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise SpecbuildError(f"{cfg_file}: cannot read ({exc.strerror or exc})") from None
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise SpecbuildError(f"{cfg_file}: invalid YAML ({exc})") from None
        if not isinstance(cfg, dict) or cfg.get("format") != ef.CHECKPOINT_FORMAT:
            raise SpecbuildError(f"{cfg_file}: not a specbuild checkpoint config")
        if cfg.get("format_version") != ef.CHECKPOINT_FORMAT_VERSION:
            raise SpecbuildError(
                f"{cfg_file}: checkpoint format version {cfg.get('format_version')} is not supported "
                f"(this specbuild reads version {ef.CHECKPOINT_FORMAT_VERSION}); re-run `specbuild convert`"
            )
        dtype = cfg.get("dtype", "float32")
        if dtype not in DTYPES:
            raise SpecbuildError(f"{cfg_file}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        heads = cfg.get("heads") or {}
        if not isinstance(heads, dict) or not all(isinstance(h, dict) for h in heads.values()):
            raise SpecbuildError(f"{cfg_file}: heads must map a mode name to its head config")
        for name in heads:
            head_file = path / ef.HEADS_DIR / f"{name}.safetensors"
            if not head_file.is_file():
                raise SpecbuildError(f"{head_file}: missing (config.yaml lists {name} heads)")
        template = cfg.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise SpecbuildError(f"{cfg_file}: chat_template must be a string")
        if not (path / ef.CHECKPOINT_WEIGHTS).is_file():
            raise SpecbuildError(f"{path / ef.CHECKPOINT_WEIGHTS}: missing")
        return cls(
            path=path,
            model=ModelConfig.from_dict(cfg.get("model"), source=f"{cfg_file}: model"),
            dtype=dtype,
            heads=heads,
            chat_template=template,
        )

    def tensors(self, device: str = "cpu") -> Mapping:
        """Base-model tensors, HF names, as torch tensors read one at a time when asked for (LazyTensors): a build
        holds the tensors it is working on, not the model."""
        from specbuild.builder.checkpoint.weights_io import open_tensor_file

        file = self.path / ef.CHECKPOINT_WEIGHTS
        if not file.is_file():
            raise SpecbuildError(f"{file}: missing")
        return open_tensor_file(file)

    def head_tensors(self, name: str) -> dict:
        if name not in self.heads:
            raise SpecbuildError(
                f"{self.path}: checkpoint holds no {name} heads (has: {sorted(self.heads) or '(none)'}); "
                f"convert with the heads, e.g. `specbuild convert --{name}-dir DIR`"
            )
        return _load_safetensors(self.path / ef.HEADS_DIR / f"{name}.safetensors")

    @property
    def tokenizer_file(self) -> Path | None:
        p = self.path / ef.TOKENIZER_FILE
        return p if p.is_file() else None


def _load_safetensors(file: Path) -> dict:
    from safetensors.torch import load_file

    from specbuild.builder.checkpoint.weights_io import check_finite

    if not file.is_file():
        raise SpecbuildError(f"{file}: missing")
    try:
        tensors = load_file(str(file))
    except OSError as exc:
        raise SpecbuildError(f"{file}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise SpecbuildError(f"{file}: cannot read safetensors, truncated or corrupt ({exc})") from None
    for name, tensor in tensors.items():
        check_finite(tensor, name, file)
    return tensors


def write_checkpoint(
    out_dir: Path,
    model: ModelConfig,
    tensors: Mapping,
    dtype: str,
    tokenizer_dir: Path | None = None,
    heads: dict[str, tuple[dict, dict]] | None = None,
    chat_template: str | None = None,
    source: str | None = None,
    progress: bool = False,
) -> None:
    """Write a canonical checkpoint into `out_dir` (an already-created, empty directory). The base tensors are written
    one at a time (a LazyTensors mapping reads each when its turn comes).

    heads: mode name -> (head config dict, tensors dict).
    """
    from safetensors.torch import save_file

    from specbuild.builder.checkpoint.safetensors_stream import write_safetensors
    from specbuild.builder.checkpoint.weights_io import spec_of
    from specbuild.progress import steps

    out_dir = Path(out_dir)
    specs = {name: spec_of(tensors, name) for name in tensors}
    with steps("writing the base weights", len(specs), enabled=progress) as advance:

        def produce(name):
            tensor = tensors[name]
            advance()
            return tensor

        write_safetensors(out_dir / ef.CHECKPOINT_WEIGHTS, specs, produce)
    head_cfgs = {}
    for name, (head_cfg, head_tensors) in (heads or {}).items():
        (out_dir / ef.HEADS_DIR).mkdir(exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in head_tensors.items()}, str(out_dir / ef.HEADS_DIR / f"{name}.safetensors")
        )
        head_cfgs[name] = head_cfg
    cfg = {
        "format": ef.CHECKPOINT_FORMAT,
        "format_version": ef.CHECKPOINT_FORMAT_VERSION,
        "dtype": dtype,
        "source": source,
        "model": model.to_dict(),
        "heads": head_cfgs,
        "chat_template": chat_template,
    }
    (out_dir / ef.CHECKPOINT_CONFIG).write_text(yaml.safe_dump(cfg, sort_keys=False))
    if tokenizer_dir is not None:
        for name in (ef.TOKENIZER_FILE, ef.TOKENIZER_CONFIG_FILE):
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copy(src, out_dir / name)


def read_json(file: Path) -> dict:
    """A JSON object from `file`; missing, unreadable, non-UTF-8, invalid or non-object files are one error."""
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecbuildError(f"{file}: missing") from None
    except OSError as exc:
        raise SpecbuildError(f"{file}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise SpecbuildError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise SpecbuildError(f"{file}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SpecbuildError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def recorded_defaults(head_cfg: dict, config_file: Path) -> dict:
    """A head config's `specbuild_defaults`: the build settings its recipe measured fastest ({} when absent)."""
    defaults = head_cfg.get("specbuild_defaults") or {}
    if not isinstance(defaults, dict):
        raise SpecbuildError(f"{config_file}: specbuild_defaults must be a mapping, got {defaults!r}")
    by_weights = defaults.get("by_weights") or {}  # another choice for some --weights (int4: what pays differs)
    if not isinstance(by_weights, dict) or not all(
        w in ef.WEIGHTS and isinstance(d, dict) and "by_weights" not in d for w, d in by_weights.items()
    ):
        raise SpecbuildError(
            f"{config_file}: specbuild_defaults.by_weights must map weights ({', '.join(ef.WEIGHTS)}) to build "
            f"options, got {by_weights!r}"
        )
    entries = {f"specbuild_defaults.by_weights.{w}": d for w, d in by_weights.items()}
    entries["specbuild_defaults"] = defaults
    for where, chosen in entries.items():
        if "head_weights" in chosen and chosen["head_weights"] not in ef.HEAD_WEIGHTS:
            raise SpecbuildError(
                f"{config_file}: {where}.head_weights must be one of {', '.join(ef.HEAD_WEIGHTS)}, "
                f"got {chosen['head_weights']!r}"
            )
    return dict(defaults)


def build_weights(checkpoint: Checkpoint, options) -> str:
    """The weights a build of `checkpoint` gets: --weights, else fp16 for a float16 checkpoint, else fp32."""
    return options.weights or ("fp16" if checkpoint.dtype == "float16" else "fp32")


def defaults_for_weights(defaults: dict | None, weights: str) -> dict:
    """A head's recorded defaults (recorded_defaults) for a build at `weights`: the entry of by_weights for those
    weights over the rest."""
    defaults = dict(defaults or {})
    by_weights = defaults.pop("by_weights", None) or {}
    return {**defaults, **by_weights.get(weights, {})}

"""YAML training recipes: loading, paths, the shared data stage, and `run_recipe(path)`, which hands the recipe to
the trainer of the mode its `kind` names (each mode's package holds its training).

Every stage resumes: sequences are appended and skipped when done, feature shards are written per batch.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from specbuild.training import distill

PATH_KEYS = ("work_dir", "distill_dir", "feature_dir", "output_dir", "corpus_dir")


def expand_path(path) -> str:
    return os.path.expandvars(os.path.expanduser(str(path)))


def resolve_paths(cfg: dict) -> dict:
    """`base_model: default` -> the embedded SmolLM2, `base_model: gemma3-270m` (any name prepare-default-model
    knows) -> that real model, prepared on first use; `~` and env vars expanded."""
    from specbuild.builder.checkpoint.default_model import REAL_MODELS

    cfg = dict(cfg)
    name = "smollm2" if cfg.get("base_model") == "default" else cfg.get("base_model")
    if name in REAL_MODELS:
        cfg["base_model"] = str(REAL_MODELS[name]())
    for key in PATH_KEYS:
        if cfg.get(key):
            cfg[key] = expand_path(cfg[key])
    return cfg


def load_recipe(path: str | Path, device: str | None = None, overrides: list[str] | tuple = ()) -> dict:
    """The recipe with its `overrides` applied (see `apply_override`) and its paths resolved; `device` (where to
    run) is stored under `device`, `path` under `recipe_path`."""
    from specbuild.errors import SpecbuildError

    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecbuildError(f"recipe {path}: cannot read ({exc})") from None
    for item in overrides:
        cfg = apply_override(cfg or {}, item)
    for key in ("base_model", "work_dir", "output_dir"):
        if key not in (cfg or {}):
            raise SpecbuildError(f"recipe {path}: needs `{key}`")
    cfg = resolve_paths(cfg)
    cfg["device"] = device or cfg.get("device") or distill.default_device()
    cfg["recipe_path"] = str(path)  # named by errors about its keys (settings.read_train)
    return cfg


def apply_override(cfg: dict, item: str) -> dict:
    """`KEY=VALUE` with a dotted KEY (`train.time_budget_s=300`) and a YAML VALUE (`null` removes the key), applied
    to a copy of `cfg`."""
    from specbuild.errors import SpecbuildError

    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise SpecbuildError(f"--set {item!r}: expected KEY=VALUE, e.g. train.time_budget_s=300")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecbuildError(f"--set {item!r}: the value is not YAML ({exc})") from None
    out = dict(cfg)
    node, parts = out, key.strip().split(".")
    for part in parts[:-1]:
        child = node.get(part)
        node[part] = dict(child) if isinstance(child, dict) else {}
        node = node[part]
    if value is None:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value
    return out


def prepare_data(cfg: dict, log=print) -> None:
    """HumanEval evaluation continuations, then one or more generation rounds of training sequences.

    `data` holds the first round's settings; `data.rounds` (optional) lists further rounds, each overriding
    some of them (seed, prompt counts, budgets) and giving an `id_prefix` so that its sequences never collide
    with earlier ones. `data.layer_features` ({mode: directory}) writes the decoder-layer inputs each of those modes
    declares (ModeSpec.features) in the same pass. A round's
    `text_answers: N` adds teacher-forced rows over N recorded ShareGPT answers under `feat_text` (one forward per
    sequence; trainers mix them in when their recipe asks)."""
    from transformers import AutoTokenizer

    d, work, hf = cfg.get("data", {}), Path(cfg["work_dir"]), cfg["base_model"]
    tok = AutoTokenizer.from_pretrained(hf)
    n_he = int(d.get("eval_humaneval_prompts", 20))
    if n_he:
        he = [
            {"id": f"he-{i:03d}", "kind": "humaneval", "ids": tok(p)["input_ids"]}
            for i, p in enumerate(distill.humaneval_prompts(n_he))
        ]
        distill.generate_sequences(
            hf,
            he,
            int(d.get("max_new_tokens", 160)),
            n_he,
            work / "humaneval.jsonl",
            1e9,
            features_dir=work / "feat_humaneval",
            log=log,
        )
    layer_features, layer_dir = declared_layer_features(d.get("layer_features") or {})
    base = {k: v for k, v in d.items() if k != "rounds"}
    for r in [base, *[{**base, "id_prefix": f"r{i}-", **rd} for i, rd in enumerate(d.get("rounds") or [], 1)]]:
        prefix = r.get("id_prefix", "")
        prompts = distill.build_prompts(
            tok,
            int(r.get("code_prompts", 1600)),
            int(r.get("chat_prompts", 800)),
            seed=int(r.get("seed", 0)),
            chat_code_frac=float(r.get("chat_code_frac", 0.2)),
            max_prompt_tokens=int(r.get("max_prompt_tokens", 256)),
            n_stub=int(r.get("stub_prompts", 0)),
        )
        if prefix:  # later rounds skip prompts an earlier round already has
            seen = {tuple(s["prompt_ids"]) for s in distill.read_sequences(work / "train.jsonl")}
            prompts = [dict(p, id=prefix + p["id"]) for p in prompts if tuple(p["ids"]) not in seen]
        distill.generate_sequences(
            hf,
            prompts,
            int(r.get("max_new_tokens", 160)),
            int(r.get("batch_size", 96)),
            work / "train.jsonl",
            float(r.get("time_budget_s", 1800)),
            features_dir=work / "feat_train",
            layer_features=layer_features,
            layer_features_dir=layer_dir,
            log=log,
            device=cfg.get("device") or distill.default_device(),
            dtype=str(r.get("dtype", "float32")),
            temperature=float(r.get("temperature", 0.0)),
            seed=int(r.get("seed", 0)),
        )
        n_text = int(r.get("text_answers", 0))
        if n_text:  # teacher-forced rows over recorded answers (ShareGPT), in their own feature directory
            seqs = distill.answer_sequences(
                tok, n_text, seed=int(r.get("seed", 0)), max_prompt_tokens=int(r.get("max_prompt_tokens", 256)),
                max_answer_tokens=int(r.get("max_answer_tokens", 256)), id_prefix=prefix + "text-",
            )  # fmt: skip
            distill.compute_features(
                hf, seqs, work / "feat_text", batch_size=int(r.get("text_batch_size", 16)), log=log,
                device=cfg.get("device") or distill.default_device(), dtype=str(r.get("dtype", "float32")),
            )  # fmt: skip


def declared_layer_features(by_mode: dict) -> tuple:
    """(the LayerFeatures the mode declares, its directory) for the data stage's `layer_features: {mode: DIR}`, or
    (None, None); one mode at a time (its captured layers come out of the decoding pass)."""
    from specbuild.errors import SpecbuildError
    from specbuild.modes.registry import get_mode, load_object

    if not by_mode:
        return None, None
    if len(by_mode) > 1:
        raise SpecbuildError(f"data.layer_features: one mode at a time, got {', '.join(by_mode)}")
    ((mode, directory),) = by_mode.items()
    spec = get_mode(mode, "data.layer_features")
    if spec.features is None:
        raise SpecbuildError(f"data.layer_features: mode {mode!r} declares no layer features")
    return load_object(spec.features), Path(expand_path(directory))


def check_device(device: str | None) -> str:
    """`device` (cuda or cpu), or the default: cuda when torch sees a GPU."""
    import torch

    from specbuild.errors import SpecbuildError

    if device is None:
        return distill.default_device()
    if device not in ("cuda", "cpu"):
        raise SpecbuildError(f"--device {device!r} is not one of cuda, cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecbuildError("--device cuda: torch sees no CUDA GPU on this machine (use --device cpu)")
    return device


def run_recipe(
    path: str | Path, log=print, device: str | None = None, overrides: list[str] | tuple = (), choose_only=False
) -> dict:
    """Run a whole recipe (with `overrides`, see `apply_override`) with the trainer of the mode its `kind` names (on
    `device`, see check_device), then its `choose` stage (the fastest measured build settings become the heads'
    defaults; not where `choose.after_training` is false); returns the trainer's metrics, with the choice under
    `choice`. choose_only: the `choose` stage alone, on the heads already in `output_dir` (e.g. heads trained on a
    GPU, measured on the CPU that will serve them)."""
    from specbuild.errors import SpecbuildError
    from specbuild.modes.registry import load_object, trainable_modes

    cfg = load_recipe(path, check_device(device), overrides)
    modes = trainable_modes()
    kind = cfg.get("kind")
    if kind not in modes:
        raise SpecbuildError(f"recipe {path}: `kind` {kind!r} is not one of {', '.join(modes)}")
    if choose_only:
        if not cfg.get("choose"):
            raise SpecbuildError(f"recipe {path}: --choose-only needs a `choose` stage (choose.candidates)")
        if not (Path(cfg["output_dir"]) / "config.json").is_file():
            raise SpecbuildError(f"recipe {path}: --choose-only: no heads in output_dir {cfg['output_dir']}")
        metrics = {}
    else:
        metrics = load_object(modes[kind].trainer)(cfg, log=log)
        if not (cfg.get("choose") or {}).get("after_training", True):
            return metrics  # trained where it will not serve (a GPU host): choose there later, with --choose-only
    from specbuild.training.defaults import choose_for_recipe

    choice = choose_for_recipe(cfg, kind, cfg["output_dir"], log=log)  # the recipe's `choose` stage, if it has one
    if choice:
        metrics["choice"] = choice
    return metrics

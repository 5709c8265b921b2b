"""YAML training recipes: `run_recipe(path)` runs data generation, head training, evaluation, tree choice, export.

Every stage resumes: sequences are appended and skipped when done, feature shards are written per batch.
Metrics (per-head accuracy on held-out training sequences and on HumanEval continuations, tree tau estimates)
go to `<work_dir>/metrics.json`; the heads go to `output_dir` in the Medusa v2 layout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import yaml

from specbuild.training import distill, medusa

PATH_KEYS = ("work_dir", "distill_dir", "feature_dir", "output_dir")


def resolve_paths(cfg: dict) -> dict:
    """`base_model: default` -> the embedded SmolLM2 (prepared on first use); `~` and env vars expanded."""
    import os

    cfg = dict(cfg)
    if cfg.get("base_model") == "default":
        from specbuild.builder.default_model import prepare_smollm2

        cfg["base_model"] = str(prepare_smollm2())
    for key in PATH_KEYS:
        if cfg.get(key):
            cfg[key] = os.path.expandvars(os.path.expanduser(str(cfg[key])))
    return cfg


def load_recipe(path: str | Path) -> dict:
    from specbuild.errors import SpecbuildError

    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecbuildError(f"recipe {path}: cannot read ({exc})") from None
    for key in ("base_model", "work_dir", "output_dir"):
        if key not in (cfg or {}):
            raise SpecbuildError(f"recipe {path}: needs `{key}`")
    return resolve_paths(cfg)


def prepare_data(cfg: dict, log=print) -> None:
    from transformers import AutoTokenizer

    d, work, hf = cfg.get("data", {}), Path(cfg["work_dir"]), cfg["base_model"]
    tok = AutoTokenizer.from_pretrained(hf)
    n_he = int(d.get("eval_humaneval_prompts", 20))
    max_new = int(d.get("max_new_tokens", 160))
    if n_he:
        he = [
            {"id": f"he-{i:03d}", "kind": "humaneval", "ids": tok(p)["input_ids"]}
            for i, p in enumerate(distill.humaneval_prompts(n_he))
        ]
        distill.generate_sequences(
            hf, he, max_new, n_he, work / "humaneval.jsonl", 1e9, features_dir=work / "feat_humaneval", log=log
        )
    prompts = distill.build_prompts(
        tok,
        int(d.get("code_prompts", 1600)),
        int(d.get("chat_prompts", 800)),
        seed=int(d.get("seed", 0)),
        chat_code_frac=float(d.get("chat_code_frac", 0.2)),
        max_prompt_tokens=int(d.get("max_prompt_tokens", 256)),
    )
    distill.generate_sequences(
        hf,
        prompts,
        max_new,
        int(d.get("batch_size", 96)),
        work / "train.jsonl",
        float(d.get("time_budget_s", 1800)),
        features_dir=work / "feat_train",
        log=log,
    )


def train_and_export(cfg: dict, log=print) -> dict:
    t, work, hf = cfg.get("train", {}), Path(cfg["work_dir"]), cfg["base_model"]
    K, nl = int(t.get("num_heads", 4)), int(t.get("num_layers", 1))
    feats = distill.load_features(work / "feat_train")
    t0 = time.time()
    state = medusa.train_medusa(
        feats,
        hf,
        num_heads=K,
        num_layers=nl,
        epochs=float(t.get("epochs", 2)),
        lr=float(t.get("lr", 1e-3)),
        batch=int(t.get("batch", 512)),
        time_budget_s=float(t.get("time_budget_s", 1200)),
        heldout_frac=float(t.get("heldout_frac", 0.05)),
        head_decay=float(t.get("head_decay", 0.8)),
        n_negatives=int(t.get("n_negatives", 1024)),
        soft_weight=float(t.get("soft_weight", 0.5)),
        log=log,
    )
    train_s = time.time() - t0
    import torch

    torch.save(state, work / "heads_state.pt")
    return finish(cfg, state, feats, train_s, log=log)


def finish(cfg: dict, state, feats: dict, train_s: float, log=print) -> dict:
    """Evaluate, choose the tree, write the heads and metrics."""
    t, tr, work, hf = cfg.get("train", {}), cfg.get("tree", {}), Path(cfg["work_dir"]), cfg["base_model"]
    K, nl = int(t.get("num_heads", 4)), int(t.get("num_layers", 1))
    held = medusa.split_by_sequence(feats, float(t.get("heldout_frac", 0.05)), 0)
    ev_held = medusa.evaluate(state, feats, hf, K, nl, rows=np.nonzero(held)[0], max_rows=4000)
    he_feats = distill.load_features(work / "feat_humaneval") if (work / "feat_humaneval").is_dir() else None
    ev_he = medusa.evaluate(state, he_feats, hf, K, nl, max_rows=4000) if he_feats else None
    sel = ev_he if (tr.get("select_on") == "humaneval" and ev_he) else ev_held
    choices = medusa.choose_tree(sel["ranks"], sel["ok"], int(tr.get("max_nodes", 24)))
    metrics = {"train_s": round(train_s, 1), "tree_nodes": len(choices), "medusa_choices": choices}
    for name, ev in (("heldout", ev_held), ("humaneval", ev_he)):
        if ev is None:
            continue
        metrics[name] = {
            "accuracy": ev["accuracy"],
            "tau_empirical": medusa.tree_tau(choices, ev["ranks"], ev["ok"]),
            "tau_independent": medusa.expected_tau_independent(choices, ev["ranks"], ev["ok"]),
        }
        log(f"{name}: {json.dumps(metrics[name])}")
    medusa.save_medusa_v2(
        cfg["output_dir"], state, K, nl, int(feats["hidden"].shape[1]), cfg.get("base_model_name", str(hf)), choices
    )
    Path(work / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def run_recipe(path: str | Path, log=print) -> dict:
    """Run a whole recipe; returns the metrics written to `<work_dir>/metrics.json`."""
    cfg = load_recipe(path)
    if cfg.get("kind", "medusa") in ("eagle", "eagle3"):
        from specbuild.training.eagle import run_eagle_recipe

        return run_eagle_recipe(path, log=log)
    distill.setup_torch()
    prepare_data(cfg, log=log)
    return train_and_export(cfg, log=log)

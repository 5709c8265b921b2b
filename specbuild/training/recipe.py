"""YAML training recipes: `run_recipe(path)` runs data generation, head training, evaluation, tree choice, export.

Every stage resumes: sequences are appended and skipped when done, feature shards are written per batch.
Metrics (per-head accuracy on held-out training sequences and on HumanEval continuations, tree tau estimates)
go to `<work_dir>/metrics.json`; the heads go to `output_dir` in the Medusa v2 layout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import yaml

from specbuild.training import distill, medusa

PATH_KEYS = ("work_dir", "distill_dir", "feature_dir", "output_dir")


def expand_path(path) -> str:
    return os.path.expandvars(os.path.expanduser(str(path)))


def resolve_paths(cfg: dict) -> dict:
    """`base_model: default` -> the embedded SmolLM2 (prepared on first use); `~` and env vars expanded."""
    cfg = dict(cfg)
    if cfg.get("base_model") == "default":
        from specbuild.builder.default_model import prepare_smollm2

        cfg["base_model"] = str(prepare_smollm2())
    for key in PATH_KEYS:
        if cfg.get(key):
            cfg[key] = expand_path(cfg[key])
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
    """HumanEval evaluation continuations, then one or more generation rounds of training sequences.

    `data` holds the first round's settings; `data.rounds` (optional) lists further rounds, each overriding
    some of them (seed, prompt counts, budgets) and giving an `id_prefix` so that its sequences never collide
    with earlier ones. With `data.eagle3_feature_dir`, EAGLE-3's layer features come out of the same pass."""
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
    layer_dir = d.get("eagle3_feature_dir")
    layer_dir = Path(expand_path(layer_dir)) if layer_dir else None
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
            layer_features_dir=layer_dir,
            log=log,
        )


def train_and_export(cfg: dict, log=print) -> dict:
    t, work, hf = cfg.get("train", {}), Path(cfg["work_dir"]), cfg["base_model"]
    K, nl = int(t.get("num_heads", 4)), int(t.get("num_layers", 1))
    feats = distill.load_features(work / "feat_train")
    init = None
    if t.get("init_from"):  # continue training heads this recipe wrote before (Medusa v2 layout)
        from safetensors.torch import load_file

        raw = load_file(str(Path(t["init_from"]) / "medusa_lm_head.safetensors"))
        init = {f"medusa_head.{k}": v.float() for k, v in raw.items() if k != "draft_vocab"}
        log(f"continuing from {t['init_from']}")
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
        init_state=init,
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
    chosen = medusa.choose_tree(sel["ranks"], sel["ok"], int(tr.get("max_nodes", 24)))
    shipped = tr.get("choices") or chosen  # an explicit tree (picked by `specbuild bench`) wins
    metrics = {"train_s": round(train_s, 1), "tree_nodes": len(chosen), "medusa_choices": chosen}
    for name, ev in (("heldout", ev_held), ("humaneval", ev_he)):
        if ev is None:
            continue
        metrics[name] = {
            "accuracy": ev["accuracy"],
            "tau_empirical": medusa.tree_tau(chosen, ev["ranks"], ev["ok"]),
            "tau_independent": medusa.expected_tau_independent(chosen, ev["ranks"], ev["ok"]),
            "tau_empirical_shipped_tree": medusa.tree_tau(shipped, ev["ranks"], ev["ok"]),
        }
        log(f"{name}: {json.dumps(metrics[name])}")
    vocab = None
    if t.get("draft_vocab", True):  # specbuild extension: project onto the training targets seen twice or more
        counts = np.bincount(feats["next_token"][~held])
        vocab = np.nonzero(counts >= 2)[0]
        metrics["draft_vocab_size"] = int(len(vocab))
    extra = {"specbuild_note": tr["note"]} if tr.get("note") else None
    medusa.save_medusa_v2(
        cfg["output_dir"],
        state,
        K,
        nl,
        int(feats["hidden"].shape[1]),
        cfg.get("base_model_name", str(hf)),
        shipped,
        extra=extra,
        draft_vocab=vocab,
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

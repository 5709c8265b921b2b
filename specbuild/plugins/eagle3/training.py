"""Self-distilled EAGLE-3 draft heads: the layer features EAGLE-3 trains on (declared as `LAYER_FEATURES`, read
by the data stage), the EAGLE-3 family of the shared training-time-test trainer (specbuild.plugins.feature_draft.
training) and the export in SafeAILab's layout.

Features: the inputs of base layers 2, L//2, L-3 (`h_low`, `h_mid`, `h_high`, HF hidden_states[i]), written by the
data stage (`data.layer_features: {eagle3: DIR}`) or by `distill.extract_layer_features` here. Loss: CE over the
draft vocabulary (the most frequent training targets; targets outside it masked). Export: `save_eagle3` (fc,
midlayer, norm, lm_head, d2t, t2d), fp16 safetensors + config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specbuild.plugins.eagle3.draft_net import Eagle3Net
from specbuild.plugins.feature_draft.training import (
    DraftFamily,
    draft_config_json,
    evaluate_head_dirs,
    load_shards,
    recipe_defaults,
    train_from_recipe,
    write_head,
)
from specbuild.training import distill
from specbuild.training.features import LayerFeatures
from specbuild.training.recipe import prepare_data


def capture_layers(num_layers: int) -> list[int]:
    """EAGLE-3's captured decoder-layer inputs: 2, L//2, L-3 (clamped for toy models)."""
    return [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


LAYER_FEATURES = LayerFeatures(keys=("h_low", "h_mid", "h_high"), layers=capture_layers)


class Eagle3Family(DraftFamily):
    net_class = Eagle3Net
    layer_features = LAYER_FEATURES

    def read_rows(self, features_dir, prompt_len):
        d = load_shards(features_dir, (*LAYER_FEATURES.keys, "token", "seq", "pos"))
        feat = np.concatenate([d[k] for k in LAYER_FEATURES.keys], axis=1)
        return {"feat": feat, "token": d["token"], "seq": d["seq"], "pos": d["pos"]}

    def head_config(self, base, intermediate_size, draft_vocab_size):
        return {**super().head_config(base, intermediate_size, draft_vocab_size), "draft_vocab_size": draft_vocab_size}

    def vocabulary(self, train, init, size, vocab):
        """A head trained before keeps its draft vocabulary."""
        if init is not None:
            return (torch.arange(len(init["d2t"])) + init["d2t"]).numpy()
        return super().vocabulary(train, init, size, vocab)

    def start_from_base(self, draft, net, used):
        super().start_from_base(draft, net, used)
        draft.d2t.copy_(torch.from_numpy(used).long() - torch.arange(len(used)))
        draft.lm_head.weight.copy_(net.lm_head.weight[torch.from_numpy(used)])
        draft.norm.weight.copy_(net.final_norm)


EAGLE3 = Eagle3Family()


def save_eagle3(out_dir, draft, used: np.ndarray, hf_dir, base_model_name: str, defaults: dict, metrics=None):
    """SafeAILab EAGLE-3 layout: fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t [Vd] int64, t2d [V] bool
    (no embed_tokens: the base embedding is used), fp16 weights."""
    sd = draft.state_dict()
    tensors = {k: v.detach().to(torch.float16) for k, v in sd.items() if k != "d2t"}
    vocab = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
    used_t = torch.from_numpy(np.asarray(used)).long()
    tensors["d2t"] = used_t - torch.arange(len(used_t))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used_t] = True
    tensors["t2d"] = t2d
    cfg = draft_config_json(hf_dir, draft, base_model_name, defaults, metrics)
    cfg["draft_vocab_size"] = int(draft.lm_head.weight.shape[0])
    write_head(out_dir, tensors, cfg)


def evaluate_heads(heads: list, hf_dir, records: list[dict], device: str = "cpu", log=print) -> list[dict]:
    """Held-out per-step accuracy of EAGLE-3 head directories on corpus `records` (teacher-forced)."""
    return evaluate_head_dirs(EAGLE3, heads, hf_dir, records, device, log)


def run_eagle3_recipe(cfg: dict, log=print) -> dict:
    """An EAGLE-3 recipe (`load_recipe`'s dict, `kind: eagle3`): layer features teacher-forced from its
    `corpus_dir`, or extracted from the data stage's sequences (`distill_dir`: train.jsonl, humaneval.jsonl) into
    `feature_dir` (sequences that have them are skipped); training, evaluation, export."""
    hf, device = cfg["base_model"], cfg["device"]
    distill.setup_torch()
    fd = None
    if cfg.get("data") and not cfg.get("corpus_dir"):  # its own data stage first (into work_dir = distill_dir)
        prepare_data(cfg, log=log)
    if not cfg.get("corpus_dir"):
        dd, fd = Path(cfg["distill_dir"]), Path(cfg["feature_dir"])
        budget = float(cfg.get("features", {}).get("time_budget_s", 1e9))
        distill.extract_layer_features(LAYER_FEATURES, hf, dd / "humaneval.jsonl", fd / "humaneval", log=log,
                                       device=device)  # fmt: skip
        distill.extract_layer_features(LAYER_FEATURES, hf, dd / "train.jsonl", fd / "train", time_budget_s=budget,
                                       log=log, device=device)  # fmt: skip
    res = train_from_recipe(cfg, EAGLE3, fd and fd / "train", fd and fd / "humaneval", log=log)
    name = cfg.get("base_model_name", str(hf))
    save_eagle3(cfg["output_dir"], res["draft"], res["used"], hf, name, recipe_defaults(cfg), res["metrics"])
    return res["metrics"]

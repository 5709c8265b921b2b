"""Self-distilled EAGLE-1/2 draft heads: the EAGLE-1 family of the shared training-time-test trainer
(specbuild.plugins.feature_draft.training) and the export in SafeAILab's layout.

Features: the data stage's final normed hidden states (`distill_dir`/feat_train, feat_humaneval), or teacher-forced
ones of a recipe's `corpus_dir`. Loss: CE over the
base lm_head restricted to a frequent-token subset (for speed) + a SmoothL1 between h_t and the true f_{t+1}.
Export: `save_eagle1` (fc with bias, layers.0.* without input_layernorm, no embed_tokens, base lm_head), fp16
safetensors + config.json.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specbuild.plugins.eagle.draft_net import Eagle1Net
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
from specbuild.training.base_weights import load_base_weights


class Eagle1Family(DraftFamily):
    net_class = Eagle1Net
    feature_loss = True

    def read_rows(self, features_dir, prompt_len):
        """distill's shards: hidden, next_token, seq, gen_offset (= p - (P - 1) for prompt length P)."""
        d = load_shards(features_dir, ("hidden", "next_token", "seq", "gen_offset"))
        prompts = np.array([prompt_len.get(int(s), 0) for s in d["seq"]], dtype=np.int64)
        pos = d["gen_offset"].astype(np.int64) + prompts - 1
        return {"feat": d["hidden"], "token": d["next_token"], "seq": d["seq"], "pos": pos}

    def head_config(self, base, intermediate_size, draft_vocab_size):
        cfg = super().head_config(base, intermediate_size, draft_vocab_size)
        return {**cfg, "num_layers": 1, "fc_bias": True, "qkv_bias": False, "draft_vocab_size": None}

    def subset_rows(self, net, used):
        return net.lm_head.weight[torch.from_numpy(used)]

    def train_logits(self, draft, h, net, sub_w):
        return h @ sub_w.t()


EAGLE1 = Eagle1Family()


def save_eagle1(out_dir, draft, hf_dir, base_model_name: str, defaults: dict, metrics=None, used=None):
    """SafeAILab EAGLE-1 layout: fc.weight/bias, layers.0.* without input_layernorm, no embed_tokens.

    With `used` (the training draft vocabulary, sorted target ids) the head also carries `lm_head.weight` =
    those rows of the base lm_head and `d2t`, so the engine drafts over the vocabulary it was trained on
    (EAGLE-3's reduced-vocabulary layout); without it the base lm_head is shared."""
    sd = draft.state_dict()
    tensors = {k: v.detach().to(torch.float16) for k, v in sd.items() if k != "d2t"}
    cfg = draft_config_json(hf_dir, draft, base_model_name, defaults, metrics)
    if used is not None:
        used_t = torch.from_numpy(np.asarray(used)).long()
        tensors["lm_head.weight"] = load_base_weights(hf_dir).lm_head[used_t].to(torch.float16)
        tensors["d2t"] = used_t - torch.arange(len(used_t))
        cfg["draft_vocab_size"] = len(used_t)
    write_head(out_dir, tensors, cfg)


def evaluate_heads(heads: list, hf_dir, records: list[dict], device: str = "cpu", log=print) -> list[dict]:
    """Held-out per-step accuracy of EAGLE-1/2 head directories on corpus `records` (teacher-forced)."""
    return evaluate_head_dirs(EAGLE1, heads, hf_dir, records, device, log)


def run_eagle_recipe(cfg: dict, log=print) -> dict:
    """An EAGLE-1/2 recipe (`load_recipe`'s dict, `kind: eagle`): training on the data stage's final hidden states
    (`distill_dir`: train.jsonl, humaneval.jsonl, feat_train, feat_humaneval) or on teacher-forced ones of a
    `corpus_dir`, evaluation, export."""
    distill.setup_torch()
    dd = None if cfg.get("corpus_dir") else Path(cfg["distill_dir"])
    res = train_from_recipe(cfg, EAGLE1, dd and dd / "feat_train", dd and dd / "feat_humaneval", log=log)
    used = res["used"] if cfg.get("train", {}).get("ship_draft_vocab", False) else None
    name = cfg.get("base_model_name", str(cfg["base_model"]))
    save_eagle1(cfg["output_dir"], res["draft"], cfg["base_model"], name, recipe_defaults(cfg), res["metrics"], used)
    return res["metrics"]

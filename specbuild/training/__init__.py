"""Training of speculative-decoding heads by self-distillation from the base model; `specbuild train --recipe`.

- `recipe`: loads a YAML recipe (`load_recipe`), runs the shared data stage and hands the recipe to the trainer of
  the mode its `kind` names (`run_recipe`); each mode package holds its trainer.
- `distill`: training prompts, the base model's continuations and its features (final normed hidden states, and the
  decoder-layer inputs a mode declares as `features.LayerFeatures`).
- `loop`: the one optimisation loop (AdamW, warm-up + cosine schedule, time budget) every trainer runs.
- `settings`: what every trainer shares (`TrainSettings`: epochs, lr, batch, warm-up, time budget, held-out split,
  seed, ...) and the one place a recipe's `train:` mapping is read into it and into a trainer's own knobs.
- `vocab`: the one draft-vocabulary rule of every head.
- `base_weights`: the frozen base tensors (embedding, lm_head, final norm); `heldout`: the held-out split.
- `teacher_forced`: the same features recomputed from a corpus's token ids (a recipe's `corpus_dir`), in memory.
- `defaults`: the recipe's `choose` stage (default build settings by measurement); `batched_decode`: batched
  greedy decoding with feature capture.
"""

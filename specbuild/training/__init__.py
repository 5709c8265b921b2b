"""Training of speculative-decoding heads by self-distillation (Medusa v2 heads for the embedded SmolLM2).

- `distill`: training prompts, greedy continuations from the base model and the base's final normed hidden states.
- `medusa`: ResBlock heads on top of the frozen base lm_head, evaluation, tree choice and v2 checkpoint writing.
- `recipe`: a YAML recipe that runs the whole pipeline (`run_recipe`).
"""

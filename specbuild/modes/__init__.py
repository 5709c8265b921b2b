"""The mode contract, below every implementation: what a mode declares (`spec.ModeSpec`), the one registry that finds
the mode packages under `specbuild/plugins/` (`registry`), and the torch interface a mode's graph pieces implement
(`base.ModePlugin`). The builder, runtime, training and benchmarks import this package, never a mode package."""

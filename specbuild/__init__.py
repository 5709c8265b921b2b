"""specbuild: compile speculative decoding into portable ONNX step graphs and run them.

`from specbuild import Engine` gives the runtime without importing torch.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("Engine", "SamplingParams", "GenerationResult"):
        from specbuild.runtime import engine

        return getattr(engine, name)
    raise AttributeError(name)

"""Package metadata for specbuild."""

from setuptools import find_packages, setup

setup(
    name="specbuild",
    version="0.1.0",
    description="Ahead-of-time compiler for speculative decoding: ONNX step graphs with tree verification baked in.",
    packages=find_packages(include=["specbuild", "specbuild.*"]),
    package_data={"specbuild": ["data/*.yaml", "data/heads/*/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch==2.13.0",
        "onnx>=1.16",
        "onnxscript>=0.5",
        "onnxruntime>=1.18",
        "numpy",
        "safetensors",
        "tokenizers",
        "transformers>=4.45",
        "gguf",
        "accelerate",
        "sentencepiece",
        "click",
        "rich",
        "pyyaml",
        "jinja2",
        "polygraphy",
    ],
    extras_require={
        "trt": ["tensorrt"],
        "bench": ["matplotlib", "openvino-genai"],
        "dev": ["pytest", "pytest-xdist", "hypothesis", "scipy", "ruff", "onnxruntime-genai>=0.18", "matplotlib"],
    },
    entry_points={"console_scripts": ["specbuild=specbuild.cli.main:cli"]},
)

"""Package metadata for specbuild.

`pip install specbuild` installs what running and inspecting an engine needs (the runtime: numpy + ONNX Runtime).
Building, training, serving and benchmarking against other stacks are extras; a command whose extra is missing says
which one to install (specbuild/cli/extras.py).
"""

from setuptools import find_packages, setup

TORCH = "torch==2.13.0"  # pinned: scripts/setup-venv.sh installs it first (an unpinned install may pull a CUDA build)
RUNTIME = [
    "numpy",
    "onnxruntime>=1.18",
    "onnx>=1.16",  # reads a graph's kernels for the row-invariance probe of int8-activation engines
    "tokenizers",
    "jinja2",  # chat templates
    "pyyaml",
    "click",
    "rich",
]
BUILD = [
    TORCH,
    "onnxscript>=0.5",
    "transformers>=4.45",
    "safetensors",
    "gguf",  # the embedded SmolLM2 ships as GGUF
    "accelerate",
    "sentencepiece",
]
TRAIN = BUILD  # training reads the base model through transformers and converts and builds what it trained
TRT = ["tensorrt", "polygraphy"]
SERVE = ["starlette>=0.40", "uvicorn>=0.30", "prometheus-client>=0.20"]
TRITON = [*SERVE, "nvidia-pytriton>=0.7"]  # pins numpy < 2; Triton 2.5x with its Python backend is inside the wheel
BENCH = ["matplotlib", "onnxruntime-genai>=0.18", "openvino-genai", "psutil"]  # psutil: a build's process tree's memory
DEV = [
    *BUILD,
    "polygraphy",
    "pytest",
    "pytest-xdist",
    "filelock",  # tests: what the xdist workers share is made once per run
    "hypothesis",
    "scipy",
    "ruff",
    "onnxruntime-genai>=0.18",
    "matplotlib",
    *SERVE,
    "openai",  # tests/serve: the client against a real server
    "httpx",
    "trustme",  # tests/serve: a certificate authority and server certificate for the TLS test
]

setup(
    name="specbuild",
    version="0.1.0",
    description="Ahead-of-time compiler for speculative decoding: ONNX step graphs with tree verification baked in.",
    packages=find_packages(include=["specbuild", "specbuild.*"]),
    package_data={"specbuild": ["data/*.yaml", "data/heads/*/*", "runtime/kernels/src/*.[ch]*"]},
    python_requires=">=3.10",
    install_requires=RUNTIME,
    extras_require={
        "build": BUILD,
        "train": TRAIN,
        "trt": TRT,
        "bench": BENCH,
        "serve": SERVE,
        "triton": TRITON,
        "dev": DEV,
    },
    entry_points={"console_scripts": ["specbuild=specbuild.cli.main:cli"]},
)

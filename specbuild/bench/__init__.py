"""Benchmarks (measurements, not tests): `sequential` times one prompt at a time beside the stacks a user could pick
instead (ONNX Runtime GenAI, OpenVINO GenAI, transformers); `load` runs the closed-loop load benchmark through the
scheduler (`specbuild bench --concurrency`); `serve` drives a running `specbuild serve` with AIPerf; `plot` draws
their figures."""

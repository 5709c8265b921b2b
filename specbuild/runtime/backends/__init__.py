"""Execution backends behind one small interface (onnxruntime on CPU, tensorrt on NVIDIA GPUs)."""

"""ONNX export, validation against torch and the machinery that keeps a large build's memory bounded; the TensorRT
plan."""

"""The torch dtype of each dtype name a checkpoint, an engine's tensors or a state spec uses: one table."""

import torch

FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # weights
TORCH_DTYPES = {**FLOAT_DTYPES, "int64": torch.int64, "bool": torch.bool}  # graph inputs, outputs and states

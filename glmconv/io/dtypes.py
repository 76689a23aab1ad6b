"""safetensors dtype names -> torch dtypes: the one table every reader and writer uses."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

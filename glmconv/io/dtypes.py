"""The one dtype table: safetensors dtype code <-> bytes per element <-> torch dtype.

The codes and sizes are plain data (planning, auditing and header validation run without torch); the torch
side is looked up only when asked for (`torch_dtype`, `torch_dtype_code`), importing torch then.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from glmconv.errors import CheckpointError

if TYPE_CHECKING:
    import torch

# safetensors code -> (bytes per element, torch dtype attribute; None where glmconv maps none)
_TABLE: dict[str, tuple[int, str | None]] = {
    "BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"), "F8_E5M2": (1, "float8_e5m2"), "F8_E8M0": (1, None),
    "I16": (2, "int16"), "U16": (2, "uint16"), "F16": (2, "float16"), "BF16": (2, "bfloat16"),
    "I32": (4, "int32"), "U32": (4, "uint32"), "F32": (4, "float32"),
    "I64": (8, "int64"), "U64": (8, "uint64"), "F64": (8, "float64"),
}

DTYPE_SIZES: dict[str, int] = {code: size for code, (size, _) in _TABLE.items()}
"""Every dtype code a safetensors header may hold -> bytes per element."""


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {code: getattr(torch, name) for code, (_, name) in _TABLE.items() if name is not None}


def torch_dtype(code: str) -> torch.dtype:
    """"BF16" -> `torch.bfloat16` (torch is imported on the first call); a code torch has no dtype for is a KeyError."""
    return _torch_dtypes()[code]


_CODES: dict[str, str] = {name: code for code, (_, name) in _TABLE.items() if name is not None}
DTYPE_NAMES: frozenset[str] = frozenset(_CODES)
"""The torch dtype attributes (`bfloat16`) of the table: the dtypes a checkpoint may hold."""


def torch_dtype_code(dtype: object) -> str:
    """`torch.bfloat16` -> "BF16" (the plan's codes); a dtype outside the table is a CheckpointError.

    Looked up by name, so that whatever an untrusted `.metadata` holds in its place is refused, not hashed.
    """
    code = _CODES.get(str(dtype).removeprefix("torch."))
    if code is None:
        raise CheckpointError(f"unsupported tensor dtype {dtype}")
    return code

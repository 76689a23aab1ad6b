"""A restricted unpickler for DCP `.metadata` files: only torch's checkpoint-metadata classes may load.

The allow-list is what torch 2.13's `torch.distributed.checkpoint.save` and megatron-core 0.19's
torch_dist saver reference (listed with a recording unpickler in tests/test_dcp_metadata.py). Enum members
pickle by value on most Pythons and as `getattr(EnumClass, "NAME")` on some 3.11 patch releases: that
`getattr` is answered for members of the allow-listed enums only, never as the builtin.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from glmconv.errors import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *((_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                   "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                   "_MEM_FORMAT_ENCODING")),
    *((_DCP_PLANNER, n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                  "BytesIOWriteData")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name in a cache; calls nothing else
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
})
ENUMS: frozenset[tuple[str, str]] = frozenset({(_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
                                               (_DCP_PLANNER, "WriteItemType")})
_GETATTR = frozenset({("builtins", "getattr"), ("__builtin__", "getattr")})  # protocol 2 names it __builtin__


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only allow-listed globals (plus torch dtypes); everything else is refused."""

    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name in _torch_dtype_names():
            return super().find_class(module, name)
        if (module, name) in _GETATTR:
            return self._enum_member
        raise CheckpointError(f"{self._source}: refusing to unpickle {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self._source}: refusing to unpickle a persistent reference")

    def _enum_member(self, cls: Any, name: Any) -> Any:
        """`getattr(cls, name)` as 3.11's `pickle_by_enum_name` writes it: an allow-listed enum's member only."""
        where = (cls.__module__, cls.__qualname__) if isinstance(cls, type) else None
        members = getattr(cls, "__members__", {}) if where in ENUMS else {}
        if isinstance(name, str) and name in members:
            return members[name]
        what = f"{where[0]}.{where[1]}" if where else type(cls).__name__
        raise CheckpointError(f"{self._source}: refusing to unpickle builtins.getattr of {what}.{name!s:.40}")


def _torch_dtype_names() -> frozenset[str]:
    import torch

    return frozenset(k for k, v in vars(torch).items() if isinstance(v, torch.dtype))


def safe_load(path: str | Path) -> Any:
    """Unpickle `path` through the allow-list; a corrupt or hostile file is a CheckpointError."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            return RestrictedUnpickler(fh, p.name).load()  # type: ignore[arg-type]
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{p.name}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # any unpickling failure means a corrupt file
        raise CheckpointError(f"{p.name}: corrupt or truncated pickle ({type(exc).__name__}: {exc})") from None

"""A restricted unpickler for DCP `.metadata` files: only torch's checkpoint-metadata classes may load.

The allow-list is what torch 2.13's `torch.distributed.checkpoint.save` and megatron-core 0.19's
torch_dist saver reference (listed with a recording unpickler in tests/test_dcp_metadata.py). With
`stand_ins`, the same allow-list loads each class as an inert `StandIn` of the same name (a dtype as its name,
`torch.Size` as a tuple): what inspecting a checkpoint needs, without importing torch (its import is 1-6 s).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from glmconv.errors import CheckpointError
from glmconv.io.dtypes import DTYPE_NAMES

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


class StandIn:
    """An allow-listed object rebuilt as plain attributes (its class is a subclass named as the original); an
    enum's value is its first argument."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    FIELDS: tuple[str, ...] = ()  # the names of a state pickled as a tuple (`TensorProperties.__getstate__`)

    def __setstate__(self, state: Any) -> None:
        if self.FIELDS:
            state = dict(zip(self.FIELDS, state, strict=True))
        elif isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a slotted class
            state = {**(state[0] or {}), **(state[1] or {})}
        self.__dict__.update(state)


def is_stand_in(obj: Any, name: str) -> bool:
    """`obj` is the `StandIn` of the allow-listed class `name` (nothing else of that name gets in)."""
    return isinstance(obj, StandIn) and type(obj).__name__ == name


class StandInDtype(str):
    """A torch dtype as `str(torch.bfloat16)` spells it: "torch.bfloat16"."""


_STAND_IN_CALLS: dict[tuple[str, str], Any] = {("torch", "Size"): tuple, ("torch.serialization", "_get_layout"): str}
_STAND_INS: dict[tuple[str, str], type] = {}
_TUPLE_STATES = {"TensorProperties": ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")}


def _stand_in(module: str, name: str) -> Any:
    """The stand-in of an allow-listed global (one class per name, made once)."""
    if (module, name) in _STAND_IN_CALLS:
        return _STAND_IN_CALLS[(module, name)]
    if (module, name) not in _STAND_INS:
        fields = _TUPLE_STATES.get(name, ())
        _STAND_INS[(module, name)] = type(name, (StandIn,), {"__module__": f"glmconv.stand_in.{module}",
                                                             "FIELDS": fields})
    return _STAND_INS[(module, name)]


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only allow-listed globals (plus torch dtypes); everything else is refused. With `stand_ins`,
    each resolves to its `StandIn` and no module outside the allow-list's own is imported (torch is not)."""

    def __init__(self, file: io.BufferedIOBase, source: str, stand_ins: bool = False) -> None:
        super().__init__(file)
        self._source, self._stand_ins = source, stand_ins

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            torch_s = self._stand_ins and module.split(".")[0] == "torch"  # pathlib, collections: themselves
            return _stand_in(module, name) if torch_s else super().find_class(module, name)
        if module == "torch" and self._stand_ins and name in DTYPE_NAMES:
            return StandInDtype(f"torch.{name}")
        if module == "torch" and not self._stand_ins and name in _torch_dtype_names():
            return super().find_class(module, name)
        raise CheckpointError(f"{self._source}: refusing to unpickle {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self._source}: refusing to unpickle a persistent reference")


def _torch_dtype_names() -> frozenset[str]:
    import torch

    return frozenset(k for k, v in vars(torch).items() if isinstance(v, torch.dtype))


def safe_load(path: str | Path, *, stand_ins: bool = False) -> Any:
    """Unpickle `path` through the allow-list (`stand_ins`: as `StandIn`s, without torch); a corrupt or hostile
    file is a CheckpointError."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            return RestrictedUnpickler(fh, p.name, stand_ins).load()  # type: ignore[arg-type]
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{p.name}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # any unpickling failure means a corrupt file
        raise CheckpointError(f"{p.name}: corrupt or truncated pickle ({type(exc).__name__}: {exc})") from None

"""A restricted unpickler for DCP `.metadata` files: only torch's checkpoint-metadata classes may load.

The allow-list is what torch 2.13's `torch.distributed.checkpoint.save` and megatron-core 0.19's
torch_dist saver reference (listed with a recording unpickler in tests/io/test_dcp_metadata.py). With
`stand_ins`, the same allow-list loads each class as an inert `StandIn` of the same name (a dtype as its name,
`torch.Size` as a tuple): what inspecting a checkpoint needs, without importing torch (its import is 1-6 s).
Enum members pickle by value on most Pythons and as `getattr(EnumClass, "NAME")` on some 3.11 patch releases:
that `getattr` is answered for members of the allow-listed enums only, never as the builtin (with `stand_ins`,
as the stand-in the member's value would give).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from glmconv.errors import CheckpointError
from glmconv.io.dtypes import DTYPE_NAMES
from glmconv.io.torch_dist.dcp_classes import CLASSES, StandIn, origin_of
from glmconv.io.torch_dist.pickle_bounds import PickleOutOfBounds, check_pickle_bounds

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
ENUM_MEMBERS: dict[tuple[str, str], dict[str, int]] = {  # torch's own values (tests/io/test_dcp_metadata.py checks)
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1,
                                              "TORCH_PRESERVE_FORMAT": 2},
    (_DCP_PLANNER, "WriteItemType"): {"TENSOR": 1, "SHARD": 2, "BYTE_IO": 3},
}
ENUMS: frozenset[tuple[str, str]] = frozenset(ENUM_MEMBERS)
_GETATTR = frozenset({("builtins", "getattr"), ("__builtin__", "getattr")})  # protocol 2 names it __builtin__


_ALLOWED_BY_NAME = {name: (module, name) for module, name in ALLOWED}


def is_a(obj: Any, name: str) -> bool:
    """`obj` is an instance of the allow-listed class `name`, loaded as itself or as its `StandIn`: isinstance
    without importing torch."""
    origin = _ALLOWED_BY_NAME[name]
    stand_in = origin_of(type(obj))
    if stand_in is not None:
        return stand_in == origin
    return any((c.__module__, c.__qualname__) == origin for c in type(obj).__mro__)


class StandInDtype(str):
    """A torch dtype as `str(torch.bfloat16)` spells it: "torch.bfloat16"."""


def is_dtype(obj: Any) -> bool:
    """`obj` is a torch dtype, or its `StandInDtype`."""
    return isinstance(obj, StandInDtype) or (type(obj).__module__, type(obj).__qualname__) == ("torch", "dtype")


_STAND_IN_CALLS: dict[tuple[str, str], Any] = {("torch", "Size"): tuple, ("torch.serialization", "_get_layout"): str}
_STAND_INS: dict[tuple[str, str], type] = {}
DEFAULTS: dict[str, dict[str, Any]] = {  # the real planner classes' own defaults, which a state may leave out:
    # the same answer as the real class (tests/io/test_dcp_metadata.py checks them against torch's); the metadata
    # classes' stand-ins are `dcp_classes`' dataclasses, whose defaults are DCP's
    "SavePlan": {"storage_data": None, "planner_data": None, "usable": True},
    "WriteItem": {"bytes_io_data": None, "tensor_data": None},
}


def _stand_in(module: str, name: str) -> Any:
    """The stand-in of an allow-listed global: `dcp_classes`' for DCP's metadata classes, else one class per name,
    made once."""
    if (module, name) in _STAND_IN_CALLS:
        return _STAND_IN_CALLS[(module, name)]
    if (module, name) in CLASSES:
        return CLASSES[(module, name)]
    if (module, name) not in _STAND_INS:
        _STAND_INS[(module, name)] = type(name, (StandIn,), {"__module__": f"glmconv.stand_in.{module}",
                                                             "ORIGIN": (module, name),
                                                             **DEFAULTS.get(name, {})})
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
        if (module, name) in _GETATTR:
            return self._enum_member
        raise CheckpointError(f"{self._source}: refusing to unpickle {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self._source}: refusing to unpickle a persistent reference")

    def _enum_member(self, cls: Any, name: Any) -> Any:
        """`getattr(cls, name)` as 3.11's `pickle_by_enum_name` writes it: an allow-listed enum's member only."""
        stand_in = origin_of(cls)
        where = stand_in or ((cls.__module__, cls.__qualname__) if isinstance(cls, type) else None)
        if where not in ENUMS:
            members: dict[str, Any] = {}
        elif issubclass(cls, StandIn):  # the stand-in of the member's value, as a member pickled by value loads
            members = {n: cls(value) for n, value in ENUM_MEMBERS[where].items()}
        else:
            members = dict(cls.__members__)
        if isinstance(name, str) and name in members:
            return members[name]
        what = f"{where[0]}.{where[1]}" if where else type(cls).__name__
        raise CheckpointError(f"{self._source}: refusing to unpickle builtins.getattr of {what}.{name!s:.40}")


def _torch_dtype_names() -> frozenset[str]:
    import torch

    return frozenset(k for k, v in vars(torch).items() if isinstance(v, torch.dtype))


def safe_load(path: str | Path, *, stand_ins: bool = False) -> Any:
    """Unpickle `path` through the allow-list (`stand_ins`: as `StandIn`s, without torch); a corrupt or hostile
    file is a CheckpointError."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            pkl = fh.read()
        _check_bounds(pkl)
        return RestrictedUnpickler(io.BytesIO(pkl), p.name, stand_ins).load()
    except CheckpointError:
        raise
    except PickleOutOfBounds as exc:
        raise CheckpointError(f"{p.name}: refusing to unpickle: it {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"{p.name}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # any unpickling failure means a corrupt file
        raise CheckpointError(f"{p.name}: corrupt or truncated pickle ({type(exc).__name__}: {exc})") from None


def _check_bounds(pkl: bytes) -> None:
    """Before any unpickler: a memo bomb or a tuple nested past the C stack is refused. A malformed pickle is left
    to the unpickler, which names what it meets first (a refused global): the scan found every step before the
    malformation within bounds, and the unpickler takes the same steps in the same order."""
    try:
        check_pickle_bounds(pkl)
    except PickleOutOfBounds:
        raise
    except pickle.UnpicklingError:
        pass

"""Inert stand-ins of torch.distributed.checkpoint's metadata classes (torch 2.13), for reading and writing `.metadata`
without importing DCP's package (it pulls torch.distributed.tensor and sympy: 0.6-0.9 s per run).

Each mirrors its DCP class: the same fields in the same order with the same defaults, the same pickled state
(`__getstate__`) and the same attribute order, so `dumps` writes the bytes DCP's own `pickle.dump` writes
for the real objects, naming DCP's real globals (`ORIGIN`); the allow-listed unpickler (`safe_unpickle`, with
`stand_ins`) loads a `.metadata` into these same classes. Two differences, both for want of torch here:
`MetadataIndex` keeps `offset` as given (the writer passes a torch.Size, which DCP's `__init__` would make), and
`TensorProperties.memory_format` holds the pickled `_MEM_FORMAT_ENCODING`, not a torch.memory_format.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from glmconv.io.torch_dist.stand_in_pickler import StandInPickler

if TYPE_CHECKING:
    import torch

DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
DCP_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
CURRENT_DCP_VERSION = "1.0.0"  # torch 2.13 `filesystem.CURRENT_DCP_VERSION`, which `FileSystemWriter.finish` sets


class StandIn:
    """An allow-listed object rebuilt as plain attributes (its class is a subclass named as the original); an
    enum's value is its first argument."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    FIELDS: tuple[str, ...] = ()  # the names of a state pickled as a tuple (`TensorProperties.__getstate__`)
    ORIGIN: tuple[str, str] = ("", "")  # the allow-listed (module, name) this class stands in for

    def __setstate__(self, state: Any) -> None:
        """The state as attributes; names interned as pickle's own BUILD interns them, so that a stand-in passed
        between ranks (`gather_object`) pickles its names as the real class would: once, then by reference."""
        if self.FIELDS:
            state = dict(zip(self.FIELDS, state, strict=True))
        elif isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a slotted class
            state = {**(state[0] or {}), **(state[1] or {})}
        self.__dict__.update({sys.intern(k) if type(k) is str else k: v for k, v in state.items()})


class MemFormatEncoding(enum.Enum):
    """DCP's `_MEM_FORMAT_ENCODING`: an Enum as DCP's, so that this Python pickles a member as it pickles DCP's."""

    ORIGIN: ClassVar[tuple[str, str]]

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


MemFormatEncoding.ORIGIN = (DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING")  # set after: in the body it is a member


def _default_dtype() -> torch.dtype:
    import torch

    return torch.get_default_dtype()


def _strided() -> torch.layout:
    import torch

    return torch.strided


@dataclass
class ChunkStorageMetadata(StandIn):
    """One stored chunk of a tensor: where it starts and its sizes (torch.Size when written)."""

    ORIGIN = (DCP_METADATA_MODULE, "ChunkStorageMetadata")

    offsets: torch.Size
    sizes: torch.Size


@dataclass
class TensorProperties(StandIn):
    """A tensor's dtype (and deprecated fields), pickled as DCP's `__getstate__` does: a tuple of five."""

    ORIGIN = (DCP_METADATA_MODULE, "TensorProperties")
    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    dtype: torch.dtype = field(default_factory=_default_dtype)
    layout: torch.layout = field(default_factory=_strided)  # DCP: default=torch.strided, which needs torch
    requires_grad: bool = False
    memory_format: MemFormatEncoding = MemFormatEncoding.TORCH_CONTIGUOUS_FORMAT  # DCP pickles this encoding
    pin_memory: bool = False

    def __getstate__(self) -> tuple[Any, ...]:
        return self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory


@dataclass
class TensorStorageMetadata(StandIn):
    """A tensor entry: properties, global size and its chunks."""

    ORIGIN = (DCP_METADATA_MODULE, "TensorStorageMetadata")

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata(StandIn):
    """A bytes entry (a megatron ShardedObject)."""

    ORIGIN = (DCP_METADATA_MODULE, "BytesStorageMetadata")


@dataclass
class StorageMeta(StandIn):
    """Which save wrote the checkpoint (`FileSystemWriter.storage_meta`)."""

    ORIGIN = (DCP_METADATA_MODULE, "StorageMeta")

    checkpoint_id: Any = None  # str | os.PathLike | None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata(StandIn):
    """The whole `.metadata`: entries by key, and where each item is stored."""

    ORIGIN = (DCP_METADATA_MODULE, "Metadata")

    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex(StandIn):
    """The key of a stored item: fqn and, for a tensor chunk, its offsets; `index` is a lookup hint, not compared."""

    ORIGIN = (DCP_METADATA_MODULE, "MetadataIndex")

    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset: Sequence[int] | None = None, index: int | None = None) -> None:
        object.__setattr__(self, "fqn", fqn)  # DCP's order: fqn, index, then offset only when given
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", offset)


@dataclass
class StorageInfo(StandIn):
    """Where one item lies: data file, offset and length; DCP's `__getstate__` leaves out None fields."""

    ORIGIN = (DCP_FILESYSTEM_MODULE, "_StorageInfo")

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


CLASSES: dict[tuple[str, str], type] = {cls.ORIGIN: cls for cls in (
    ChunkStorageMetadata, TensorProperties, TensorStorageMetadata, BytesStorageMetadata, StorageMeta, Metadata,
    MetadataIndex, StorageInfo, MemFormatEncoding)}
_ORIGIN_OF = {cls: origin for origin, cls in CLASSES.items()}


def origin_of(cls: Any) -> tuple[str, str] | None:
    """The DCP global a stand-in class is pickled as (a generic `StandIn` too), or None for any other object."""
    if isinstance(cls, type) and issubclass(cls, StandIn) and cls.ORIGIN[0]:
        return cls.ORIGIN
    return _ORIGIN_OF.get(cls) if isinstance(cls, type) else None


def fields_of(obj: Any) -> dict[str, Any]:
    """A stand-in dataclass's fields by name, in order (what a test compares with DCP's)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


class _DcpPickler(StandInPickler):
    def stands_for(self, obj: Any) -> tuple[str, str] | None:
        return origin_of(obj)


def dumps(obj: Any) -> bytes:
    """`obj` pickled as DCP's `pickle.dump(metadata, f)` pickles the real classes: the same protocol and bytes."""
    buf = io.BytesIO()
    _DcpPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()

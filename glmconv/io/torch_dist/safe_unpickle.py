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

import hashlib
import io
import pickle
import pickletools
from pathlib import Path
from typing import Any

from glmconv.errors import CheckpointError
from glmconv.io.dtypes import DTYPE_NAMES
from glmconv.io.torch_dist.dcp_classes import CLASSES, StandIn, origin_of
from glmconv.io.torch_dist.passed import Passed

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


# ---- a pickle's bounds, checked before anything is unpickled ------------------------------------------------------

MAX_TUPLE_NESTING = 100  # a Megatron checkpoint's pickles nest tuples a few levels deep
_MEMO_SLACK = 1024  # memo indices a pickle may skip past its own size (pickle's own writers number them 0, 1, 2, ...)


class PickleOutOfBounds(pickle.UnpicklingError):
    """A pickle that glmconv does not unpickle: a tuple nested too deep, a memo index past what its size allows."""


_VALUE, _TUPLE, _SAME, _CALL, _PUT, _MEMOIZE, _GET, _MARK, _POP, _DUP = range(10)


def _actions() -> dict[int, tuple[int, bool, int, int]]:
    """Opcode byte -> (action, pops to a mark, items it pops below the mark or from the stack, items it pushes)."""

    named = {"EMPTY_TUPLE": _TUPLE, "TUPLE": _TUPLE, "TUPLE1": _TUPLE, "TUPLE2": _TUPLE, "TUPLE3": _TUPLE,
             **dict.fromkeys(("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD", "READONLY_BUFFER"),
                             _SAME),
             **dict.fromkeys(("REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST", "BINPERSID", "STACK_GLOBAL"), _CALL),
             "PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT, "MEMOIZE": _MEMOIZE, "GET": _GET, "BINGET": _GET,
             "LONG_BINGET": _GET, "MARK": _MARK, "POP": _POP, "DUP": _DUP}
    out = {}
    for op in pickletools.opcodes:
        before = op.stack_before
        marked = pickletools.markobject in before
        below = before.index(pickletools.markobject) if marked else len(before)
        out[ord(op.code)] = (named.get(op.name, _VALUE), marked, below, len(op.stack_after))
    return out


_ACTIONS: dict[int, tuple[int, bool, int, int]] = {}
_PASSED = Passed()  # (SHA-256, nesting) of the pickles the scan passed


def check_pickle_bounds(pkl: bytes, nesting: int = MAX_TUPLE_NESTING) -> None:
    """Refuse (`PickleOutOfBounds`) a pickle whose unpickling alone would exhaust the process, before any unpickler
    runs: (1) a tuple nested more than `nesting` tuples deep: hashing a tuple (a dict key, a set member, as
    unpickling builds them) recurses in C with no recursion guard, so one nested ~10^5 deep (a few hundred KB of
    pickle) kills the interpreter with SIGSEGV; (2) a memo index past the pickle's size: C's unpickler sizes its
    memo array by the largest index, so 12 bytes (`LONG_BINPUT 10^8`) take 1.5 GB.

    The scan replays the unpickler's stack, marks and memo with each item's tuple depth only: a tuple's depth is
    fixed when it is built (tuples are immutable); a list, dict or set resets it (a list or dict is unhashable, a
    frozenset caches its hash); a call (REDUCE, NEWOBJ, ...) is given the deepest of its inputs. Malformed
    opcodes, stack underflow and a missing memo entry are `pickle.UnpicklingError`, as the unpickler would say.
    Linear in the pickle's size: about 1 s a million opcodes. A pickle passed once is not scanned again in this
    process (by its SHA-256): a checkpoint's chunks of one shape carry the same pickle byte for byte, and a run
    reads the same `.metadata` more than once."""
    _PASSED.once((hashlib.sha256(pkl).digest(), nesting), lambda: _scan_bounds(pkl, nesting))


def _scan_bounds(pkl: bytes, nesting: int) -> None:
    """`check_pickle_bounds`' scan."""

    if not _ACTIONS:
        _ACTIONS.update(_actions())
    stack: list[int] = []  # the tuple depth of each item
    marks: list[int] = []  # the stack's height at each open MARK
    memo: dict[Any, int] = {}
    fence = 0  # the innermost mark's height: nothing below it may be popped until it is closed
    most = 2 * len(pkl) + _MEMO_SLACK
    try:
        for op, arg, pos in pickletools.genops(pkl):
            action, marked, below, pushed = _ACTIONS[ord(op.code)]
            if action == _MARK:
                marks.append(len(stack))
                fence = len(stack)
                continue
            if action == _POP and marks and fence == len(stack):
                marks.pop()
                fence = marks[-1] if marks else 0
                continue
            if action == _PUT or action == _MEMOIZE:
                if len(stack) <= fence:
                    raise pickle.UnpicklingError("memo put of an empty stack")
                index = arg if action == _PUT and isinstance(arg, int) else len(memo)
                if not 0 <= index < most:
                    raise PickleOutOfBounds(f"puts memo entry {index:,} (at byte {pos}), past the {most:,} a "
                                            f"pickle of {len(pkl):,} bytes may use")
                memo[index] = stack[-1]
                continue
            if action == _GET:
                if arg not in memo:
                    raise pickle.UnpicklingError(f"memo key {arg} is missing")
                stack.append(memo[arg])
                continue
            inputs: list[int] = []
            if marked:
                if not marks:
                    raise pickle.UnpicklingError("could not find MARK")
                inputs = stack[marks[-1]:]
                del stack[marks.pop():]
                fence = marks[-1] if marks else 0
            if below:
                if len(stack) - below < fence:
                    raise pickle.UnpicklingError("unpickling stack underflow")
                inputs = stack[-below:] + inputs  # in stack order: a container below its mark comes first
                del stack[-below:]
            if action == _TUPLE:
                depth = 1 + max(inputs, default=0)
                if depth > nesting:
                    raise PickleOutOfBounds(f"nests tuples more than {nesting} deep (at byte {pos})")
                stack.append(depth)
            elif action == _SAME or action == _CALL:
                stack.append(inputs[0] if action == _SAME else max(inputs, default=0))
            elif action == _DUP:
                stack += inputs * 2
            elif pushed:
                stack.append(0)
    except (ValueError, IndexError, KeyError) as exc:  # genops' own verdict on malformed opcodes
        raise pickle.UnpicklingError(str(exc) or type(exc).__name__) from None

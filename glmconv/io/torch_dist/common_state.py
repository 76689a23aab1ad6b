"""The non-tensor ("common") state of a Megatron torch_dist checkpoint, read safely and pickled back
(`glmconv.megatron_args` builds it from a config).

megatron-core 0.19.2 keeps it inside the DCP checkpoint as the bytes entry `common_state/shard_0_1`
(`torch.save([state])`); older checkpoints keep it in `common.pt` (`torch.save(state)`). See
docs/torch_dist.md for the evidence. Reading never unpickles anything outside an explicit allow-list.
"""

from __future__ import annotations

import argparse
import io
import pickle
import reprlib
import types
import zipfile
from collections import OrderedDict
from pathlib import Path, PurePath
from typing import Any

from glmconv.errors import CheckpointError
from glmconv.io.checkpoint_files import optional_file
from glmconv.io.file_names import COMMON_PT_NAME, COMMON_STATE_KEY
from glmconv.io.torch_dist.pickle_allow import OPAQUE_CLASSES, SAFE_CLASSES, OpaqueValue, load_allow_list
from glmconv.io.torch_dist.pickle_bounds import PickleOutOfBounds, check_pickle_bounds
from glmconv.io.torch_dist.reader import read_bytes_entry
from glmconv.io.torch_dist.stand_in_pickler import StandInPickler
from glmconv.io.torch_dist.stored_objects import NEVER_UNPICKLED, refused_global, torch_reason
from glmconv.io.torch_dist.zip_records import stored_record


class _StandInPickler(StandInPickler):
    """Writes an `OpaqueValue` class as the megatron global it stands for: megatron is never imported here."""

    def stands_for(self, obj: Any) -> tuple[str, str] | None:
        if isinstance(obj, type) and issubclass(obj, OpaqueValue) and obj is not OpaqueValue:
            return _module_and_name(obj.qualname)
        return None


STAND_IN_PICKLE = types.ModuleType("glmconv_stand_in_pickle")  # torch.save(..., pickle_module=STAND_IN_PICKLE)
STAND_IN_PICKLE.Pickler = _StandInPickler  # type: ignore[attr-defined]  # a module built here


def pickle_module_for(obj: Any) -> Any:
    """The pickle module `torch.save` needs for `obj`: `STAND_IN_PICKLE` when it holds a stand-in, else pickle.
    Each object is looked at once however often it is shared (a common state is a graph, not a tree)."""
    seen: set[int] = set()
    todo = [obj]
    while todo:
        value = todo.pop()
        if isinstance(value, OpaqueValue):
            return STAND_IN_PICKLE
        if id(value) not in seen:
            seen.add(id(value))
            todo.extend(child for _, child in _children(value))
    return pickle


# ---- what glmconv reads, bounded ---------------------------------------------------------------------------------
# A common state is untrusted input: a few KB of pickle can describe a graph whose walk (a value shared at every
# level: `x = [x, x]` 64 times) or whose nesting (100,000 lists deep) no recursive code survives. It is read only
# within these bounds; a Megatron trainer's is far inside them (args, counters and RNG states: a few KB, a few
# levels, a few thousand values).

MAX_COMMON_BYTES = 1 << 26  # the torch.save archive (tensors included: a trainer's RNG states)
MAX_COMMON_PICKLE = 1 << 22  # its data.pkl (a trainer's: a few KB); ~90 bytes of objects per byte at worst
MAX_DEPTH = 100  # levels of containers
MAX_VALUES = 1_000_000  # values reached, a shared one counted each time: what str(), repr and any walk would see
MAX_TEXT = 1 << 24  # characters of the strings, bytes and ints reached, a shared one counted each time it is reached
MAX_INT_BITS = 14_000  # a larger int has no str() (Python's 4,300-digit limit)
EXPECTED = "a Megatron common state (args, iteration, RNG states)"


def _children(value: Any) -> list[tuple[tuple[str, Any], Any]]:
    """(step, child) of each value `value` holds: a dict's keys and values, a sequence's or set's items, a
    namespace's attributes, a megatron stand-in's arguments and state, an object array's items."""
    if isinstance(value, dict):
        return [pair for k, v in value.items() for pair in ((("key", k), k), (("item", k), v))]
    if isinstance(value, list | tuple):
        return [(("index", i), v) for i, v in enumerate(value)]
    if isinstance(value, set | frozenset):
        return [(("member", None), v) for v in value]
    if isinstance(value, argparse.Namespace | types.SimpleNamespace):
        return [(("item", k), v) for k, v in vars(value).items()]
    if isinstance(value, OpaqueValue):
        args = getattr(value, "args", None) or ()
        return [*((("args", i), v) for i, v in enumerate(args)), (("state", None), value.state)]
    if type(value).__module__ == "numpy" and getattr(getattr(value, "dtype", None), "hasobject", False):
        return [(("index", i), v) for i, v in enumerate(value.ravel().tolist())]
    return []


def check_bounded(state: Any, source: str) -> None:
    """Refuse (one line naming `source`) a common state nested more than MAX_DEPTH levels deep, reaching more
    than MAX_VALUES values or MAX_TEXT characters of text (a shared value counted each time it is reached: what
    str(), a JSON dump or any walk would meet), holding an int wider than MAX_INT_BITS or a namespace attribute
    that is not named by a string. Iterative, and it stops at the first value past a bound: its work is bounded
    whatever the graph."""
    todo: list[tuple[Any, int, Any]] = [(state, 0, None)]  # (value, depth, path as (parent path, step))
    reached, text = 1, 0
    while todo:
        value, depth, path = todo.pop()
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise CheckpointError(f"{source}: common state holds an integer of {value.bit_length():,} bits at "
                                  f"{_path(path)}, expected at most {MAX_INT_BITS:,} bits in {EXPECTED}")
        if isinstance(value, argparse.Namespace | types.SimpleNamespace):
            name = next((k for k in vars(value) if not isinstance(k, str)), None)
            if name is not None:  # argparse's repr (str(args)) fails on one
                raise CheckpointError(f"{source}: common state holds a namespace with an attribute named "
                                      f"{short_repr(name)} at {_path(path)}, expected string names in {EXPECTED}")
        text += _text(value)
        if text > MAX_TEXT:
            raise _reaches_more(source, MAX_TEXT, "characters of text (a shared value", path)
        children = _children(value)
        if not children:
            continue
        if depth >= MAX_DEPTH:
            raise CheckpointError(f"{source}: common state nests more than {MAX_DEPTH} levels deep at "
                                  f"{_path(path)}, expected at most {MAX_DEPTH} in {EXPECTED}")
        reached += len(children)
        if reached > MAX_VALUES:
            raise _reaches_more(source, MAX_VALUES, "values (a shared one", path)
        todo.extend((child, depth + 1, (path, step)) for step, child in children)


def _text(value: Any) -> int:
    """The characters `value` itself shows as (its children aside): a string's, bytes', an int's digits, a path's."""
    if isinstance(value, str | bytes | bytearray):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if isinstance(value, PurePath):
        return len(str(value))
    return 1


def _reaches_more(source: str, bound: int, what: str, path: Any) -> CheckpointError:
    """The refusal of a walk that reaches more than `bound` of `what`, naming one path on the way."""
    return CheckpointError(f"{source}: common state reaches more than {bound:,} {what} counted each time it is "
                           f"reached; {_path(path)} is one), expected at most {bound:,} in {EXPECTED}")


def _path(path: Any) -> str:
    """`args.moe_layer_freq[3]`: the steps from the state to one value (the first and last three of a long path)."""
    steps: list[str] = []
    while path is not None:
        path, (kind, key) = path
        if kind == "item":
            steps.append(f".{key}" if isinstance(key, str) and key.isidentifier() else f"[{short_repr(key)}]")
        elif kind == "index":
            steps.append(f"[{key}]")
        else:
            steps.append({"key": "<a key>", "member": "<a set member>", "state": "<state>"}.get(kind, f"<{kind}>"))
    steps.reverse()
    if len(steps) > 6:
        steps = [*steps[:3], f"[...{len(steps) - 6} more...]", *steps[-3:]]
    return "".join(steps).lstrip(".") or "the top level"


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 40


def short_repr(value: Any) -> str:
    """A bounded repr of any value read from a common state (a key, a value shown in a message)."""
    try:
        return _REPR.repr(value)
    except Exception:  # an int past Python's str() limit, a stand-in whose repr fails: its type says enough
        return f"<{type(value).__name__}>"


def load_common_state(data: bytes, *, source: str) -> dict[str, Any]:
    """Unpickle a common state (`[state]` from DCP, or a bare dict from common.pt) through the allow-list and within
    glmconv's bounds: the archive's size and records (`_data_pkl`), its pickle's tuple nesting and memo before
    anything is unpickled (`check_pickle_bounds`), then the state's depth, size and ints (`check_bounded`).
    Without torch where it holds only allow-listed classes (`_without_torch`), else with torch's weights_only."""
    if len(data) > MAX_COMMON_BYTES:
        raise CheckpointError(f"{source}: common state is {len(data):,} bytes, expected at most "
                              f"{MAX_COMMON_BYTES:,} for {EXPECTED}")
    pkl = _data_pkl(data, source)
    try:
        check_pickle_bounds(pkl)
    except PickleOutOfBounds as exc:
        raise CheckpointError(f"{source}: common state {exc}, expected {EXPECTED}") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{source}: common state is not a readable torch archive ({exc})") from None
    obj = _without_torch(pkl)
    if obj is None:
        obj = _with_torch(data, source)
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{source}: common state is a {type(obj).__name__}, expected a dict")
    check_bounded(obj, source)
    return obj


def _data_pkl(data: bytes, source: str) -> bytes:
    """The one `<archive>/data.pkl` record of a torch.save archive, checked as torch.save writes them: every record
    stored uncompressed and inside the archive (so nothing unpacks to more than the archive holds), exactly one
    data.pkl (the one torch.load reads), at most MAX_COMMON_PICKLE bytes."""
    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{source}: common state is not a readable torch archive ({why})")

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise refuse(f"not a zip archive: {_line(exc)}") from None
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
            raise refuse(f"record {info.filename!r} is compressed or larger than the archive; torch.save stores "
                         "every record uncompressed")
    pickles = [i for i in infos if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")]
    if len(pickles) != 1:
        raise refuse(f"{len(pickles)} data.pkl records, expected 1")
    if pickles[0].file_size > MAX_COMMON_PICKLE:
        raise CheckpointError(f"{source}: common state's {pickles[0].filename} is {pickles[0].file_size:,} bytes, "
                              f"expected at most {MAX_COMMON_PICKLE:,} for {EXPECTED}")
    pkl = stored_record(io.BytesIO(data), 0, len(data), pickles[0], MAX_COMMON_PICKLE)
    if pkl is None:
        raise refuse(f"record {pickles[0].filename!r} is not where its zip entry says")
    return pkl


class _TorchDecides(Exception):
    """Something `_without_torch` does not read (a tensor, another global, another format): torch.load decides."""


def _module_and_name(qualname: str) -> tuple[str, str]:
    """`"a.b.C"` -> `("a.b", "C")`, as pickle names a global."""
    module, _, name = qualname.rpartition(".")
    return module, name


class _PlainUnpickler(pickle.Unpickler):
    """The allow-list of `_with_torch` (SAFE_CLASSES, the opaque megatron stand-ins, OrderedDict), nothing else."""

    ALLOWED: dict[tuple[str, str], Any] = {
        **{(c.__module__, c.__qualname__): c for c in SAFE_CLASSES},
        **{_module_and_name(name): cls for cls, name in OPAQUE_CLASSES},
        ("collections", "OrderedDict"): OrderedDict}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise _TorchDecides
        return self.ALLOWED[(module, name)]

    def persistent_load(self, pid: Any) -> Any:
        raise _TorchDecides


def _without_torch(pkl: bytes) -> Any:
    """The data.pkl of a `torch.save` archive holding no tensor and only allow-listed classes, read with pickle
    (torch takes 1-6 s to import); None where torch.load has to decide."""
    try:
        return _PlainUnpickler(io.BytesIO(pkl)).load()
    except Exception:  # anything unusual: torch.load gives its verdict, as it always did
        return None


def _with_torch(data: bytes, source: str) -> Any:
    """torch.load with weights_only and the allow-list; its refusals as one line naming `source`."""
    import torch

    try:
        with torch.serialization.safe_globals(load_allow_list()):
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # any failure of the weights-only unpickler: a refused global, a damaged archive
        name = refused_global(exc)
        if name is not None:
            raise CheckpointError(f"{source}: common state holds the disallowed global {name}; refusing to "
                                  f"unpickle it ({NEVER_UNPICKLED})") from None
        raise CheckpointError(f"{source}: common state is not a readable torch archive ({torch_reason(exc)})") from None
    return obj


def read_common_state(ckpt_dir: str | Path, metadata: Any = None) -> dict[str, Any]:
    """The common state of a torch_dist checkpoint directory: legacy `common.pt` first, as megatron does
    (`metadata`: its `.metadata`, already read by `inspect_torch_dist`: not unpickled again)."""
    d = Path(ckpt_dir)
    legacy = optional_file(d, COMMON_PT_NAME)
    if legacy is not None:
        return load_common_state(_read_at_most(legacy), source=str(legacy))
    data = read_bytes_entry(d, COMMON_STATE_KEY, limit=MAX_COMMON_BYTES, expected=EXPECTED, metadata=metadata)
    return load_common_state(data, source=f"{d}:{COMMON_STATE_KEY}")


def _read_at_most(path: Path) -> bytes:
    """`path`'s bytes, refused unread past MAX_COMMON_BYTES."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_COMMON_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > MAX_COMMON_BYTES:
        raise CheckpointError(f"{path}: common state is more than {MAX_COMMON_BYTES:,} bytes, expected at most "
                              f"{MAX_COMMON_BYTES:,} for {EXPECTED}")
    return data


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

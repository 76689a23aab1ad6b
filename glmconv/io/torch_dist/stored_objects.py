"""Every stored object of a torch_dist checkpoint, checked the way a trainer's load will read it.

A Megatron load reads each non-tensor DCP entry (`_extra_state`, the common state, any other ShardedObject)
with `torch.load(weights_only=False)` (torch 2.13 `DefaultLoadPlanner.load_bytes`) and each tensor archive with
`torch.load(map_location="cpu", weights_only=True)` (`FileSystemReader.read_data`). glmconv never unpickles
with `weights_only=False`; instead an object must load through torch's weights-only unpickler with the
allow-list a Megatron trainer registers (`pickle_allow.load_allow_list`: its RNG states, BytesIO extra states),
and its pickles must also pass the real unpickler with every global replaced by an inert stand-in
(`_InertUnpickler`: nothing is built or called), which refuses what weights-only tolerates but a real load
does not (an unsupported protocol number). Tensor archives whose bytes are copied without being read
(export's zero-copy path) are loaded on the meta device: every check torch makes but the data's copy.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
import zipfile
from typing import Any

from glmconv.errors import CheckpointError
from glmconv.io.torch_dist.passed import Passed
from glmconv.io.torch_dist.pickle_allow import load_allow_list
from glmconv.io.torch_dist.pickle_bounds import check_pickle_bounds
from glmconv.io.torch_dist.zip_records import record_start, stored_record

_MAX_PICKLE = 1 << 26  # a stored object's pickle record larger than this is refused unread


def check_object(data: bytes, where: str) -> None:
    """One stored object: its pickles' bounds (`check_pickle_bounds`, before anything is unpickled), then
    weights-only torch.load, then its pickles through the real unpickler (inert globals). Bytes that passed pass
    again unloaded (by their SHA-256): a checkpoint's `_extra_state`s are mostly one object (a bench's 1,736: 2)."""
    _OBJECTS_PASSED.once(hashlib.sha256(data).digest(), lambda: _check_object(data, where))


_OBJECTS_PASSED = Passed()  # SHA-256 of the stored objects that passed


def _check_object(data: bytes, where: str) -> None:
    import torch

    try:
        pickles = bounded_pickles(io.BytesIO(data))
        with torch.serialization.safe_globals(load_allow_list()):
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        for pkl in pickles:
            _InertUnpickler(io.BytesIO(pkl)).load()
    except Exception as exc:  # any failure: a trainer's torch.load fails too
        raise CheckpointError(f"{where}: stored object is not loadable by torch.load ({_line(exc)})") from None


def check_tensor_archive(fh: Any, where: str, dtype: Any, sizes: tuple[int, ...],
                         records: list[zipfile.ZipInfo] | None = None) -> None:
    """A tensor archive whose data bytes are copied unread: its pickles' bounds, then every other check torch.load
    makes, on the meta device; `fh` is the archive's window (seekable, positioned anywhere). An archive byte for
    byte one that passed, but for its data and its random `serialization_id` (which torch.load only decodes and
    logs), passes too: a checkpoint glmconv wrote has its chunks of one shape checked once a process (a bench
    checkpoint: 2,040 chunks, 38 kinds); a trainer's torch.save writes each data record's CRC-32, so its chunks
    differ and each is checked. `records`: the archive's zip directory, where the caller has read it already."""
    _ARCHIVES_PASSED.once(_archive_key(fh, dtype, sizes, records),
                          lambda: _check_tensor_archive(fh, where, dtype, sizes))


_ARCHIVES_PASSED = Passed()  # `_archive_key`s of the archives that passed
_KEY_BYTES_MAX = 1 << 20  # an archive with more than this outside its data records: checked, not keyed
_SERIALIZATION_ID = "/.data/serialization_id"  # torch.load only logs it, as a str (torch 2.13 serialization.py)


def _archive_key(fh: Any, dtype: Any, sizes: tuple[int, ...], records: list[zipfile.ZipInfo] | None) -> bytes | None:
    """Every byte of a tensor archive but its data records' content and its `serialization_id`'s (what torch.load
    on the meta device does not read), hashed with the dtype and sizes expected; None where the records cannot be
    located by hand (then the archive is checked)."""
    try:
        fh.seek(0, io.SEEK_END)
        length = fh.tell()
        fh.seek(0)
        if records is None:
            with zipfile.ZipFile(fh) as z:
                records = z.infolist()
        skipped = []
        for info in records:
            if "/data/" in info.filename or info.filename.endswith(_SERIALIZATION_ID):
                start = record_start(fh, 0, length, info)
                if start is None or info.filename.endswith(_SERIALIZATION_ID) and not _utf8(fh, start, info.file_size):
                    return None
                skipped.append((start, start + info.file_size))
        h = hashlib.sha256(repr((str(dtype), sizes, length)).encode())
        at, kept = 0, 0
        for start, stop in sorted(skipped) + [(length, length)]:
            if start < at or kept + start - at > _KEY_BYTES_MAX:
                return None  # overlapping records, or an archive that is mostly not data
            fh.seek(at)
            h.update(fh.read(start - at))
            at, kept = stop, kept + start - at
        return h.digest()
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None


def _utf8(fh: Any, start: int, size: int) -> bool:
    """Whether the record's bytes decode as UTF-8, as torch.load's logging of a serialization id needs."""
    fh.seek(start)
    try:
        fh.read(size).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _check_tensor_archive(fh: Any, where: str, dtype: Any, sizes: tuple[int, ...]) -> None:
    import torch

    try:
        pickles = bounded_pickles(fh)
        fh.seek(0)
        tensor = torch.load(fh, map_location="meta", weights_only=True)
        for pkl in pickles:
            _InertUnpickler(io.BytesIO(pkl)).load()
    except Exception as exc:
        raise CheckpointError(f"{where}: chunk is not a readable tensor ({_line(exc)})") from None
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != sizes or tensor.dtype != dtype:
        got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise CheckpointError(f"{where}: chunk holds {got}, metadata says {sizes} {dtype}")


def bounded_pickles(fh: Any) -> list[bytes]:
    """The archive's pickles, each within `check_pickle_bounds` (else `PickleOutOfBounds`): what may be unpickled."""
    pickles = _pickles_of(fh)
    for pkl in pickles:
        check_pickle_bounds(pkl)
    return pickles


def _pickles_of(fh: Any) -> list[bytes]:
    """The top-level `*/data.pkl` records of a torch.save archive (no CRC check: torch.load makes none)."""

    fh.seek(0, io.SEEK_END)
    length = fh.tell()
    fh.seek(0)
    with zipfile.ZipFile(fh) as z:
        infos = [i for i in z.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    out = []
    for info in infos:
        record = stored_record(fh, 0, length, info, _MAX_PICKLE)
        if record is None:
            raise pickle.UnpicklingError(f"{info.filename} is not a stored record")
        out.append(record)
    return out


class _Inert:
    """What every global and persistent id becomes in `_InertUnpickler`: accepts anything, does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


class _InertUnpickler(pickle.Unpickler):
    """The real unpickler (protocol, opcodes, stack, memo) over a pickle whose globals build nothing."""

    def find_class(self, module: str, name: str) -> Any:
        return _Inert  # a type: REDUCE calls it, NEWOBJ builds it, BUILD sets its state; none does anything

    def persistent_load(self, pid: Any) -> Any:
        return _Inert()


NEVER_UNPICKLED = "not on the allow-list, and glmconv never unpickles a global outside it"
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)|unsupported GLOBAL ([\w.]+)", re.IGNORECASE)


def refused_global(exc: BaseException) -> str | None:
    """The global torch's weights-only unpickler refused (`builtins.eval`, `posix.system`), or None. torch names
    a builtin without its module (`eval`); it is named in full here."""
    found = _REFUSED_GLOBAL.search(str(exc))
    if found is None:
        return None
    name = found.group(1) or found.group(2)
    return name if "." in name else f"builtins.{name}"


def torch_reason(exc: BaseException) -> str:
    """Why torch.load failed, in one line: the refused global by name, else the weights-only unpickler's own words,
    never torch's advice to allow-list what it refused or to load with weights_only=False."""
    name = refused_global(exc)
    if name is not None:
        return f"refusing to unpickle {name}: {NEVER_UNPICKLED}"
    found = re.search(r"WeightsUnpickler error:\s*(.+)", str(exc))
    if found:
        reason = re.sub(r"\s*Please use `torch\.serialization\.(add_)?safe_globals.*", "", found.group(1).strip())
        reason = re.sub(r"(?:allowlisted )?via `add_safe_globals`", "on the allow-list", reason)
        return "refused by the weights-only unpickler: " + reason
    return _first_line(exc)


def _line(exc: BaseException) -> str:
    """The reason in one line: the refused global, or the weights-only unpickler's own words when it refused
    something."""
    if "WeightsUnpickler error:" in str(exc) or refused_global(exc):
        return torch_reason(exc)
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__

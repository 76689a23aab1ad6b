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
import re
import types
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

from glmconv.errors import CheckpointError
from glmconv.io.checkpoint_files import optional_file
from glmconv.io.file_names import COMMON_PT_NAME, COMMON_STATE_KEY
from glmconv.io.torch_dist.pickle_allow import OPAQUE_CLASSES, SAFE_CLASSES, OpaqueValue, load_allow_list
from glmconv.io.torch_dist.reader import read_bytes_entry
from glmconv.io.torch_dist.stand_in_pickler import StandInPickler


class _StandInPickler(StandInPickler):
    """Writes an `OpaqueValue` class as the megatron global it stands for: megatron is never imported here."""

    def stands_for(self, obj: Any) -> tuple[str, str] | None:
        if isinstance(obj, type) and issubclass(obj, OpaqueValue) and obj is not OpaqueValue:
            return _module_and_name(obj.qualname)
        return None


STAND_IN_PICKLE = types.ModuleType("glmconv_stand_in_pickle")  # torch.save(..., pickle_module=STAND_IN_PICKLE)
STAND_IN_PICKLE.Pickler = _StandInPickler  # type: ignore[attr-defined]  # a module built here


def pickle_module_for(obj: Any) -> Any:
    """The pickle module `torch.save` needs for `obj`: `STAND_IN_PICKLE` when it holds a stand-in, else pickle."""
    return STAND_IN_PICKLE if any(isinstance(v, OpaqueValue) for _, v in _walk(obj)) else pickle


def _walk(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of every value in a common state (dicts, lists, namespaces), depth first."""
    if isinstance(obj, dict):
        items = [(f"{path}.{k}" if path else str(k), v) for k, v in obj.items()]
    elif isinstance(obj, list | tuple):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, argparse.Namespace | types.SimpleNamespace):
        items = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    else:
        return []
    return [pair for key, value in items for pair in ((key, value), *_walk(value, key))]


def load_common_state(data: bytes, *, source: str) -> dict[str, Any]:
    """Unpickle a common state (`[state]` from DCP, or a bare dict from common.pt) through the allow-list: without
    torch where it holds only allow-listed classes (`_without_torch`), else with torch's weights_only."""
    obj = _without_torch(data)
    if obj is None:
        obj = _with_torch(data, source)
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{source}: common state is a {type(obj).__name__}, expected a dict")
    return obj


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


def _without_torch(data: bytes) -> Any:
    """A `torch.save` archive holding no tensor and only allow-listed classes, read with zipfile and pickle (torch
    takes 1-6 s to import); None where torch.load has to decide."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            pickles = [n for n in z.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(pickles) != 1:
                return None
            return _PlainUnpickler(io.BytesIO(z.read(pickles[0]))).load()
    except Exception:  # anything unusual: torch.load gives its verdict, as it always did
        return None


def _with_torch(data: bytes, source: str) -> Any:
    """torch.load with weights_only and the allow-list; its refusals as one line naming `source`."""
    import torch

    try:
        with torch.serialization.safe_globals(load_allow_list()):
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"unsupported global:?\s+(?:GLOBAL\s+)?([\w.]+)", str(exc), re.IGNORECASE)  # torch 2.6 / 2.13
        if found:
            raise CheckpointError(f"{source}: common state holds the disallowed global {found.group(1)}; "
                                  "refusing to unpickle it") from None
        raise CheckpointError(f"{source}: common state is not a readable torch archive ({_why(exc)})") from None
    except Exception as exc:  # any failure of the weights-only unpickler: a damaged archive
        raise CheckpointError(f"{source}: common state is not a readable torch archive ({_line(exc)})") from None
    return obj


def read_common_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The common state of a torch_dist checkpoint directory: legacy `common.pt` first, as megatron does."""
    d = Path(ckpt_dir)
    legacy = optional_file(d, COMMON_PT_NAME)
    if legacy is not None:
        return load_common_state(legacy.read_bytes(), source=str(legacy))
    return load_common_state(read_bytes_entry(d, COMMON_STATE_KEY), source=f"{d}:{COMMON_STATE_KEY}")


def _why(exc: Exception) -> str:
    """The WeightsUnpickler's own reason, without torch's multi-paragraph advice."""
    found = re.search(r"WeightsUnpickler error:\s*(.+)", str(exc))
    return found.group(1).strip() if found else _line(exc)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

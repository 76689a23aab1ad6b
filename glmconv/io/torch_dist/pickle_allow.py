"""The classes a Megatron common state may hold: real ones that are safe to build, and inert stand-ins for
megatron-core's own allow-list, so that reading a checkpoint never needs or imports megatron."""

from __future__ import annotations

import argparse
import copyreg
import functools
import io
import pathlib
import signal
import types
from typing import Any

# Classes a Megatron trainer's common state may hold and that are safe to build for real.
SAFE_CLASSES: tuple[type, ...] = (argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals)
# megatron-core classes (its own weights_only allow-list, megatron/core/safe_globals.py) that trainer
# args may hold. They load as inert `OpaqueValue`s, so reading never needs or imports megatron.
OPAQUE_GLOBALS: tuple[str, ...] = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)


class OpaqueValue:
    """Inert stand-in for an allow-listed megatron object: keeps its constructor args and state, runs nothing.

    Pickled by `STAND_IN_PICKLE`, it is written back as the megatron object it stands for: the same global, called
    with the same args (an enum) or built from the same state (a dataclass), so a trainer loads the original."""

    qualname = "?"
    state: Any = None

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        args = getattr(self, "args", None)  # None: it was made by NEWOBJ (cls.__new__), as copyreg pickles objects
        if args is None:
            return (copyreg.__newobj__, (type(self),), self.state)  # type: ignore[attr-defined]  # typeshed omits it
        return (type(self), args) if self.state is None else (type(self), args, self.state)

    def __repr__(self) -> str:
        return f"<{self.qualname} {getattr(self, 'args', None) or self.state!r}>"


def _opaque_allow_list() -> list[tuple[type, str]]:
    return [(type(name.rsplit(".", 1)[1], (OpaqueValue,), {"qualname": name}), name) for name in OPAQUE_GLOBALS]


OPAQUE_CLASSES = _opaque_allow_list()  # (stand-in class, the megatron global it stands for)


@functools.cache
def trainer_globals() -> tuple[Any, ...]:
    """The rest of megatron-core's weights_only allow-list (megatron/core/safe_globals.py), which a trainer registers
    before it loads: numpy arrays (the RNG states it saves), torch Generators, and the BytesIO `_extra_state` older
    Transformer Engine writes. Made on first use: numpy and torch are imported only by a load."""
    import numpy
    import torch
    from numpy._core.multiarray import _reconstruct
    from numpy.dtypes import UInt32DType

    return (_reconstruct, numpy.ndarray, numpy.dtype, UInt32DType, io.BytesIO, torch._C.Generator)


def load_allow_list() -> list[Any]:
    """Every global a weights-only load of a stored object may build, as a Megatron trainer's load allows them."""
    return [*SAFE_CLASSES, *OPAQUE_CLASSES, *trainer_globals()]  # a stand-in is given with the name it stands for

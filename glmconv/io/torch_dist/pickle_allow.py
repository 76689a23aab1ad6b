"""The classes a Megatron common state may hold: real ones that are safe to build, and inert stand-ins for
megatron-core's own allow-list, so that reading a checkpoint never needs or imports megatron."""

from __future__ import annotations

import argparse
import copyreg
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

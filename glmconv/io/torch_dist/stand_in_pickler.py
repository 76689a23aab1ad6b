"""pickle's own (Python) pickler, writing a stand-in class as the global it stands for, by name.

The C pickler imports every global it writes, to check it is the object pickled: a stand-in (a megatron class in
a common state, a DCP metadata class) would import what it stands in for. This one writes the name only; the
reading side's unpickler finds the real class there.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    class _PyPickler(pickle._Pickler):
        """The Python pickler's undocumented internals that `StandInPickler` uses (typeshed leaves them out)."""

        proto: int

        def save(self, obj: object) -> None: ...
        def write(self, data: bytes) -> None: ...
        def memoize(self, obj: object) -> None: ...
        def save_global(self, obj: object, name: str | None = None) -> None: ...
else:
    _PyPickler = pickle._Pickler  # the Python pickler: save_global can be overridden


class StandInPickler(_PyPickler):
    """A pickler whose `stands_for` names the (module, qualname) a stand-in class is written as."""

    def stands_for(self, obj: Any) -> tuple[str, str] | None:
        """The global `obj` is written as, or None: `obj` is pickled as itself."""
        return None

    def save_global(self, obj: Any, name: str | None = None) -> None:
        origin = self.stands_for(obj)
        if origin is None:
            super().save_global(obj, name)
            return
        module, qualname = origin
        if self.proto >= 4:  # what pickle's own save_global writes for a module-level class
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)

"""The context manager of a holder of open files: leaving the `with` block closes it, however the block ends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self


class Closing(ABC):
    """`with holder:` calls `holder.close()` at the end; `close` releases what the holder has open."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Release the files (descriptors, maps) this holder has open."""

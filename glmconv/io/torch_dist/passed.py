"""Checks a process need not repeat: content that passed one passes again unchecked (by a key naming its bytes),
while content that failed is checked, and refused, every time."""

from __future__ import annotations

from collections.abc import Callable, Hashable

MOST = 1 << 16  # keys kept at most (a few MB); past them, content is checked every time


class Passed(set[Hashable]):
    """The keys of the content that passed a check in this process."""

    def once(self, key: Hashable | None, check: Callable[[], None]) -> None:
        """`check()` unless `key` passed it before (None: content that cannot be keyed, always checked)."""
        if key is not None and key in self:
            return
        check()
        if key is not None and len(self) < MOST:
            self.add(key)

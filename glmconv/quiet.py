"""The dependencies' import- and load-time warnings, kept off the user's terminal."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet() -> Iterator[None]:
    """megatron-core's and fla's warnings on import and load (no Transformer Engine, no Apex, DCP deprecations, a
    CPU fallback) are about their training paths, not what glmconv runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield

"""The checks of plain option values, shared by the command line and the Python API, so both refuse alike.

Each check returns the value to use or raises `GlmconvError` naming the option as its caller spells it: the CLI
passes its flag (`--group-size`, `HF_DIR`), the Python API its keyword (`group_bytes`, `hf_dir`), which the
message then shows as `keyword=<repr of the value>` with the Python type expected. The CLI's click types call
the same functions, so a range or a choice is defined here once.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard, TypeVar, cast

from glmconv.defaults import AUTO, MAX_WORKERS, READ_THREADS_RANGE
from glmconv.errors import GlmconvError
from glmconv.text import decimal, show

MAX_SIZE = 2**50  # 1 PiB: more than any checkpoint file; anything above is a typo
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes

F = TypeVar("F", bound=Callable[..., Any])


class ArgumentError(GlmconvError):
    """An option's value out of its range or choices; `detail` is the message without the option's name (click's
    usage error names the option itself). A Python keyword is shown `keyword=<repr>`, so '5' and 5 differ."""

    def __init__(self, option: str, value: object, expected: str) -> None:
        self.detail = f"{show(value)}: {expected}"
        super().__init__(f"{option}={show(value, quote=True)}: {expected}" if keyword(option) else
                         f"{option} {self.detail}")


def keyword(option: str) -> bool:
    """`option` is a Python keyword (`group_bytes`), not a CLI flag (`--group-size`) or argument (`HF_DIR`)."""
    return option.isidentifier() and not option.isupper()


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def workers(value: object, option: str = "--workers") -> int | str:
    """`--workers`: a count from 1 to MAX_WORKERS (an int, or its digits as text) or `auto`."""
    if value == AUTO:
        return AUTO
    if isinstance(value, str) and decimal(value.strip()) is not None:
        value = decimal(value.strip())
    if _is_int(value) and 1 <= value <= MAX_WORKERS:
        return value
    raise ArgumentError(option, value, f"expected a count from 1 to {MAX_WORKERS}, or auto" if not keyword(option)
                        else f"expected an int from 1 to {MAX_WORKERS}, or 'auto'")


def int_in(option: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """An int (never a bool or a float) from `low` to `high` (either None: no bound here; the run checks it)."""
    if _is_int(value) and (low is None or low <= value) and (high is None or value <= high):
        return value
    span = ("" if low is None and high is None else f" from {low} to {high}" if low is not None and high is not None
            else f" of at least {low}" if low is not None else f" of at most {high}")
    raise ArgumentError(option, value, f"expected {'an int' if keyword(option) else 'a whole number'}{span}")


def read_threads(value: object, option: str = "--read-threads") -> int:
    """`--read-threads`: threads per worker reading ahead of its writer."""
    return int_in(option, value, *READ_THREADS_RANGE)


def size(option: str, value: object) -> int:
    """A byte count from 1 to 1 PiB (the CLI parses `5GB` into one first; the API takes the int)."""
    if _is_int(value) and 1 <= value <= MAX_SIZE:
        return value
    if not keyword(option):
        raise ArgumentError(option, value, f"expected a size from 1 byte to 1PiB ({MAX_SIZE} bytes)")
    text = "; text such as '1GB' is the command line's spelling only" if isinstance(value, str) else ""
    raise ArgumentError(option, value, f"expected a number of bytes, an int from 1 to {MAX_SIZE} (1 PiB){text}")


def text(option: str, value: object) -> str:
    """A non-empty str (a device name, a list of names)."""
    if isinstance(value, str) and value:
        return value
    raise ArgumentError(option, value, "expected a non-empty str")


def texts(option: str, value: object) -> tuple[str, ...]:
    """A list or tuple of str."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ArgumentError(option, value, "expected a list or tuple of str")


def names_to(option: str, value: object, what: str) -> dict[str, str]:
    """A dict of str to str (`what`: what the values are)."""
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return value
    raise ArgumentError(option, value, f"expected a dict of str (names) to str ({what})")


def choice(option: str, value: object, choices: Sequence[str]) -> str:
    """One of `choices`."""
    if isinstance(value, str) and value in choices:
        return value
    raise ArgumentError(option, value, f"choose from {', '.join(choices)}")


def flag(option: str, value: object) -> bool:
    """A yes/no option: True or False, nothing that merely looks like one ("no" is truthy)."""
    if isinstance(value, bool):
        return value
    raise ArgumentError(option, value, "expected True or False")


def fail_on(value: object, option: str = "--fail-on") -> tuple[str, ...]:
    """`--fail-on` bounds: one string ("logprob_abs_diff.max>1e-4") or a sequence of them."""
    bounds = (value,) if isinstance(value, str) else value
    if isinstance(bounds, (list, tuple)) and all(isinstance(b, str) for b in bounds):
        return tuple(bounds)
    raise ArgumentError(option, value, "expected a bound such as 'logprob_abs_diff.max>1e-4', or a list of them")


def keywords_checked(fn: F) -> F:
    """`fn` raising GlmconvError, not TypeError, for an unknown keyword or a missing or extra argument; a value
    refused by the checks here is named with the function (`glmconv.convert(): group_bytes='1GB': ...`)."""
    signature = inspect.signature(fn)
    keywords = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    open_ended = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        unknown = [k for k in kwargs if k not in keywords and not open_ended]
        if unknown:
            raise GlmconvError(f"glmconv.{fn.__name__}(): unknown keyword {unknown[0]!r} (the keywords are: "
                               f"{', '.join(keywords)})")
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise GlmconvError(f"glmconv.{fn.__name__}(): {exc}") from None
        try:
            return fn(*args, **kwargs)
        except ArgumentError as exc:
            prefix = f"glmconv.{fn.__name__}(): "
            if str(exc).startswith(prefix) or not keyword(str(exc).split("=", 1)[0]):
                raise
            exc.args = (prefix + str(exc),)
            raise

    return cast(F, call)


def path(option: str, value: object) -> object:
    """A file or directory argument: a str or an os.PathLike (a number or None is a mistake, not a path)."""

    if isinstance(value, (str, os.PathLike)) and str(value) and "\0" not in str(value):
        return value
    raise ArgumentError(option, value, "expected a path (a str or pathlib.Path)")


def optional(check: Callable[..., Any], option: str, value: object, *args: Any) -> Any:
    """`check(option, value, *args)`, or None when `value` is None (the option left at "detect"/"default")."""
    return None if value is None else check(option, value, *args)

"""The one JSON reader for files glmconv did not write itself (config, index, headers, manifests, prompts).

`json.loads` on untrusted text can fail in ways its callers never catch: a RecursionError on deeply nested
arrays, a ValueError on an integer of more than 4,300 digits, a MemoryError on a huge file, a hang on a FIFO.
Every read of an untrusted JSON file goes through `load_json_file` or `parse_json`, which turn all of these
into one `<file>: not valid JSON (<why>)` line of the caller's error type.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from glmconv.errors import CheckpointError, GlmconvError
from glmconv.io.checkpoint_files import file_kind

# A JSON value, as glmconv writes them (summaries, manifests); what it reads stays `Any` until checked.
# Read-only containers: a `list[str]` or `dict[str, int]` is one too.
JsonValue: TypeAlias = None | bool | int | float | str | Sequence["JsonValue"] | Mapping[str, "JsonValue"]
JsonObject: TypeAlias = dict[str, JsonValue]

MAX_JSON_BYTES = 256 << 20  # the release's index is ~6 MB, its config ~4 KB: far above either
MAX_INT_DIGITS = 40  # a u64 has 20; more is a corrupt or hostile file, never a real size or offset


class _Refused(ValueError):
    """Raised by the parse hooks below; caught with the decoder's own errors."""


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused(f"{text[:20]} is beyond the range of a float")
    return value


def _parse_constant(name: str) -> float:
    raise _Refused(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def parse_json(data: bytes | str, source: str, *, error: type[GlmconvError] = CheckpointError,
               what: str = "not valid JSON") -> Any:
    """Decode `data` (UTF-8 bytes or text) read from `source`; any failure is one `error` line naming it."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except RecursionError:
        why = "nested too deeply"
    except UnicodeDecodeError as exc:
        why = f"not UTF-8: byte {exc.start}"
    except ValueError as exc:  # JSONDecodeError, _Refused, int conversion limits
        why = str(exc)
    raise error(f"{source}: {what} ({why})")


def load_json_file(path: str | Path, *, source: str | None = None, error: type[GlmconvError] = CheckpointError,
                   what: str = "not valid JSON", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Read and decode the regular file `path`, at most `max_bytes`; `source` names it in errors (default: path)."""
    p = Path(path)
    name = source or str(p)
    return parse_json(read_capped(p, name, error=error, max_bytes=max_bytes), name, error=error, what=what)


def read_capped(p: Path, name: str, *, error: type[GlmconvError] = CheckpointError,
                max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of the regular file `p`; a FIFO or device is refused without blocking, a huge file unread."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{name}: cannot read ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before any file object: a directory opens, but no file object reads it
        os.close(fd)
        raise error(f"{name}: not a regular file ({file_kind(st.st_mode)})")
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > max_bytes:
            raise error(f"{name}: {st.st_size:,} bytes, more than the {max_bytes:,} a JSON file here may hold")
        try:
            data = fh.read(max_bytes + 1)
        except OSError as exc:
            raise error(f"{name}: cannot read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise error(f"{name}: more than the {max_bytes:,} bytes a JSON file here may hold")
    return data

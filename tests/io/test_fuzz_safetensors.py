"""Fuzzing the safetensors header reader and the HF index reader (hypothesis).

Any input, valid or not, is either accepted or refused with a CheckpointError: never another exception, never
a hang (each example runs under a 10 s alarm). The header reader never reads past the header: at most the
8-byte length prefix plus the header length it announces (and nothing after the prefix when that length is
absurd or beyond the file). What it accepts, the safetensors library itself loads, with the same names, dtypes
and shapes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from helpers.checkpoints import plan_tensors, tiny_config, write_hf
from helpers.fuzzing import fuzz
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

import glmconv.io.safetensors.header as sh
from glmconv.errors import CheckpointError, GlmconvError
from glmconv.io.dtypes import DTYPE_SIZES
from glmconv.io.file_names import INDEX_NAME
from glmconv.io.safetensors.checkpoint import inspect_hf_checkpoint
from glmconv.io.safetensors.header import MAX_HEADER_BYTES, read_header

TORCH_LOADABLE = {"BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
                  "I64", "U64", "F64"}


@contextlib.contextmanager
def no_hang(seconds: int = 10) -> Iterator[None]:
    def timeout(*_: Any) -> None:
        raise TimeoutError(f"no answer within {seconds}s: a hang")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class _Counting:
    """A read-only file that counts the bytes handed out."""

    def __init__(self, fh: Any, counter: list[int]) -> None:
        self._fh, self._counter = fh, counter

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        self._counter[0] += len(data)
        return data

    def __enter__(self) -> _Counting:
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.close()

    def __getattr__(self, name: str) -> Any:  # anything else (seek, readinto, ...) is refused: count all reads
        raise AttributeError(f"the header reader used file.{name}; the byte count would miss it")


def read_counting(path: Path) -> tuple[Any, int]:
    """read_header(path) -> (header or the CheckpointError, bytes read); any other exception propagates."""
    counter = [0]

    def counting_open(p: Any, mode: str = "r", *a: Any, **k: Any) -> _Counting:
        assert mode == "rb", mode
        return _Counting(open(p, mode, *a, **k), counter)

    with no_hang(), mock.patch.object(sh, "open", counting_open, create=True):
        try:
            return read_header(path), counter[0]
        except CheckpointError as exc:
            assert "\n" not in str(exc) and path.name in str(exc), str(exc)
            return exc, counter[0]


def allowed_read(data: bytes) -> int:
    if len(data) < 8:
        return len(data)
    n = int.from_bytes(data[:8], "little")
    return 8 + (n if n <= MAX_HEADER_BYTES and n <= len(data) - 8 else 0)


def check(data: bytes) -> Any:
    """The contract on one file's bytes; returns the header or the error."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model-00001-of-00001.safetensors"
        path.write_bytes(data)
        got, nread = read_counting(path)
        assert nread <= allowed_read(data), f"read {nread} bytes, the header is {allowed_read(data)}"
        if not isinstance(got, CheckpointError):
            _agrees_with_safetensors(path, got, len(data))
    return got


def _agrees_with_safetensors(path: Path, header: Any, size: int) -> None:
    """What glmconv accepts tiles the data section exactly, and safetensors loads it the same way."""
    pos = 0
    for e in sorted(header.entries.values(), key=lambda e: e.begin):
        assert e.begin == pos and e.end - e.begin == math.prod(e.shape) * DTYPE_SIZES[e.dtype]
        pos = e.end
    assert header.data_start + pos == size
    if not set(e.dtype for e in header.entries.values()) <= TORCH_LOADABLE:
        return
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(header.entries)
        for name, e in header.entries.items():
            t = f.get_tensor(name)
            assert tuple(t.shape) == e.shape, name


# ---- strategies ----------------------------------------------------------------------------------------

NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
DTYPES = st.sampled_from(sorted(DTYPE_SIZES))
SHAPES = st.lists(st.integers(0, 5), max_size=3)


@st.composite
def valid_files(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A header (as a dict) and a file that safetensors would write for it, tensors in random order."""
    names = draw(st.lists(NAMES.filter(lambda n: n != "__metadata__"), max_size=5, unique=True))
    header: dict[str, Any] = {}
    pos = 0
    for name in names:
        dtype, shape = draw(DTYPES), draw(SHAPES)
        n = math.prod(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(NAMES, st.text(max_size=5), max_size=2))
    data = draw(st.binary(min_size=pos, max_size=pos))
    return header, pack(header, data)


def pack(header: Any, data: bytes, pad: int = 0) -> bytes:
    blob = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(blob)) + blob + data


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=12)
ODD_INTS = st.integers(-2**64, 2**64) | st.sampled_from([0, 1, 2**63 - 1, 2**64 - 1, -1]) | st.booleans()


@st.composite
def mutated_entries(draw: st.DrawFn) -> bytes:
    """Headers whose entries have out-of-range / overlapping offsets, odd dtypes and shapes."""
    header: dict[str, Any] = {}
    for name in draw(st.lists(NAMES, max_size=4, unique=True)):
        entry: dict[str, Any] = {
            "dtype": draw(DTYPES | st.text(max_size=6) | JSON),
            "shape": draw(SHAPES | st.lists(ODD_INTS, max_size=3) | JSON),
            "data_offsets": draw(st.lists(st.integers(0, 64), min_size=2, max_size=2)
                                 | st.lists(ODD_INTS, max_size=3) | JSON),
        }
        for key in draw(st.lists(st.sampled_from(sorted(entry)), max_size=1)):
            del entry[key]
        header[name] = entry
    data = draw(st.binary(max_size=96))
    return pack(header, data, draw(st.integers(0, 3)))


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    """A valid file with bytes flipped, inserted, deleted or cut off, or its length prefix replaced."""
    _, data = draw(valid_files())
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "length"]))
        if op == "flip" and buf:
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            buf = buf[:draw(st.integers(0, len(buf)))]
        elif op == "insert":
            i = draw(st.integers(0, len(buf)))
            buf[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and buf:
            i = draw(st.integers(0, len(buf) - 1))
            del buf[i:i + draw(st.integers(1, 4))]
        elif op == "length" and len(buf) >= 8:
            buf[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1) | st.sampled_from(
                [MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, 2**63, 2**64 - 1])))
    return bytes(buf)


# ---- properties ----------------------------------------------------------------------------------------

@fuzz(300)
@given(valid_files())
def test_valid_files_are_accepted_as_written(file: tuple[dict[str, Any], bytes]) -> None:
    header, data = file
    got = check(data)
    assert not isinstance(got, CheckpointError), str(got)
    want = {n: (v["dtype"], tuple(v["shape"])) for n, v in header.items() if n != "__metadata__"}
    assert {n: (e.dtype, e.shape) for n, e in got.entries.items()} == want


@fuzz(800)
@given(byte_mutations())
def test_mutated_bytes_are_accepted_or_refused_cleanly(data: bytes) -> None:
    check(data)


@fuzz(800)
@given(mutated_entries())
def test_odd_entries_are_accepted_or_refused_cleanly(data: bytes) -> None:
    check(data)


@fuzz(300)
@given(JSON, st.binary(max_size=32))
def test_random_json_headers_are_accepted_or_refused_cleanly(header: Any, data: bytes) -> None:
    got = check(pack(header, data))
    if not isinstance(header, dict):
        assert isinstance(got, CheckpointError)


@fuzz(300)
@given(st.binary(max_size=64) | st.integers(0, 2**64 - 1).map(lambda n: struct.pack("<Q", n)))
def test_random_bytes_and_huge_lengths_never_read_past_the_prefix(data: bytes) -> None:
    got = check(data)
    if len(data) == 8:
        assert isinstance(got, CheckpointError) or int.from_bytes(data, "little") == 0


# ---- index files -----------------------------------------------------------------------------------------

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
SHARD_NAMES = (st.sampled_from(SHARDS + ["../model-00001-of-00002.safetensors", "/etc/passwd", "", ".", "..",
                                         "sub/../model-00001-of-00002.safetensors", "a\\b.safetensors",
                                         "missing.safetensors", "config.json", "link.safetensors"])
               | st.text(max_size=12))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean two-shard checkpoint of the small audit config, plus a symlink leaving the directory."""
    root = tmp_path_factory.mktemp("fuzz-index")
    d = write_hf(root / "ck", tiny_config(), n_shards=2)
    (root / "outside.safetensors").write_bytes((d / SHARDS[0]).read_bytes())
    (d / "link.safetensors").symlink_to(root / "outside.safetensors")
    return d


@st.composite
def indexes(draw: st.DrawFn) -> bytes:
    names = sorted(plan_tensors(tiny_config()))
    kind = draw(st.sampled_from(["weight_map", "json", "bytes", "truncated"]))
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    wm: dict[Any, Any] = {n: SHARDS[i % 2] for i, n in enumerate(names)}
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["repoint", "drop", "add", "odd-value"]))
        if op == "repoint":
            wm[draw(st.sampled_from(names))] = draw(SHARD_NAMES)
        elif op == "drop":
            wm.pop(draw(st.sampled_from(names)), None)
        elif op == "add":
            wm[draw(NAMES)] = draw(SHARD_NAMES)
        else:
            wm[draw(st.sampled_from(names))] = draw(JSON)
    text = json.dumps({"metadata": draw(JSON), "weight_map": wm}).encode()
    if kind == "truncated":
        text = text[:draw(st.integers(0, len(text)))]
    return text


@fuzz(300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(index=indexes())
def test_random_index_files_are_accepted_or_refused_cleanly(index: bytes, hf_dir: Path) -> None:
    path = hf_dir / INDEX_NAME
    original = path.read_bytes()
    path.write_bytes(index)
    try:
        with no_hang():
            for strict in (True, False):
                try:
                    ck = inspect_hf_checkpoint(hf_dir, strict=strict)
                except CheckpointError as exc:
                    assert "\n" not in str(exc)
                    continue
                except GlmconvError as exc:  # only CheckpointError is expected from a bad index
                    pytest.fail(f"{type(exc).__name__}: {exc}")
                for t in ck.tensors.values():  # what is accepted lies inside the directory
                    assert (hf_dir / t.file).resolve().is_relative_to(hf_dir.resolve())
    finally:
        path.write_bytes(original)
    assert os.listdir(hf_dir)  # nothing deleted


# ---- what the fuzzing found (kept as plain regression tests) --------------------------------------------

def test_tensor_name_with_a_newline_gives_a_one_line_error(tmp_path: Path) -> None:
    p = tmp_path / "s.safetensors"
    p.write_bytes(pack({"a\nb": {"dtype": "BF16", "shape": [], "data_offsets": [0, 0]}}, b""))
    with pytest.raises(CheckpointError, match=r"tensor 'a\\nb': BF16\[\] needs 2 bytes") as err:
        read_header(p)
    assert "\n" not in str(err.value)


def test_lone_surrogate_in_a_name_is_refused_as_safetensors_does(tmp_path: Path) -> None:
    p = tmp_path / "s.safetensors"
    blob = b'{"\\ud800": {"dtype": "BF16", "shape": [], "data_offsets": [0, 2]}}'
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0\0")
    with pytest.raises(CheckpointError, match="is not valid Unicode"):
        read_header(p)


def test_shard_name_with_a_nul_byte_is_refused(hf_dir: Path) -> None:
    path = hf_dir / INDEX_NAME
    original = path.read_bytes()
    index = json.loads(original)
    index["weight_map"][next(iter(index["weight_map"]))] = "model\u0000.safetensors"
    path.write_text(json.dumps(index))
    try:
        with pytest.raises(CheckpointError, match="is not a valid file name"):
            inspect_hf_checkpoint(hf_dir)
    finally:
        path.write_bytes(original)


def test_shard_named_newline_in_the_index_gives_one_escaped_line(hf_dir: Path) -> None:
    """The flaky case the random runs used to hit: a shard name of "\\n" printed raw split the message."""
    path = hf_dir / INDEX_NAME
    original = path.read_bytes()
    index = json.loads(original)
    index["weight_map"][next(iter(index["weight_map"]))] = "\n"
    path.write_text(json.dumps(index))
    try:
        with pytest.raises(CheckpointError) as err:
            inspect_hf_checkpoint(hf_dir)
    finally:
        path.write_bytes(original)
    assert str(err.value) == "'\\n': shard listed in model.safetensors.index.json is missing"

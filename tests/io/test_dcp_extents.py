"""Where a `.distcp` item's raw tensor bytes lie: the stored zip record of its torch.save archive, or no answer."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from glmconv.errors import CheckpointError
from glmconv.io.byte_copy import Extent, read_into
from glmconv.io.file_names import DCP_METADATA_NAME
from glmconv.io.torch_dist.reader import DcpReader, locate_tensor_data
from glmconv.io.torch_dist.writer import Chunk, DcpWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _read(extents: list[Extent]) -> bytes:
    buf = bytearray(sum(e.length for e in extents))
    read_into(extents, memoryview(buf))
    return bytes(buf)


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _item_file(tmp_path: Path, blob: bytes, lead: bytes = b"x" * 37) -> tuple[Path, int, int]:
    """`blob` at an odd offset of a data file, as DCP stores an item: (path, offset, length)."""
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(lead + blob + b"trailing")
    return path, len(lead), len(blob)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_extent_holds_exactly_what_torch_load_gives(tmp_path: Path, dtype: torch.dtype) -> None:
    t = torch.randn(5, 7).to(dtype)
    path, offset, length = _item_file(tmp_path, _saved(t))
    extent = locate_tensor_data(path, offset, length, dtype, (5, 7))
    assert extent is not None and extent.length == 35 * t.element_size()
    assert offset < extent.offset < offset + length - extent.length
    with open(path, "rb") as fh:
        fh.seek(offset)
        loaded = torch.load(io.BytesIO(fh.read(length)), weights_only=True)
    assert _read([extent]) == _bits(loaded) == _bits(t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_byte_ranges_of_a_chunked_tensor_map_onto_its_items(tmp_path: Path, dtype: torch.dtype) -> None:
    full = torch.randn(10, 3, 4).to(dtype)
    writer = DcpWriter(tmp_path)
    writer.write_chunks([Chunk("x", full[0:3].clone(), 0, (10, 3, 4)), Chunk("x", full[3:5].clone(), 3, (10, 3, 4))])
    writer.write_chunks([Chunk("x", full[5:].clone(), 5, (10, 3, 4)), Chunk("s", torch.tensor(2.5, dtype=dtype))])
    writer.finish({"iteration": 0})
    reader = DcpReader(tmp_path)
    raw, row = _bits(full), 12 * full.element_size()
    for begin, end in ((0, len(raw)), (0, 3 * row), (row + 5, 6 * row - 1), (3 * row, 5 * row), (7, 8), (9, 9)):
        extents = reader.byte_extents("x", begin, end)
        assert extents is not None and _read(extents) == raw[begin:end], (begin, end)
    assert len(reader.byte_extents("x", 0, len(raw)) or []) == 10  # one extent per item: a row each (per_row)
    assert _read(reader.byte_extents("s", 0, full.element_size()) or []) == _bits(torch.tensor(2.5, dtype=dtype))
    assert reader.bytes_read == 0  # locating reads no tensor data


def test_every_item_of_a_converted_checkpoint_is_located(tiny_ckpt: Path, tmp_path: Path) -> None:
    from glmconv.runners import convert as convert_mod

    mc = tmp_path / "mc"
    convert_mod.convert(convert_mod.prepare(tiny_ckpt, mc), convert_mod.RunOptions(progress=False))
    reader = DcpReader(mc)
    for name in reader.names():
        t = reader.read(name)
        extents = reader.byte_extents(name, 0, t.numel() * t.element_size())
        assert extents is not None and _read(extents) == _bits(t), name


@pytest.mark.parametrize(("what", "tensor", "sizes"), [
    ("a view with a storage offset", torch.arange(20, dtype=torch.float32)[4:], (16,)),
    ("a view of part of its storage", torch.arange(20, dtype=torch.float32)[:16], (16,)),
    ("a transposed (non-contiguous) view", torch.arange(12, dtype=torch.float32).view(3, 4).t(), (4, 3)),
    ("another size than the metadata says", torch.arange(12, dtype=torch.float32), (13,)),
    ("another dtype than the metadata says", torch.arange(12, dtype=torch.int32), (12,)),
])


def test_an_item_that_is_not_exactly_the_chunk_has_no_extent(tmp_path: Path, what: str, tensor: torch.Tensor,
                                                             sizes: tuple[int, ...]) -> None:
    path, offset, length = _item_file(tmp_path, _saved(tensor))
    assert locate_tensor_data(path, offset, length, torch.float32, sizes) is None, what


def test_a_compressed_archive_has_no_extent(tmp_path: Path) -> None:
    plain = zipfile.ZipFile(io.BytesIO(_saved(torch.zeros(64))))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in plain.infolist():
            z.writestr(info.filename, plain.read(info.filename))
    path, offset, length = _item_file(tmp_path, buf.getvalue())
    assert locate_tensor_data(path, offset, length, torch.float32, (64,)) is None


def test_an_archive_of_something_else_than_a_tensor_has_no_extent_and_runs_nothing(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    for obj in ({"x": torch.zeros(4)}, [torch.zeros(4)]):
        path, offset, length = _item_file(tmp_path, _saved(obj))
        assert locate_tensor_data(path, offset, length, torch.float32, (4,)) is None
    path, offset, length = _item_file(tmp_path, _saved(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not part of a plain tensor"):
        locate_tensor_data(path, offset, length, torch.float32, (4,))
    assert not (tmp_path / "pwned").exists()


def test_a_non_zip_item_is_an_error_for_the_locator_and_no_extent_for_the_reader(tmp_path: Path) -> None:
    from glmconv.io.torch_dist.safe_unpickle import safe_load

    path, offset, length = _item_file(tmp_path, b"\0" * 200)
    with pytest.raises(zipfile.BadZipFile):
        locate_tensor_data(path, offset, length, torch.float32, (50,))
    writer = DcpWriter(tmp_path / "ck")
    writer.write({"x": torch.zeros(3)})
    ckpt = writer.finish({"iteration": 0})
    info = next(v for k, v in safe_load(ckpt / DCP_METADATA_NAME).storage_data.items() if k.fqn == "x")
    data = bytearray((ckpt / info.relative_path).read_bytes())
    data[info.offset:info.offset + info.length] = b"\0" * info.length
    (ckpt / info.relative_path).write_bytes(bytes(data))
    reader = DcpReader(tmp_path / "ck")
    assert reader.byte_extents("x", 0, 12) is None  # the torch.load path then reports the damage
    with pytest.raises(CheckpointError, match="x: chunk is not a readable tensor"):
        reader.read("x")

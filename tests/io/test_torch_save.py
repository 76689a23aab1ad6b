"""DCP items written by glmconv: torch.load reads them, file-backed tensors are copied, never guessed."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import glmconv.io.torch_dist.torch_save as ts
from glmconv.errors import CheckpointError
from glmconv.io.byte_copy import Extent, FileCopier
from glmconv.io.torch_dist.torch_save import FileTensor, save_tensor


def _save(path: Path, tensor: torch.Tensor | FileTensor) -> bytes:
    with open(path, "wb", buffering=0) as f, FileCopier() as copier:
        n = save_tensor(f.fileno(), tensor, copier)
    data = path.read_bytes()
    assert n == len(data)
    return data


def _source(tmp_path: Path, *tensors: torch.Tensor) -> tuple[Path, list[Extent]]:
    blobs = [t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for t in tensors]
    path = tmp_path / "src.bin"
    path.write_bytes(b"HEAD" + b"".join(blobs))
    extents, pos = [], 4
    for b in blobs:
        extents.append(Extent(path, pos, len(b)))
        pos += len(b)
    return path, extents


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_in_memory_tensor_round_trips_through_torch_load(dtype: torch.dtype, tmp_path: Path) -> None:
    t = torch.randn(33, 17).to(dtype)
    got = torch.load(io.BytesIO(_save(tmp_path / "item", t)), weights_only=True)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_file_tensor_is_the_concatenation_of_its_extents(tmp_path: Path) -> None:
    gate, up = torch.randn(6, 5).bfloat16(), torch.randn(6, 5).bfloat16()
    _, (e_gate, e_up) = _source(tmp_path, gate, up)
    lazy = FileTensor(torch.Size([12, 5]), torch.bfloat16, (e_gate, e_up))
    got = torch.load(io.BytesIO(_save(tmp_path / "item", lazy)), weights_only=True)
    assert torch.equal(got, torch.cat([gate, up]))
    assert torch.equal(lazy.materialize(), torch.cat([gate, up]))


def test_file_tensor_and_in_memory_tensor_give_the_same_archive_layout(tmp_path: Path) -> None:
    t = torch.randn(64, 32).bfloat16()
    _, (extent,) = _source(tmp_path, t)
    a = _save(tmp_path / "a", t)
    b = _save(tmp_path / "b", FileTensor(t.shape, t.dtype, (extent,)))
    assert len(a) == len(b)
    assert a.find(t.view(torch.uint8).numpy().tobytes()) == b.find(t.view(torch.uint8).numpy().tobytes()) > 0


def test_extents_that_do_not_fill_the_shape_are_refused(tmp_path: Path) -> None:
    _, (extent,) = _source(tmp_path, torch.randn(4, 4).bfloat16())
    with pytest.raises(CheckpointError, match=r"extents hold 32 bytes, a \[4, 5\] torch.bfloat16 tensor needs 40"):
        FileTensor(torch.Size([4, 5]), torch.bfloat16, (extent,))


def test_a_data_record_torch_did_not_hand_over_is_an_error_not_garbage(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """If a torch version wrote storages differently, the placeholder would be written: refuse instead."""
    t = torch.randn(8, 8).bfloat16()
    _, (extent,) = _source(tmp_path, t)
    monkeypatch.setattr(ts, "_address", lambda view: -1)
    with pytest.raises(CheckpointError, match="data record 0 times where 1 was expected"):
        _save(tmp_path / "item", FileTensor(t.shape, t.dtype, (extent,)))


def test_crc32_setting_is_restored_after_a_save(tmp_path: Path) -> None:
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    _save(tmp_path / "item", torch.randn(3))
    assert config.save.compute_crc32 == before


def test_a_file_tensor_archive_does_not_depend_on_what_its_placeholder_memory_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25: recycled memory that starts like a zip data descriptor (`PK\\x07\\x08`, then 4 bytes torch hashes
    into `.data/serialization_id`) must not reach the archive: two saves give the same bytes whatever it held."""
    t = torch.randn(64, 32).bfloat16()
    _, (extent,) = _source(tmp_path, t)
    real_empty = torch.empty
    archives = []
    for garbage in (b"PK\x07\x08\x01\x02\x03\x04", b"PK\x07\x08\xaa\xbb\xcc\xdd"):
        def recycled(*shape: object, garbage: bytes = garbage, **kw: object) -> torch.Tensor:
            out = real_empty(*shape, **kw)  # type: ignore[arg-type]
            out.view(torch.uint8).reshape(-1)[:8] = torch.frombuffer(bytearray(garbage), dtype=torch.uint8)
            return out
        monkeypatch.setattr(torch, "empty", recycled)
        archives.append(_save(tmp_path / f"item{len(archives)}", FileTensor(t.shape, t.dtype, (extent,))))
    monkeypatch.undo()
    assert archives[0] == archives[1]

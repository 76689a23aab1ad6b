"""PlannedShardWriter: shards planned up front, header first, tensor bytes streamed to their planned offsets."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glmconv.errors import CheckpointError
from glmconv.io.byte_copy import Extent, FileCopier
from glmconv.io.file_names import INDEX_NAME
from glmconv.io.safetensors.header import read_header
from glmconv.io.safetensors.writer import (
    PlannedShardWriter,
    PlannedTensor,
    Shard,
    ShardWriter,
    TensorBytes,
    plan_shards,
    shard_header,
)

CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
         torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
         torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _planned(tensors: dict[str, torch.Tensor]) -> list[PlannedTensor]:
    return [PlannedTensor(n, CODES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]


def _mixed() -> dict[str, torch.Tensor]:
    """Every dtype the plan knows, names out of sorted order, a scalar and an empty tensor."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(CODES):
        t = torch.randint(0, 2 if dtype == torch.bool else 100, (3, 1 + i), generator=g).to(dtype)
        out[f"layers.{10 - i}.w"] = t
    out["norm"] = torch.tensor(1.5)
    out["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    return out


def _write(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> dict[str, str]:
    with PlannedShardWriter(out, _planned(tensors), max_shard_bytes) as w:
        for name, t in tensors.items():
            w.write(name, t)
    return json.loads((out / INDEX_NAME).read_text())["weight_map"]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_shard_is_byte_identical_to_safetensors_save_file(tmp_path: Path) -> None:
    tensors = _mixed()
    _write(tmp_path / "out", tensors, 10**9)
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    ours = (tmp_path / "out" / "model-00001-of-00001.safetensors").read_bytes()
    assert ours == (tmp_path / "ref.safetensors").read_bytes()


def test_header_lists_tensors_widest_dtype_first_then_by_name_padded_to_8(tmp_path: Path) -> None:
    head, offsets = shard_header([PlannedTensor("b", "BF16", (2,)), PlannedTensor("a", "BF16", (3,)),
                                  PlannedTensor("c", "F32", (1,)), PlannedTensor("d", "I8", (5,))])
    (n,) = struct.unpack("<Q", head[:8])
    assert len(head) == 8 + n and n % 8 == 0 and head.endswith(b" ")
    header = json.loads(head[8:])
    assert list(header) == ["__metadata__", "c", "a", "b", "d"]
    assert header["__metadata__"] == {"format": "pt"}
    assert [header[k]["data_offsets"] for k in "cabd"] == [[0, 4], [4, 10], [10, 14], [14, 19]]
    assert offsets == {"c": len(head), "a": len(head) + 4, "b": len(head) + 10, "d": len(head) + 14}


def test_safe_open_reads_every_tensor_back_bit_exact_across_shards(tmp_path: Path) -> None:
    tensors = _mixed()
    weight_map = _write(tmp_path, tensors, 64)
    assert len(set(weight_map.values())) > 3
    got = {}
    for shard in sorted(set(weight_map.values())):
        read_header(tmp_path / shard)  # glmconv's own strict header check passes too
        with safe_open(str(tmp_path / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            got.update({k: f.get_tensor(k) for k in f.keys()})
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and _bits(got[name]) == _bits(t)


def test_shard_boundaries_match_the_buffering_writer(tmp_path: Path) -> None:
    sizes = [40, 40, 40, 200, 8, 8, 100, 4, 96, 1, 0, 100]  # F32 element counts x4 bytes
    tensors = {f"t{i:02d}": torch.zeros(n // 4 if n >= 4 else 0) for i, n in enumerate(sizes)}
    with ShardWriter(tmp_path / "buffered", max_shard_bytes=100) as w:
        for name, t in tensors.items():
            w.add(name, t)
    buffered = json.loads((tmp_path / "buffered" / INDEX_NAME).read_text())
    planned = _write(tmp_path / "planned", tensors, 100)
    assert planned == buffered["weight_map"]
    assert json.loads((tmp_path / "planned" / INDEX_NAME).read_text())["metadata"] == buffered["metadata"]


def test_plan_shards_starts_a_shard_where_the_next_tensor_would_overflow() -> None:
    ts = [PlannedTensor(n, "F32", (s,)) for n, s in (("a", 10), ("b", 10), ("c", 10), ("big", 50), ("d", 1))]
    shards = plan_shards(ts, 100)  # 40, 80, 120 > 100, 200 > 100, 4
    assert [[t.name for t in s] for s in shards] == [["a", "b"], ["c"], ["big"], ["d"]]


def test_a_tensor_larger_than_the_limit_gets_a_shard_of_its_own(tmp_path: Path) -> None:
    weight_map = _write(tmp_path, {"a": torch.zeros(2), "big": torch.zeros(50), "b": torch.zeros(2)}, 16)
    assert weight_map == {"a": "model-00001-of-00003.safetensors", "big": "model-00002-of-00003.safetensors",
                          "b": "model-00003-of-00003.safetensors"}
    assert os.path.getsize(tmp_path / "model-00002-of-00003.safetensors") > 200


def test_the_header_is_on_disk_before_the_rest_of_the_shard_arrives(tmp_path: Path) -> None:
    tensors = {"x": torch.arange(4, dtype=torch.float32), "y": torch.arange(6, dtype=torch.float32)}
    w = PlannedShardWriter(tmp_path, _planned(tensors), 10**6)
    w.write("x", tensors["x"])
    pending = tmp_path / "shard-00001.safetensors.partial"
    head, offsets = shard_header(_planned(tensors))
    data = pending.read_bytes()
    assert data[:len(head)] == head and data[offsets["x"]:offsets["x"] + 16] == _bits(tensors["x"])
    w.write("y", tensors["y"])
    assert sorted(w.close().values()) == ["model-00001-of-00001.safetensors"] * 2


def test_copy_writes_file_extents_as_the_tensor(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    t = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    src.write_bytes(b"junk" + _bits(t)[:10] + b"gap" + _bits(t)[10:])
    with FileCopier() as copier, PlannedShardWriter(tmp_path / "out", _planned({"t": t}), 10**6) as w:
        assert w.copy("t", [Extent(src, 4, 10), Extent(src, 17, 14)], copier) == 24
    with safe_open(str(tmp_path / "out" / "model-00001-of-00001.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("t"), t)


# ---- contract violations: one line naming the tensor, no partial shard left -----------------------------

def _started(tmp_path: Path) -> PlannedShardWriter:
    """A writer planned for a, b (shard 1) and c (shard 2) that has written a and b."""
    w = PlannedShardWriter(tmp_path, _planned({"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(4)}), 16)
    w.write("a", torch.ones(2))
    w.write("b", torch.ones(2))
    assert (tmp_path / "shard-00001.safetensors.partial").is_file()
    return w


def test_a_missing_tensor_is_refused_at_close_and_leaves_no_file(tmp_path: Path) -> None:
    w = _started(tmp_path)
    with pytest.raises(CheckpointError, match=r"^c: planned for .* but never written$"):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_an_unplanned_tensor_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    w = _started(tmp_path)
    with pytest.raises(CheckpointError, match=r"^d: not planned for "):
        w.write("d", torch.zeros(4))
    assert list(tmp_path.iterdir()) == []


def test_a_tensor_out_of_order_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    w = PlannedShardWriter(tmp_path, _planned({"a": torch.zeros(2), "b": torch.zeros(2)}), 100)
    with pytest.raises(CheckpointError, match=r"^b: out of order \(a is planned next\)$"):
        w.write("b", torch.zeros(2))
    assert list(tmp_path.iterdir()) == []


def test_a_tensor_written_twice_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    w = _started(tmp_path)
    with pytest.raises(CheckpointError, match=r"^b: written twice$"):
        w.write("b", torch.zeros(2))
    assert list(tmp_path.iterdir()) == []


def test_tensors_whose_bytes_were_taken_ahead_are_written_as_the_tensors(tmp_path: Path) -> None:
    tensors = _mixed()
    tensors["strided"] = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    _write(tmp_path / "plain", tensors, 10**9)
    with PlannedShardWriter(tmp_path / "ahead", _planned(tensors), 10**9) as w:
        for name, t in tensors.items():
            w.write(name, TensorBytes.of(t))
    shard = "model-00001-of-00001.safetensors"
    assert (tmp_path / "ahead" / shard).read_bytes() == (tmp_path / "plain" / shard).read_bytes()


def test_bytes_taken_ahead_of_another_shape_are_refused_and_leave_no_file(tmp_path: Path) -> None:
    w = _started(tmp_path)
    with pytest.raises(CheckpointError, match=r"^c: F32 \[5\] written, planned F32 \[4\]$"):
        w.write("c", TensorBytes.of(torch.zeros(5)))
    assert list(tmp_path.iterdir()) == []


def test_a_tensor_of_another_shape_or_dtype_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    w = _started(tmp_path)
    with pytest.raises(CheckpointError, match=r"^c: F32 \[5\] written, planned F32 \[4\]$"):
        w.write("c", torch.zeros(5))
    assert list(tmp_path.iterdir()) == []
    w = _started(tmp_path)
    with pytest.raises(CheckpointError, match=r"^c: BF16 \[4\] written, planned F32 \[4\]$"):
        w.write("c", torch.zeros(4, dtype=torch.bfloat16))
    assert list(tmp_path.iterdir()) == []


def test_extents_of_the_wrong_size_are_refused_and_leave_no_file(tmp_path: Path) -> None:
    src = tmp_path.parent / f"{tmp_path.name}-src.bin"
    src.write_bytes(bytes(64))
    w = _started(tmp_path)
    refused = pytest.raises(CheckpointError, match=r"^c: 12 bytes written, planned 16 \(F32 \[4\]\)$")
    with FileCopier() as copier, refused:
        w.copy("c", [Extent(src, 0, 12)], copier)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_names_the_shard_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = PlannedShardWriter(tmp_path, _planned({"a": torch.zeros(2)}), 100)

    def full(*a: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    full_disk = r"shard-00001\.safetensors\.partial: write failed \(No space left on dev"
    with pytest.raises(CheckpointError, match=full_disk):
        w.write("a", torch.zeros(2))
    assert list(tmp_path.iterdir()) == []


def test_a_name_planned_twice_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"^a: planned twice$"):
        PlannedShardWriter(tmp_path / "out", [PlannedTensor("a", "F32", (1,))] * 2, 100)
    assert not (tmp_path / "out").exists()


# ---- shards given whole: any membership, data order and names (export --like) ----------------------------

def test_given_shards_keep_their_membership_data_order_and_names(tmp_path: Path) -> None:
    a, b, c = torch.ones(2), torch.full((3,), 2.0), torch.full((1,), 3.0)
    planned = {n: PlannedTensor(n, "F32", tuple(t.shape)) for n, t in {"a": a, "b": b, "c": c}.items()}
    shards = [Shard((planned["c"], planned["a"]), "first.safetensors"), Shard((planned["b"],), "second.safetensors")]
    with PlannedShardWriter(tmp_path, planned.values(), shards) as w:  # a arrives, then b (second file), then c
        for name, t in {"a": a, "b": b, "c": c}.items():
            w.write(name, t)
    first = read_header(tmp_path / "first.safetensors")
    assert [(e.name, e.begin) for e in first.entries.values()] == [("c", 0), ("a", 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.safetensors", "second.safetensors"]  # no index
    with safe_open(str(tmp_path / "first.safetensors"), framework="pt") as f:
        assert (_bits(f.get_tensor("a")), _bits(f.get_tensor("c"))) == (_bits(a), _bits(c))


def test_a_given_header_is_written_as_it_is(tmp_path: Path) -> None:
    t = PlannedTensor("a", "F32", (2,))
    text = b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'  # spaced, unpadded: not ours
    head = struct.pack("<Q", len(text)) + text
    with PlannedShardWriter(tmp_path, [t], [Shard((t,), "model.safetensors", None, head)]) as w:
        w.write("a", torch.ones(2))
    assert (tmp_path / "model.safetensors").read_bytes() == head + _bits(torch.ones(2))


def test_shards_that_do_not_hold_every_planned_tensor_are_refused(tmp_path: Path) -> None:
    a, b = PlannedTensor("a", "F32", (1,)), PlannedTensor("b", "F32", (1,))
    with pytest.raises(CheckpointError, match=r"^b: the shards do not hold the planned tensors exactly once$"):
        PlannedShardWriter(tmp_path / "out", [a, b], [Shard((a,), "x.safetensors")])


# ---- flushed as it goes (sync=True: export) -------------------------------------------------------------

def _four_in_two_shards() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(300, generator=g) for i in range(4)}  # 1,200 bytes each; 2 a shard at 2,400


def _record_flushes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(inode, size) of each file as its background flush runs."""
    import glmconv.io.background_sync as bs

    flushed: list[tuple[int, int]] = []
    real = bs.fsync_fd

    def fsync_fd(fd: int) -> None:
        st = os.fstat(fd)
        flushed.append((st.st_ino, st.st_size))
        real(fd)

    monkeypatch.setattr(bs, "fsync_fd", fsync_fd)
    return flushed


def test_every_finished_shard_is_flushed_whole_before_close_names_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    flushed = _record_flushes(monkeypatch)
    tensors = _four_in_two_shards()
    with PlannedShardWriter(tmp_path, _planned(tensors), 2400, sync=True) as w:
        for name, t in tensors.items():
            w.write(name, t)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) == 2
    assert sorted(flushed) == sorted((p.stat().st_ino, p.stat().st_size) for p in shards)


def test_a_shard_is_flushed_every_flush_bytes_while_it_is_written(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import glmconv.io.background_sync as bs
    import glmconv.io.safetensors.writer as sw

    handed: list[int] = []  # each flush's file size as the writer hands it over (it runs later, on its thread)
    submit_fd = bs.BackgroundSync.submit_fd
    monkeypatch.setattr(bs.BackgroundSync, "submit_fd",
                        lambda self, path, fd: (handed.append(os.fstat(fd).st_size), submit_fd(self, path, fd))[1])
    monkeypatch.setattr(sw, "FLUSH_BYTES", 2000)
    monkeypatch.setattr(bs.BackgroundSync, "busy", lambda self: False)  # no flush skipped for one still running
    tensors = _four_in_two_shards()
    with PlannedShardWriter(tmp_path, _planned(tensors), 10**6, sync=True) as w:  # one shard of 4,800 bytes
        for name, t in tensors.items():
            w.write(name, t)
    head = len(shard_header(_planned(tensors))[0])
    assert handed == [head + 2400, head + 4800]  # at 2,400 written (>= 2,000), then whole


def test_without_sync_nothing_is_flushed_by_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flushed = _record_flushes(monkeypatch)
    tensors = _four_in_two_shards()
    with PlannedShardWriter(tmp_path, _planned(tensors), 2400) as w:
        for name, t in tensors.items():
            w.write(name, t)
    assert flushed == []


def test_a_failed_flush_is_refused_at_close_naming_the_shard_and_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import glmconv.io.background_sync as bs

    def eio(fd: int) -> None:
        os.close(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(bs, "fsync_fd", eio)
    tensors = _four_in_two_shards()
    w = PlannedShardWriter(tmp_path, _planned(tensors), 2400, sync=True)
    for name, t in tensors.items():
        w.write(name, t)
    failed = r"shard-00001\.safetensors\.partial: fsync failed \(Input/output error\)"
    with pytest.raises(CheckpointError, match=failed):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_flush_bytes_count_per_shard_when_several_are_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import glmconv.io.background_sync as bs
    import glmconv.io.safetensors.writer as sw

    flushed = _record_flushes(monkeypatch)
    monkeypatch.setattr(sw, "FLUSH_BYTES", 2000)
    monkeypatch.setattr(bs.BackgroundSync, "busy", lambda self: False)
    tensors = _four_in_two_shards()
    planned = {t.name: t for t in _planned(tensors)}
    shards = [Shard((planned["t0"], planned["t2"]), "x.safetensors"),
              Shard((planned["t1"], planned["t3"]), "y.safetensors")]
    with PlannedShardWriter(tmp_path, planned.values(), shards, sync=True) as w:  # t0 t1 t2 t3: both files open
        for name, t in tensors.items():
            w.write(name, t)
    files = [tmp_path / "x.safetensors", tmp_path / "y.safetensors"]
    # 2,400 bytes written in all after t1, but no file had 2,000: each is flushed once, whole
    assert flushed == [(p.stat().st_ino, p.stat().st_size) for p in files]

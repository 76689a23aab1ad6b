"""What reading a torch_dist checkpoint does once, not per chunk or per look (issue 38: runs of small tensors spent
their time there): a run's thread readers share one inspection of the checkpoint, and a pickle passed by the bounds
scan (a chunk's, the `.metadata`) is not scanned again, while a pickle the scan refused is refused every time; each
chunk is located once a run, a tensor archive of a kind that passed is not loaded again (one changed anywhere but in
its data is), a stored object that passed is not loaded again (one that failed is refused every time), and an HF
checkpoint's shards are resolved and their headers read once each."""

from __future__ import annotations

import io
import pickle
import threading
from pathlib import Path

import pytest
import torch

import glmconv
from glmconv.errors import CheckpointError
from glmconv.io.dtypes import torch_dtype
from glmconv.io.safetensors import checkpoint
from glmconv.io.safetensors import reader as safetensors_reader
from glmconv.io.safetensors.checkpoint import inspect_hf_checkpoint
from glmconv.io.safetensors.reader import HfTensorSource
from glmconv.io.torch_dist import pickle_bounds, stored_objects
from glmconv.io.torch_dist.passed import Passed
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.io.torch_dist.torch_save import no_crc32
from glmconv.runners.backward import ThreadReaders


@pytest.fixture(scope="module")
def tiny_mc(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("once") / "mc"
    glmconv.convert(tiny_ckpt, out)
    return out


def _archive(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def test_every_threads_reader_shares_the_first_readers_inspection(tiny_mc: Path) -> None:
    readers = ThreadReaders(tiny_mc, check_finite=True)
    got = []
    threads = [threading.Thread(target=lambda: got.append(readers.get())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in got}) == 3
    assert len({id(r.ckpt) for r in got}) == 1


def test_a_pickle_within_bounds_is_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    scanned: list[bytes] = []
    monkeypatch.setattr(pickle_bounds, "_PASSED", Passed())
    monkeypatch.setattr(pickle_bounds, "_scan_bounds", lambda pkl, nesting: scanned.append(pkl))
    same_shape = [_archive(torch.randn(4, 8)) for _ in range(3)]  # other values, the same pickle
    other_shape = _archive(torch.randn(8, 4))
    for archive in [*same_shape, other_shape]:
        stored_objects.bounded_pickles(io.BytesIO(archive))
    assert len(scanned) == 2
    assert scanned[0] != scanned[1]


def test_a_pickle_the_scan_refused_is_scanned_and_refused_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes] = []

    def refuse(pkl: bytes, nesting: int) -> None:
        calls.append(pkl)
        raise pickle.UnpicklingError("planted: out of bounds")

    monkeypatch.setattr(pickle_bounds, "_PASSED", Passed())
    monkeypatch.setattr(pickle_bounds, "_scan_bounds", refuse)
    archive = _archive(torch.randn(4, 8))
    for _ in range(2):
        with pytest.raises(pickle.UnpicklingError, match="planted"):
            stored_objects.bounded_pickles(io.BytesIO(archive))
    assert len(calls) == 2


def test_a_checkpoints_metadata_is_scanned_once_a_process(tiny_mc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from glmconv.io.torch_dist.metadata import inspect_torch_dist

    scanned: list[int] = []
    scan = pickle_bounds._scan_bounds
    monkeypatch.setattr(pickle_bounds, "_PASSED", Passed())
    monkeypatch.setattr(pickle_bounds, "_scan_bounds", lambda pkl, nesting: scanned.append(len(pkl)) or scan(pkl,
                                                                                                              nesting))
    first = inspect_torch_dist(tiny_mc)
    again = inspect_torch_dist(tiny_mc)
    assert first.tensors == again.tensors
    assert len(scanned) == 1


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_located_read_gives_torch_loads_bytes_without_loading_an_archive(tiny_mc: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = DcpReader(tiny_mc)
    loaded.locatable = lambda name: False  # type: ignore[method-assign]  # every read through torch.load
    want = {n: (loaded.read(n), loaded.read(n, (1, 2))) for n in loaded.names() if len(loaded.shape(n)) >= 2}
    load = torch.load

    def meta_only(*a: object, **k: object) -> object:  # locating a chunk checks its archive on the meta device
        assert k.get("map_location") == "meta", "a located chunk was loaded"
        return load(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", meta_only)
    located = DcpReader(tiny_mc)
    got = {n: (located.read(n), located.read(n, (1, 2))) for n in want}
    assert len(want) > 10
    assert {n: tuple(map(_bits, ts)) for n, ts in got.items()} == {n: tuple(map(_bits, ts)) for n, ts in want.items()}
    assert located.bytes_read == sum(sum(t.numel() * t.element_size() for t in ts) for ts in got.values())


def _dcp_archive(tensor: torch.Tensor) -> bytes:
    """As glmconv's DCP writer saves a chunk: torch.save without the zip CRC-32."""
    with no_crc32():
        return _archive(tensor)


def test_an_archive_like_one_that_passed_but_for_its_data_is_passed_unloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stored_objects, "_ARCHIVES_PASSED", Passed())
    first, second = _dcp_archive(torch.randn(4, 8)), _dcp_archive(torch.randn(4, 8))  # other values and ids
    stored_objects.check_tensor_archive(io.BytesIO(first), "first", torch.float32, (4, 8))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("an archive of a known kind was loaded"))
    stored_objects.check_tensor_archive(io.BytesIO(second), "second", torch.float32, (4, 8))
    assert len(stored_objects._ARCHIVES_PASSED) == 1


def test_archives_whose_crcs_differ_are_each_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save's own CRC-32 of the data differs with the values: such archives (a trainer's) are all loaded."""
    monkeypatch.setattr(stored_objects, "_ARCHIVES_PASSED", Passed())
    load, loads = torch.load, []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(1) or load(*a, **k))
    for _ in range(2):
        stored_objects.check_tensor_archive(io.BytesIO(_archive(torch.randn(4, 8))), "crc", torch.float32, (4, 8))
    assert len(loads) == 2


@pytest.mark.parametrize(("what", "old", "new"), [
    ("its pickle", b"_rebuild_tensor_v2", b"_rebuild_tensor_v9"),  # a global torch has not
    ("its serialization id", None, b"\xff"),  # not UTF-8: torch.load cannot log it
])
def test_an_archive_changed_outside_its_data_is_checked_and_refused(monkeypatch: pytest.MonkeyPatch, what: str,
                                                                    old: bytes | None, new: bytes) -> None:
    monkeypatch.setattr(stored_objects, "_ARCHIVES_PASSED", Passed())
    good = _dcp_archive(torch.randn(4, 8))
    stored_objects.check_tensor_archive(io.BytesIO(good), "good", torch.float32, (4, 8))
    changed = bytearray(_dcp_archive(torch.randn(4, 8)))
    at = changed.index(old) if old is not None else changed.index(b"serialization_id") + len(b"serialization_id")
    at = at if old is not None else at + next(i for i, c in enumerate(changed[at:]) if chr(c).isdigit())
    changed[at:at + len(new)] = new
    with pytest.raises(CheckpointError, match="changed: chunk is not a readable tensor"):
        stored_objects.check_tensor_archive(io.BytesIO(bytes(changed)), "changed", torch.float32, (4, 8))


def test_thread_readers_locate_each_chunk_once(tiny_mc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    located: list[tuple[str, tuple[int, ...]]] = []
    locate = DcpReader._locate
    monkeypatch.setattr(DcpReader, "_locate", lambda self, name, chunk: located.append(
        (name, tuple(chunk.offsets))) or locate(self, name, chunk))
    readers = ThreadReaders(tiny_mc, check_finite=True)
    names = readers.get().names()

    def read_all() -> None:
        for name in names:
            readers.get().locatable(name)

    threads = [threading.Thread(target=read_all) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    chunks = sum(len(readers.get().chunks(n)) for n in names)
    assert len(located) == len(set(located)) == chunks


def test_each_shard_of_an_hf_checkpoint_is_resolved_once(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = inspect_hf_checkpoint(tiny_ckpt)
    resolved: list[str] = []
    monkeypatch.setattr(checkpoint, "shard_path", lambda root, name: resolved.append(name) or root / name)
    files = ck.tensor_files()
    assert sorted(resolved) == sorted({t.file for t in ck.tensors.values()})
    assert files == {n: tiny_ckpt / t.file for n, t in ck.tensors.items()}


def test_a_stored_object_that_passed_passes_again_unloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stored_objects, "_OBJECTS_PASSED", Passed())
    data = _archive(torch.tensor([1.0]))
    stored_objects.check_object(data, "first")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("an object that passed was loaded again"))
    stored_objects.check_object(data, "again")


def test_a_stored_object_that_failed_is_checked_and_refused_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stored_objects, "_OBJECTS_PASSED", Passed())
    bad = pickle.dumps(eval)  # a global outside the allow-list
    for where in ("first", "again"):
        with pytest.raises(CheckpointError, match=f"{where}: stored object is not loadable"):
            stored_objects.check_object(bad, where)
    assert stored_objects._OBJECTS_PASSED == set()


def test_a_tensor_source_of_an_inspected_checkpoint_reads_no_header_again(tiny_ckpt: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ck = inspect_hf_checkpoint(tiny_ckpt)
    monkeypatch.setattr(safetensors_reader, "read_header", lambda path: pytest.fail(f"{path} read again"))
    with HfTensorSource(ck.tensor_files(), headers=ck.headers) as src:
        got = {n: src.raw(n) for n in ck.tensors}
    assert {n: (tuple(t.shape), t.dtype) for n, t in got.items()} == {
        n: (t.shape, torch_dtype(t.dtype)) for n, t in ck.tensors.items()}

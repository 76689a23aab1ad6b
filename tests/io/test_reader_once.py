"""What reading a torch_dist checkpoint does once, not per chunk or per look (issue 38: runs of small tensors spent
their time there): a run's thread readers share one inspection of the checkpoint, and a pickle passed by the bounds
scan (a chunk's, the `.metadata`) is not scanned again, while a pickle the scan refused is refused every time."""

from __future__ import annotations

import io
import pickle
import threading
from pathlib import Path

import pytest
import torch

import glmconv
from glmconv.io.torch_dist import safe_unpickle, stored_objects
from glmconv.io.torch_dist.reader import DcpReader
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
    monkeypatch.setattr(safe_unpickle, "_PASSED", set())
    monkeypatch.setattr(safe_unpickle, "_scan_bounds", lambda pkl, nesting: scanned.append(pkl))
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

    monkeypatch.setattr(safe_unpickle, "_PASSED", set())
    monkeypatch.setattr(safe_unpickle, "_scan_bounds", refuse)
    archive = _archive(torch.randn(4, 8))
    for _ in range(2):
        with pytest.raises(pickle.UnpicklingError, match="planted"):
            stored_objects.bounded_pickles(io.BytesIO(archive))
    assert len(calls) == 2


def test_a_checkpoints_metadata_is_scanned_once_a_process(tiny_mc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from glmconv.io.torch_dist.metadata import inspect_torch_dist

    scanned: list[int] = []
    scan = safe_unpickle._scan_bounds
    monkeypatch.setattr(safe_unpickle, "_PASSED", set())
    monkeypatch.setattr(safe_unpickle, "_scan_bounds", lambda pkl, nesting: scanned.append(len(pkl)) or scan(pkl,
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

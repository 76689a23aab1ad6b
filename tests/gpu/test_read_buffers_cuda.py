"""Pinned read buffers (benchmarks/read_probe.py's): page-locked, reused once free, the same bytes as a plain read."""

from __future__ import annotations

import gpu_pairs
import pytest
import torch

from glmconv.io import read_buffers
from glmconv.io.read_buffers import ReadBuffers
from glmconv.io.torch_dist.reader import DcpReader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MIB = 1 << 20


def test_pinned_buffers_are_page_locked_and_reused_once_free() -> None:
    pool = ReadBuffers(64 * MIB, pinned=True)
    first = pool.empty((2 * MIB,), torch.uint8)
    address = first.data_ptr()
    assert first.is_pinned()
    del first
    again = pool.empty((MIB,), torch.bfloat16)
    assert again.data_ptr() == address and again.is_pinned()


def test_past_its_bytes_a_pinned_pool_still_gives_pinned_memory() -> None:
    pool = ReadBuffers(2 * MIB, pinned=True)
    held = pool.empty((2 * MIB,), torch.uint8)
    extra = pool.empty((2 * MIB,), torch.uint8)
    assert extra.data_ptr() != held.data_ptr() and extra.is_pinned() and pool.pooled_bytes == 2 * MIB


def test_a_pinned_reader_reads_through_its_pool_the_bytes_a_plain_read_gives(
        monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each read copied to the GPU without blocking, its stream synchronised before the read is dropped (as the
    encoder does): the next read reuses the buffer, and every copy holds the plain read's bytes."""
    monkeypatch.setattr(read_buffers, "MIN_POOLED", 1)  # the tiny checkpoint's tensors pooled too
    _, mc = gpu_pairs.tiny_pair(tmp_path_factory, "tiny", init="unit")
    plain = DcpReader(mc)
    pool = ReadBuffers(64 * MIB, pinned=True)
    pinned = DcpReader(mc, pin=True, buffers=pool)
    names = [n for n in plain.names() if plain.locatable(n)]
    stream = torch.cuda.Stream()
    pooled = []
    for _ in range(2):  # the second pass reads into the first's buffers
        for n in names:
            t = pinned.read(n)
            assert t.is_pinned(), n
            with torch.cuda.stream(stream):
                on_gpu = t.to("cuda", non_blocking=True)
            stream.synchronize()
            del t
            assert torch.equal(on_gpu.cpu(), plain.read(n)), n
        pooled.append(pool.pooled_bytes)
    assert 0 < pooled[0] == pooled[1]

"""Pinned read buffers (benchmarks/read_probe.py's): page-locked, reused once free, the same bytes as a plain read."""

from __future__ import annotations

import pytest
import torch

from glmconv.io.read_buffers import ReadBuffers

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

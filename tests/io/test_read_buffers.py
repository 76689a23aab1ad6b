"""Read buffers are handed out again only once nothing holds them, and never past their pool's bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from glmconv.io.read_buffers import MIN_POOLED, ReadBuffers
from glmconv.io.torch_dist.reader import DcpReader

MIB = 1 << 20


def test_a_buffer_is_reused_once_its_tensor_is_gone() -> None:
    pool = ReadBuffers(64 * MIB)
    first = pool.empty((4 * MIB,), torch.uint8)
    address = first.data_ptr()
    del first
    again = pool.empty((2 * MIB,), torch.bfloat16)
    assert again.data_ptr() == address and again.shape == (2 * MIB,) and pool.pooled_bytes == 4 * MIB


HOLDERS = {"a view": lambda t: t[2:].view(torch.int16), "a numpy array": lambda t: t.numpy(),
           "a memoryview": lambda t: memoryview(t.numpy())}


@pytest.mark.parametrize("holder", HOLDERS)
def test_a_buffer_still_held_is_not_handed_out(holder: str) -> None:
    pool = ReadBuffers(64 * MIB)
    t = pool.empty((2 * MIB,), torch.uint8)
    t.fill_(7)
    held, address = HOLDERS[holder](t), t.data_ptr()
    del t
    other = pool.empty((2 * MIB,), torch.uint8)
    other.fill_(9)
    assert other.data_ptr() != address
    assert _first_bytes(held) == b"\x07" * 4


def _first_bytes(held: torch.Tensor | np.ndarray | memoryview) -> bytes:
    array = held.numpy() if isinstance(held, torch.Tensor) else np.asarray(held)
    return array.view(np.uint8).reshape(-1)[:4].tobytes()


def test_past_its_bytes_a_read_gets_a_new_tensor_and_free_buffers_make_room() -> None:
    pool = ReadBuffers(8 * MIB)
    a = pool.empty((6 * MIB,), torch.uint8)
    b = pool.empty((6 * MIB,), torch.uint8)  # 12 MiB > 8: not pooled while `a` is held
    assert pool.pooled_bytes == 6 * MIB and b.data_ptr() != a.data_ptr()
    del a, b
    c = pool.empty((7 * MIB,), torch.uint8)  # the free 6 MiB buffer is too small: dropped for a 7 MiB one
    assert pool.pooled_bytes == 7 * MIB and c.numel() == 7 * MIB


def test_small_reads_are_not_pooled() -> None:
    pool = ReadBuffers(64 * MIB)
    t = pool.empty((MIN_POOLED // 2 - 1,), torch.int16)
    assert t.numel() == MIN_POOLED // 2 - 1 and pool.pooled_bytes == 0


def test_a_reader_with_buffers_reads_the_same_values(mc_ckpt: Path) -> None:
    plain, pooled = DcpReader(mc_ckpt), DcpReader(mc_ckpt, buffers=ReadBuffers(64 * MIB))
    names = [n for n in plain.names() if plain.locatable(n)]
    assert names
    for _ in range(2):  # the second pass reads into reused buffers
        for n in names:
            assert torch.equal(pooled.read(n), plain.read(n)), n

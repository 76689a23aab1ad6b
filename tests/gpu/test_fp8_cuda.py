"""Issue 14 on a GPU: dequantisation there gives the CPU's bits, and `convert --device cuda` the CPU's tensors.

On the GPU machine the FP8 fixture can be handed in pre-made (its transformers may lack Glm5Next):
GLMCONV_GPU_FIXTURES=DIR with DIR/hf-tiny-fp8, made with `glmconv fixture make DIR/hf-tiny-fp8 --fp8`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from glmconv.numerics.dequant import CudaDequantizer
from glmconv.numerics.fp8 import dequantize_fp8_blocks, scale_shape

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def every_code(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite code (NaN codes 0x7F/0xFF made ±448), scales over 2^-30..2^10."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    codes = torch.where((raw & 0x7F) == 0x7F, raw ^ 1, raw).view(torch.float8_e4m3fn)
    scales = torch.exp2(torch.randint(-30, 11, scale_shape(shape), generator=g).float())
    return codes, scales * (1 + torch.rand(scale_shape(shape), generator=g))


@pytest.mark.parametrize("shape", [(2048, 4096), (1000, 700), (257, 5)])
def test_the_gpu_gives_the_cpus_bits(shape: tuple[int, int]) -> None:
    codes, scales = every_code(shape)
    want = dequantize_fp8_blocks(codes, scales)
    got = CudaDequantizer()(codes.pin_memory(), scales, torch.bfloat16)
    assert got.device.type == "cpu" and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_the_gpu_dequantises_into_a_given_view_with_the_cpus_bits() -> None:
    """Convert's stacked experts: each dequantised on the GPU and copied straight into its rows of one output."""
    codes, scales = every_code((1000, 700))
    want = dequantize_fp8_blocks(codes, scales)
    stacked = torch.full((3, 1000, 700), -1.0, dtype=torch.bfloat16)
    got = CudaDequantizer()(codes.pin_memory(), scales, torch.bfloat16, out=stacked[1])
    assert got.data_ptr() == stacked[1].data_ptr()
    assert torch.equal(stacked[1].view(torch.int16), want.view(torch.int16))
    assert bool((stacked[0] == -1).all()) and bool((stacked[2] == -1).all())


def test_the_gpu_hands_back_ordinary_memory_through_one_reused_pinned_buffer() -> None:
    """Outputs wait in the writer's queue: none holds pinned memory, and no weight after the first pins more."""
    codes, scales = every_code((1000, 700))
    codes = codes.pin_memory()
    dequantize = CudaDequantizer()
    dequantize(codes, scales, torch.bfloat16)
    pinned_before = torch.cuda.memory.host_memory_stats()["num_host_alloc"]
    got = [dequantize(codes, scales, torch.bfloat16) for _ in range(8)]
    assert [g.is_pinned() for g in got] == [False] * 8
    assert torch.cuda.memory.host_memory_stats()["num_host_alloc"] == pinned_before


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_the_gpu_refuses_a_nan_code_as_the_cpu_does(code: int) -> None:
    """Issue 25: a NaN code is refused on the GPU too, with the CPU's words."""
    from glmconv.numerics.finite import NonFiniteError

    codes, scales = every_code((1000, 700))
    codes.view(torch.uint8)[300, 130] = code
    with pytest.raises(NonFiniteError) as cpu:
        dequantize_fp8_blocks(codes, scales)
    with pytest.raises(NonFiniteError) as gpu:
        CudaDequantizer()(codes.pin_memory(), scales, torch.bfloat16)
    assert str(gpu.value) == str(cpu.value) and "in block [2, 1]" in str(cpu.value)


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("GLMCONV_GPU_FIXTURES")
    if given:
        return Path(given) / "hf-tiny-fp8"
    from glmconv.fixtures import make_fixture

    return make_fixture(tmp_path_factory.mktemp("gpu") / "hf-tiny-fp8", "tiny", fp8=True, seed=0)


def test_convert_on_the_gpu_writes_the_cpus_tensors(fp8_source: Path, tmp_path: Path) -> None:
    from helpers import mcore_helpers as mh

    from glmconv.runners.convert import RunOptions, convert, prepare

    for device in ("cpu", "cuda"):
        summary = convert(prepare(fp8_source, tmp_path / device), RunOptions(progress=False, device=device))
        assert summary["device"] == device
    cpu, gpu = mh.read_dcp(tmp_path / "cpu"), mh.read_dcp(tmp_path / "cuda")
    assert sorted(cpu) == sorted(gpu)
    for name, t in cpu.items():
        mh.assert_same(name, gpu[name], t)

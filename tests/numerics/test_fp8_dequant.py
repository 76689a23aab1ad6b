"""Issue 14: FP8 dequantisation that uses the machine gives the reference formula's bits, and `--device` says
where it runs (a GPU absent is one `error:` line). The GPU's own bit-for-bit test is tests/gpu/test_fp8_cuda.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from glmconv.errors import GlmconvError
from glmconv.numerics.dequant import AUTO_CUDA_BYTES, CpuDequantizer, require_device, resolve_device
from glmconv.numerics.fp8 import Fp8FormatError, dequantize_fp8_blocks, scale_shape
from glmconv_cli.main import cli

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")


def every_code(shape: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes as FP8 codes (every finite one: zeros, subnormals, ±448; NaN codes 0x7F/0xFF made ±448) and
    scales over 2^-30..2^10."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    codes = torch.where((raw & 0x7F) == 0x7F, raw ^ 1, raw).view(torch.float8_e4m3fn)
    exps = torch.randint(-30, 11, scale_shape(shape), generator=g).float()
    scales = torch.exp2(exps) * (1 + torch.rand(scale_shape(shape), generator=g))
    return codes, scales


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("shape", [(1000, 700), (512, 256), (300, 128), (257, 5), (129, 4096)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_slabs_on_threads_give_the_reference_bits(shape: tuple[int, int], out_dtype: torch.dtype) -> None:
    codes, scales = every_code(shape)
    want = dequantize_fp8_blocks(codes, scales, out_dtype=out_dtype)
    dequantize = CpuDequantizer(threads=3)
    try:
        got = dequantize(codes, scales, out_dtype)
    finally:
        dequantize.close()
    assert got.dtype == out_dtype and got.shape == want.shape
    view = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(view), want.view(view))


@pytest.mark.parametrize("shape", [(1000, 700), (257, 5)])  # by slabs on threads / one call
@pytest.mark.parametrize("threads", [1, 3])
def test_dequantised_into_a_given_view_it_has_the_reference_bits(shape: tuple[int, int], threads: int) -> None:
    """Convert assembles stacked experts by dequantising each straight into its rows of the output."""
    codes, scales = every_code(shape, seed=1)
    want = dequantize_fp8_blocks(codes, scales)
    stacked = torch.full((3, *shape), -1.0, dtype=torch.bfloat16)
    dequantize = CpuDequantizer(threads=threads)
    try:
        got = dequantize(codes, scales, torch.bfloat16, out=stacked[1])
    finally:
        dequantize.close()
    assert got.data_ptr() == stacked[1].data_ptr()
    assert torch.equal(bits(stacked[1]), bits(want))
    assert bool((stacked[0] == -1).all()) and bool((stacked[2] == -1).all())  # nothing outside its rows


def test_slabs_refuse_a_scale_grid_of_the_wrong_shape() -> None:
    codes, scales = every_code((1000, 700))
    dequantize = CpuDequantizer(threads=2)
    with pytest.raises(Fp8FormatError, match=r"must be \[8, 6\], got \[7, 6\]$"):
        dequantize(codes, scales[:7], torch.bfloat16)
    dequantize.close()


def test_auto_stays_on_the_cpu_below_a_gib_of_codes() -> None:
    assert resolve_device("auto", AUTO_CUDA_BYTES - 1) == "cpu"
    assert resolve_device("cpu", 10 * AUTO_CUDA_BYTES) == "cpu"


@NO_CUDA
def test_auto_without_a_gpu_is_the_cpu_and_cuda_is_refused() -> None:
    assert resolve_device("auto", 10 * AUTO_CUDA_BYTES) == "cpu"
    with pytest.raises(GlmconvError, match=r"^--device cuda: no CUDA device is visible"):
        require_device("cuda")


@NO_CUDA
def test_device_cuda_without_a_gpu_is_one_error_line_and_writes_nothing(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["convert", str(tiny_fp8_ckpt), str(tmp_path / "out"), "--device", "cuda"])
    assert res.exit_code == 2
    assert res.stderr == ("error: --device cuda: no CUDA device is visible (torch.cuda.is_available() is False); "
                          "use --device cpu or auto\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_unknown_device_is_a_usage_error(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["convert", str(tiny_fp8_ckpt), str(tmp_path / "out"), "--device", "tpu"])
    assert res.exit_code == 2
    assert res.stderr.startswith("error: Invalid value for '--device': 'tpu' is not one of 'auto', 'cpu', 'cuda'.")


def test_device_cpu_runs_and_the_summary_says_where(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    import json

    res = CliRunner().invoke(cli, ["convert", str(tiny_fp8_ckpt), str(tmp_path / "out"), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["device"] == "cpu"


@pytest.mark.parametrize("code", [0x7F, 0xFF])
@pytest.mark.parametrize("where", [(0, 0), (999, 699), (300, 130)])
@pytest.mark.parametrize("threads", [1, 3], ids=["reference", "slabs"])
def test_a_nan_code_is_refused_naming_its_block_never_dequantised(code: int, where: tuple[int, int],
                                                                  threads: int) -> None:
    """Issue 25: NaN codes (0x7F, 0xFF) anywhere are refused by the CPU paths, naming the block and the count."""
    from glmconv.numerics.finite import NonFiniteError

    codes, scales = every_code((1000, 700))
    codes.view(torch.uint8)[where] = code
    codes.view(torch.uint8)[where[0], (where[1] + 1) % 700] = code
    dequantize = CpuDequantizer(threads=threads)
    block = [where[0] // 128, where[1] // 128]
    try:
        with pytest.raises(NonFiniteError, match=rf"2 non-finite values \(NaN/Inf\), the first FP8 code 0x{code:02X} "
                                                 rf"in block \[{block[0]}, \d+\]"):
            dequantize(codes, scales, torch.bfloat16)
    finally:
        dequantize.close()

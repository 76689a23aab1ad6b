"""Issue 38 on a GPU: export's FP8 encoding there gives the CPU's bytes, weight by weight and for a whole export.

On the GPU machine the FP8 fixture can be handed in pre-made: GLMCONV_GPU_FIXTURES=DIR with DIR/hf-tiny-fp8."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.fp8_cases import CASES

from glmconv.numerics.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from glmconv.numerics.fp8_encode import CpuEncoder, CudaEncoder
from glmconv.numerics.fp8_reuse import Fp8Blocks, encode

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _bytes(got: Fp8Blocks) -> tuple[bytes, bytes, int, int, int]:
    return (got.codes.view(torch.uint8).numpy().tobytes(), got.scales.numpy().tobytes(), got.requantized,
            got.scale_adjusted, got.inexact)


@pytest.mark.parametrize(("what", "w"), CASES, ids=[c[0] for c in CASES])
def test_the_gpu_encodes_the_cpus_bytes(what: str, w: torch.Tensor) -> None:
    q, s = quantize_fp8_blocks(w)
    back = dequantize_fp8_blocks(q, s, out_dtype=w.dtype).clone()
    back.view(-1)[:: 7919] = back.view(-1)[:: 7919] * -0.5  # changed blocks; x3 overflows the edges case to Inf
    gpu, cpu = CudaEncoder(), CpuEncoder(4)
    for weight, like in ((w, None), (back, (q, s)), (back, None)):
        want = encode(weight, like)
        assert _bytes(gpu(weight, like)) == _bytes(want)
        assert _bytes(cpu(weight, like)) == _bytes(want)


def test_the_gpu_quantises_a_big_weight_as_the_cpu_does() -> None:
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(4096, 7168, generator=g) * 0.02).bfloat16()
    assert _bytes(CudaEncoder()(w, None)) == _bytes(encode(w, None))


@pytest.fixture(scope="module")
def fp8_mc(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    given = os.environ.get("GLMCONV_GPU_FIXTURES")
    src = Path(given) / "hf-tiny-fp8" if given else None
    if src is None or not src.exists():
        from glmconv.fixtures import make_fixture

        src = tmp_path_factory.mktemp("src") / "hf-tiny-fp8"
        make_fixture(src, preset="tiny", fp8=True)
    from glmconv.runners import convert

    mc = tmp_path_factory.mktemp("mc") / "mc"
    convert.convert(convert.prepare(src, mc), convert.RunOptions(progress=False, device="cpu"))
    return src, mc


@pytest.mark.parametrize("like", [False, True])
def test_export_on_the_gpu_writes_the_cpus_files(fp8_mc: tuple[Path, Path], tmp_path: Path, like: bool) -> None:
    from glmconv.runners import export

    src, mc = fp8_mc
    out = {}
    for device in ("cpu", "cuda"):
        job = export.prepare(mc, tmp_path / device, like=src if like else None, fp8=True)
        summary = export.export(job, export.ExportOptions(progress=False, device=device))
        assert summary["device"] == device
        out[device] = {p.name: p.read_bytes() for p in (tmp_path / device).iterdir() if p.suffix == ".safetensors"}
    assert out["cuda"] == out["cpu"] and out["cpu"]

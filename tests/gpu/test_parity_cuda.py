"""The serve and train models on CUDA: same answers as on CPU, and the parity gate holds there too.

Skips cleanly without CUDA. On the GPU machine the fixtures can be handed in pre-made (the generator needs
transformers' Glm5Next classes): GLMCONV_GPU_FIXTURES=DIR with DIR/hf-tiny (HF) and DIR/mc-tiny (converted),
made with `fixture make --init unit`. Unit init, because the realistic one (a few q_a_layernorm channels near 0)
gives the 4-head tiny indexer pools whose every head is cut by the relu: exact ties at score 0, which torch.topk
breaks differently on CPU and CUDA (one token in 128 then attends to another pool; measured 1e-2 on the logits).
"""

from __future__ import annotations

from pathlib import Path

import gpu_pairs
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOKENS, SEQUENCES = 128, 2  # past the tiny fixture's index_topk, so the kpool indexer really selects


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return gpu_pairs.tiny_pair(tmp_path_factory, "tiny", init="unit")


@pytest.fixture(autouse=True)
def no_tf32() -> None:
    """fp32 means fp32: TF32 matmuls/convs would cost 1e-3 and hide what the test is about."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _logits(hf: Path, device: str, dtype: torch.dtype) -> torch.Tensor:
    from glmconv.compare.inputs import random_batch
    from glmconv.io.config_file import load_config
    from glmconv.models.conventions import Conventions
    from glmconv.models.model import GlmModel
    from glmconv.models.weights import HfWeights

    config = load_config(hf)
    batch = random_batch(config.dim("vocab_size"), TOKENS, SEQUENCES, 0).to(device)
    model = GlmModel(config, HfWeights(hf), Conventions.serve(), dtype=dtype, device=device)
    with torch.no_grad():
        return model.forward(batch.ids, batch.cu_seqlens).double().cpu()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_fp32_serve_model_on_cuda_matches_cpu(tiny_pair: tuple[Path, Path]) -> None:
    cpu, cuda = _logits(tiny_pair[0], "cpu", torch.float32), _logits(tiny_pair[0], "cuda", torch.float32)
    assert _rel(cuda, cpu) < 1e-5


def test_bf16_serve_model_on_cuda_is_as_close_to_fp32_as_bf16_on_cpu(tiny_pair: tuple[Path, Path]) -> None:
    """Whole-model bf16 logits drift ~7e-2 from fp32 on CPU (4 layers, random weights); CUDA must not be worse."""
    ref = _logits(tiny_pair[0], "cpu", torch.float32)
    cpu = _rel(_logits(tiny_pair[0], "cpu", torch.bfloat16), ref)
    cuda = _rel(_logits(tiny_pair[0], "cuda", torch.bfloat16), ref)
    print(f"\nbf16 logits rel err vs fp32: cpu {cpu:.3e}, cuda {cuda:.3e}")
    assert 1e-3 < cuda < 1.5 * cpu


def _parity(tiny_pair: tuple[Path, Path], **kw: object) -> dict:
    from glmconv.compare import ParityOptions, run_parity

    hf, mc = tiny_pair
    return run_parity(ParityOptions(hf_dir=hf, mcore_dir=mc, tokens=TOKENS, sequences=SEQUENCES, device="cuda",
                                    progress=False, **kw))  # type: ignore[arg-type]


def test_aligned_parity_on_cuda_is_fp32_noise(tiny_pair: tuple[Path, Path]) -> None:
    r = _parity(tiny_pair, train_conventions="serve", kernels="reference")
    assert r["first_divergence"] is None
    assert max(rec["rel_err"] for rec in r["layers"]) < 1e-5
    assert r["logits"]["top1_agreement"] == 1.0 and r["logits"]["logprob_abs_diff"]["max"] < 1e-4


def test_hc_mix_bf16_on_cuda_is_named_at_layer_0_attention(tiny_pair: tuple[Path, Path]) -> None:
    r = _parity(tiny_pair, train_conventions="serve", overrides=("hc_mix=bf16",), kernels="reference")
    assert r["first_divergence"] is not None
    assert (r["first_divergence"]["layer"], r["first_divergence"]["sub_block"]) == (0, "attention")


def test_kernels_on_the_train_side_report_their_own_error(tiny_pair: tuple[Path, Path]) -> None:
    """--kernels auto (the default) on CUDA: fla KDA, tilelang SparseMLA and the triton indexer on the train
    side; every attention record carries the kernels' own error, which stays within bf16 rounding, and each kernel
    call is within its bound against its reference."""
    r = _parity(tiny_pair, train_conventions="serve", dtype="bf16")
    assert r["kernels"] == "kernels"
    attn = [rec for rec in r["layers"] if rec["sub_block"] == "attention"]
    assert attn and all(0 < rec["kernel_rel_err"] < 3e-2 and rec["kernels_within"] for rec in attn)
    assert all(rec["kernel_topk_overlap"] > 0.9 for rec in attn if "kernel_topk_overlap" in rec)


def _numbers(report: dict) -> dict:
    """A report without its times, memory and the streaming flag."""
    out = {k: v for k, v in report.items() if k not in ("elapsed_s", "wall_s", "peak_memory", "stream_layers")}
    out["layers"] = [{k: v for k, v in rec.items() if k not in ("wall_s", "load_s")} for rec in report["layers"]]
    return out


def test_streamed_parity_on_cuda_equals_resident_with_kernels(tiny_pair: tuple[Path, Path]) -> None:
    """--stream-layers frees and reloads weights (experts stacked on the GPU per layer): the same bits as resident."""
    resident, streamed = (_parity(tiny_pair, dtype="bf16", stream_layers=s) for s in (False, True))
    assert resident["kernels"] == "kernels" and resident["summary"]["max_rel_err"] > 1e-3
    assert _numbers(streamed) == _numbers(resident)
    assert streamed["peak_memory"]["device"].startswith("cuda") and streamed["peak_memory"]["bytes"] > 0


def test_fp8_dequantised_on_the_gpu_has_the_cpu_bits() -> None:
    """HfWeights(device=cuda) dequantises FP8 there: one fp32 multiply and a BF16 cast, so bit-identical."""
    from glmconv.numerics.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks

    g = torch.Generator().manual_seed(3)
    for shape in ((2048, 4096), (300, 200)):
        q, s = quantize_fp8_blocks(torch.randn(shape, generator=g) * 0.02)
        cpu = dequantize_fp8_blocks(q, s)
        gpu = dequantize_fp8_blocks(q.cuda(), s.cuda()).cpu()
        assert torch.equal(cpu.view(torch.int16), gpu.view(torch.int16)), shape

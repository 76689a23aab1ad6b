"""FP8 e4m3 128x128 block (de)quantisation: error bounds, edge cropping, exactness, rejected inputs."""

from __future__ import annotations

import pytest
import torch

from glmconv.errors import GlmconvError
from glmconv.numerics.fp8 import E4M3_MAX, Fp8FormatError, dequantize_fp8_blocks, quantize_fp8_blocks, scale_shape

REL = 2.0**-4  # e4m3 has 3 mantissa bits: round-to-nearest relative error <= 2^-4 for normals
SUB = 2.0**-10  # half the subnormal spacing (2^-9), in units of the block scale


def _weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Normal values whose magnitude varies by block, so each block gets its own scale."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-3, 2, rows * cols).reshape(rows, cols)
    return torch.randn(rows, cols, generator=g) * spread[torch.randperm(rows, generator=g)]


def _block_scales(scale: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def test_round_trip_error_is_within_e4m3_precision():
    w = _weights(300, 200)
    q, s = quantize_fp8_blocks(w)
    back = dequantize_fp8_blocks(q, s, out_dtype=torch.float32)
    bound = torch.maximum(REL * w.abs(), SUB * _block_scales(s, 300, 200, 128)) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert (back - w).norm() / w.norm() < 0.04


def test_scale_is_block_amax_over_448_and_the_amax_maps_to_448():
    w = _weights(300, 200, seed=1)
    q, s = quantize_fp8_blocks(w)
    assert s.dtype == torch.float32 and tuple(s.shape) == (3, 2)
    for i in range(3):
        for j in range(2):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert s[i, j].item() == pytest.approx(blk.abs().max().item() / E4M3_MAX, rel=1e-7)
            assert q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float().abs().max().item() == E4M3_MAX


def _naive_quantize(w: torch.Tensor, block: int) -> tuple[list[list[float]], list[list[float]]]:
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    scale = [[0.0] * nc for _ in range(nr)]
    for bi in range(nr):
        for bj in range(nc):
            amax = max(abs(w[i, j].item()) for i in range(bi * block, min(rows, (bi + 1) * block))
                       for j in range(bj * block, min(cols, (bj + 1) * block)))
            scale[bi][bj] = (torch.tensor(amax) / E4M3_MAX).item() if amax else 1.0  # fp32 divide
    q = [[(w[i, j] / scale[i // block][j // block]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).item()
          for j in range(cols)] for i in range(rows)]
    return q, scale


def test_edge_blocks_are_cropped_like_a_per_element_loop():
    w = _weights(10, 7, seed=2)
    q, s = quantize_fp8_blocks(w, block=4)
    ref_q, ref_s = _naive_quantize(w, block=4)
    assert tuple(s.shape) == (3, 2) and s.tolist() == ref_s
    assert q.float().tolist() == ref_q
    back = dequantize_fp8_blocks(q, s, block=4, out_dtype=torch.float32)
    expect = [[(torch.tensor(q[i, j].item(), dtype=torch.float32) * s[i // 4, j // 4]).item() for j in range(7)]
              for i in range(10)]
    assert back.tolist() == expect


def test_300x200_dequant_matches_a_per_block_loop_exactly():
    q, s = quantize_fp8_blocks(_weights(300, 200, seed=3))
    back = dequantize_fp8_blocks(q, s, out_dtype=torch.float32)
    assert tuple(s.shape) == scale_shape((300, 200)) == (3, 2)
    for i in range(3):
        for j in range(2):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            assert torch.equal(back[rows, cols], q[rows, cols].float() * s[i, j])
    assert back[256:].shape == (44, 200) and back[:, 128:].shape == (300, 72)


def test_block_aligned_dequant_matches_a_per_block_loop_exactly():
    """256x384: the in-place block-view path (the release's shapes are multiples of 128)."""
    q, s = quantize_fp8_blocks(_weights(256, 384, seed=5))
    back = dequantize_fp8_blocks(q, s, out_dtype=torch.float32)
    for i in range(2):
        for j in range(3):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            assert torch.equal(back[rows, cols], q[rows, cols].float() * s[i, j])
    assert torch.equal(dequantize_fp8_blocks(q, s), back.bfloat16())


def test_fp32_dequant_is_one_correctly_rounded_multiply():
    q, s = quantize_fp8_blocks(_weights(300, 200, seed=4))
    exact = q.double() * _block_scales(s, 300, 200, 128).double()  # 4 x 24 significant bits: exact in f64
    assert torch.equal(dequantize_fp8_blocks(q, s, out_dtype=torch.float32), exact.float())
    assert torch.equal(dequantize_fp8_blocks(q, s), exact.float().bfloat16())


def test_values_on_the_fp8_grid_round_trip_exactly():
    grid = torch.tensor([448.0, -448.0, 0.5, 0.015625, 2.0**-9, -3.5, 0.0, 240.0]).repeat(16, 16) * 2.0**-7
    q, s = quantize_fp8_blocks(grid)
    assert s.item() == 448.0 * 2.0**-7 / E4M3_MAX
    assert torch.equal(dequantize_fp8_blocks(q, s, out_dtype=torch.float32), grid)


def test_all_zero_block_gets_scale_one():
    w = torch.zeros(130, 10)
    w[129, 3] = 2.0
    q, s = quantize_fp8_blocks(w)
    assert s[0, 0].item() == 1.0 and not q[:128].float().any()
    assert s[1, 0] == torch.tensor(2.0) / E4M3_MAX and q[129, 3].float().item() == E4M3_MAX


def test_bf16_input_quantises_like_its_fp32_value():
    w = _weights(64, 192, seed=5).bfloat16()
    q1, s1 = quantize_fp8_blocks(w)
    q2, s2 = quantize_fp8_blocks(w.float())
    assert torch.equal(q1.float(), q2.float()) and torch.equal(s1, s2)


def test_block_aligned_weight_quantises_like_its_padded_copy_and_is_left_unchanged():
    w = _weights(256, 384, seed=7) * 3
    w[:128, :128] = -torch.rand(128, 128)  # a block whose amax is a negative value's magnitude
    w[128:, 256:] = 0.0  # and an all-zero one
    kept = w.clone()
    q, s = quantize_fp8_blocks(w)
    padded = torch.zeros(257, 385)
    padded[:256, :384] = w
    qp, sp = quantize_fp8_blocks(padded)
    assert torch.equal(q.view(torch.uint8), qp[:256, :384].view(torch.uint8)) and torch.equal(s, sp[:2, :3])
    assert s[1, 2].item() == 1.0 and s[0, 0] == w[:128, :128].abs().max() / E4M3_MAX
    assert torch.equal(w, kept)


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(2, 3, 4), torch.zeros(4, 4, dtype=torch.int32),
                                 torch.zeros(4, 4).to(torch.float8_e4m3fn)])


def test_quantize_rejects_non_2d_or_non_float(bad):
    with pytest.raises(Fp8FormatError):
        quantize_fp8_blocks(bad)


def test_dequantize_rejects_a_non_fp8_weight():
    with pytest.raises(Fp8FormatError, match="float8_e4m3fn"):
        dequantize_fp8_blocks(torch.zeros(4, 4, dtype=torch.bfloat16), torch.ones(1, 1))


def test_dequantize_rejects_wrong_scale_shape_with_the_expected_shape():
    q, _ = quantize_fp8_blocks(torch.ones(300, 200))
    with pytest.raises(Fp8FormatError, match=r"must be \[3, 2\], got \[2, 2\]"):
        dequantize_fp8_blocks(q, torch.ones(2, 2))


def test_dequantize_rejects_non_f32_scales():
    q, s = quantize_fp8_blocks(torch.ones(4, 4))
    with pytest.raises(Fp8FormatError, match="F32"):
        dequantize_fp8_blocks(q, s.bfloat16())


@pytest.mark.parametrize("block", [0, -128, True])
def test_block_size_must_be_a_positive_integer(block):
    with pytest.raises(Fp8FormatError):
        quantize_fp8_blocks(torch.ones(4, 4), block=block)


def test_format_errors_are_user_facing_glmconv_errors():
    assert issubclass(Fp8FormatError, GlmconvError)

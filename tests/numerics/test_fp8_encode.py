"""Issue 38: export's FP8 encoding written for any device (fp32 math, IEEE divisions by tensors, RNE casts) gives
the bytes of the code before it, whole or in CPU slabs, on random blocks and edge values."""

from __future__ import annotations

import pytest
import torch
from helpers.fp8_cases import CASES, random_weight

from glmconv.numerics.finite import NonFiniteError
from glmconv.numerics.fp8 import E4M3_MAX, FP8_BLOCK, dequantize_fp8_blocks, quantize_fp8_blocks
from glmconv.numerics.fp8_encode import CpuEncoder, _rows, make_encoder, share_encoder, stackable, stacked_on
from glmconv.numerics.fp8_reuse import Fp8Blocks, encode
from glmconv.plan import TensorSpec
from glmconv.runners.backward import _encode_fp8

B = FP8_BLOCK
SHRINK = 2.0**-20


# ---- the encoding as it was before issue 38 (dividing by Python numbers), the reference ----------------------

def _legacy_blocks(x: torch.Tensor, fill: float | bool, how: str) -> torch.Tensor:
    rows, cols = x.shape
    sr, sc = -(-rows // B), -(-cols // B)
    padded = torch.full((sr * B, sc * B), fill, dtype=x.dtype)
    padded[:rows, :cols] = x
    view = padded.view(sr, B, sc, B)
    if how == "any":
        return view.any(dim=3).any(dim=1)
    return view.amax(dim=(1, 3)) if how == "amax" else view.amin(dim=(1, 3))


def _legacy_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    sr, sc = -(-rows // B), -(-cols // B)
    padded = torch.zeros(sr * B, sc * B, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(sr, B, sc, B)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = (blocks / scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    return scaled.view(sr * B, sc * B)[:rows, :cols].to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def _legacy_exact(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, s = _legacy_quantize(w)
    if w.dtype != torch.bfloat16:
        none = torch.zeros(s.shape, dtype=torch.bool)
        return q, s, none, none.clone()
    a = w.abs()
    bits = a.view(torch.int16)
    up = (bits + 1).view(torch.bfloat16).float()
    down = (bits - 1).clamp_min(0).view(torch.bfloat16).float()
    af, qa = a.float(), q.float().abs()
    nz = qa > 0
    lo = _legacy_blocks(torch.where(nz, (af + down) / 2 / qa * (1 + SHRINK), 0.0), 0.0, "amax")
    hi = _legacy_blocks(torch.where(nz, (af + up) / 2 / qa * (1 - SHRINK), float("inf")), float("inf"), "amin")
    moved = torch.where(lo <= hi, torch.minimum(torch.maximum(s, lo), hi), s)
    exact = _legacy_blocks(dequantize_fp8_blocks(q, moved).view(torch.int16) != w.view(torch.int16), False,
                           "any").logical_not()
    final = torch.where(exact, moved, s)
    return q, final.contiguous(), final != s, exact.logical_not()


def _legacy_encode(w: torch.Tensor, like: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[bytes, bytes, int]:
    """(codes, scales, blocks re-quantised) as `fp8_reuse.encode` gave them before issue 38."""
    q, s, _, _ = _legacy_exact(w.contiguous())
    if like is None:
        return q.view(torch.uint8).numpy().tobytes(), s.numpy().tobytes(), s.numel()
    got = dequantize_fp8_blocks(like[0], like[1], out_dtype=w.dtype)
    same = _legacy_blocks(got.view(torch.int16) != w.view(torch.int16), False, "any").logical_not()
    keep = same & torch.isfinite(like[1]) & (like[1] >= torch.finfo(torch.float32).tiny)
    elems = keep.repeat_interleave(B, 0)[:w.shape[0]].repeat_interleave(B, 1)[:, :w.shape[1]]
    codes = torch.where(elems, like[0].view(torch.uint8), q.view(torch.uint8))
    scales = torch.where(keep, like[1], s)
    return codes.numpy().tobytes(), scales.numpy().tobytes(), int(keep.logical_not().sum())


def _bytes(got: Fp8Blocks) -> tuple[bytes, bytes, int]:
    return got.codes.view(torch.uint8).numpy().tobytes(), got.scales.numpy().tobytes(), got.requantized


@pytest.mark.parametrize(("what", "w"), CASES, ids=[c[0] for c in CASES])
def test_encoding_gives_the_bytes_it_gave_before(what: str, w: torch.Tensor) -> None:
    assert _bytes(encode(w, None)) == _legacy_encode(w, None)


@pytest.mark.parametrize(("what", "w"), CASES[:3] + CASES[6:8], ids=[c[0] for c in CASES[:3] + CASES[6:8]])
def test_encoding_against_like_gives_the_bytes_it_gave_before(what: str, w: torch.Tensor) -> None:
    q, s = quantize_fp8_blocks(w)
    back = dequantize_fp8_blocks(q, s)
    back.view(-1)[:: 9973] = back.view(-1)[:: 9973] * -3  # some blocks changed, the others kept
    assert _bytes(encode(back, (q, s))) == _legacy_encode(back, (q, s))


@pytest.mark.parametrize("threads", [3])
@pytest.mark.parametrize(("what", "w"), CASES, ids=[c[0] for c in CASES])
def test_cpu_slabs_give_the_whole_weights_bytes(what: str, w: torch.Tensor, threads: int) -> None:
    q, s = quantize_fp8_blocks(w)
    back = dequantize_fp8_blocks(q, s, out_dtype=w.dtype).clone()
    back.view(-1)[:: 7919] = 0
    encoder = CpuEncoder(threads)
    try:
        for like in (None, (q, s), (q[:-1], s)):  # none, --like's pair, a pair of another shape (not comparable)
            want, got = encode(back, like), encoder(back, like)
            assert _bytes(got) == _bytes(want)
            assert (got.scale_adjusted, got.inexact) == (want.scale_adjusted, want.inexact)
    finally:
        encoder.close()


def _experts(n: int, rows: int, cols: int) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """`n` (at least 4) weights that --like's pairs reproduce, then one block of the second changed and the fourth
    all new."""
    gen = torch.Generator().manual_seed(0)
    likes = []
    for _ in range(n):
        codes = (torch.randn(rows, cols, generator=gen) * 50).clamp(-440, 440).to(torch.float8_e4m3fn)
        likes.append((codes, torch.rand(-(-rows // B), -(-cols // B), generator=gen) * 0.01 + 1e-3))
    ws = [dequantize_fp8_blocks(c, sc, out_dtype=torch.bfloat16) for c, sc in likes]
    ws[1] = ws[1].clone()
    ws[1][3, 5] += 1
    ws[3] = torch.randn(rows, cols, generator=gen).bfloat16()
    return ws, likes


def _counts(got: Fp8Blocks) -> tuple[int, int, int]:
    return got.requantized, got.scale_adjusted, got.inexact


@pytest.mark.parametrize("with_like", [True, False])
def test_stacked_weights_get_each_ones_own_bytes_and_counts(with_like: bool) -> None:
    ws, likes = _experts(5, 256, 320)
    pairs = likes if with_like else [None] * len(ws)
    got = stacked_on(torch.device("cpu"), ws, pairs)
    want = [encode(w, p) for w, p in zip(ws, pairs)]
    assert [_bytes(g) for g in got] == [_bytes(w) for w in want]
    assert [_counts(g) for g in got] == [_counts(w) for w in want]
    if with_like:
        assert [g.requantized for g in got] == [0, 1, 0, 6, 0]


def test_stacked_weights_all_reproduced_are_likes_own_tensors() -> None:
    ws, likes = _experts(5, 256, 320)
    kept = [0, 2, 4]
    got = stacked_on(torch.device("cpu"), [ws[i] for i in kept], [likes[i] for i in kept])
    assert all(g.codes is likes[i][0] and g.scales is likes[i][1] for g, i in zip(got, kept))


def test_the_cpu_encoder_takes_a_steps_small_weights_together() -> None:
    ws, likes = _experts(4, 128, 200)
    encoder = CpuEncoder(2)
    try:
        got = encoder.many(ws, list(likes))
    finally:
        encoder.close()
    assert [_bytes(g) for g in got] == [_bytes(encode(w, p)) for w, p in zip(ws, likes)]


def test_only_weights_encode_stacked_gives_the_bytes_of_are_stacked() -> None:
    ws, likes = _experts(4, 256, 320)
    ws, likes = ws[:3], likes[:3]
    assert stackable(ws, list(likes)) and stackable(ws, [None] * 3)
    assert not stackable(ws[:1], list(likes[:1]))  # one weight: nothing to gain
    assert not stackable([ws[0], ws[1][:128]], [None, None])  # two shapes
    assert not stackable([w[:200] for w in ws], [None] * 3)  # rows not whole 128-row blocks
    assert not stackable(ws, [likes[0], None, likes[2]])  # --like's pairs for some only
    assert not stackable(ws, [likes[0], (likes[1][0][:128], likes[1][1]), likes[2]])  # a pair that does not compare


def test_a_nan_is_refused_as_before() -> None:
    w = random_weight(300, 200, 1)
    w[130, 7] = float("nan")
    with pytest.raises(NonFiniteError, match=r"block \[1, 0\]"):
        encode(w, None)


def test_a_reused_block_is_finite_so_an_inf_never_passes_as_like_bytes() -> None:
    """--like's largest code times a scale past the BF16 range dequantises to Inf: that block is not reused, so an
    Inf weight there is refused by re-quantisation instead of passing as --like's finite bytes (export reads the
    weights of an all-FP8 mapping without a scan of its own)."""
    w = torch.full((128, 128), float("inf"), dtype=torch.bfloat16)
    codes = torch.full((128, 128), E4M3_MAX).to(torch.float8_e4m3fn)
    scale = torch.full((1, 1), 1e36)
    assert torch.equal(dequantize_fp8_blocks(codes, scale).view(torch.int16), w.view(torch.int16))
    with pytest.raises(NonFiniteError, match=r"^weight \(FP8 quantisation\): 16,384 non-finite values"):
        encode(w, (codes, scale))


def test_a_like_scale_past_the_bf16_range_is_requantised_even_where_its_codes_reproduce_the_weight() -> None:
    """Codes within [-1, 1] times 1e36 are finite, 448 times 1e36 is not: the rule is the scale's, not the codes'."""
    codes = (torch.rand(128, 128, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(torch.float8_e4m3fn)
    for scale, requantized in ((1e30, 0), (1e36, 1)):
        like = (codes, torch.full((1, 1), scale))
        w = dequantize_fp8_blocks(*like)
        assert bool(torch.isfinite(w).all())
        assert encode(w, like).requantized == requantized


def test_share_encoder_on_the_cpu_runs_torch_on_one_thread() -> None:
    before = torch.get_num_threads()
    with share_encoder("cpu", 10**12, 2) as (device, encoder):
        assert device == "cpu" and isinstance(encoder, CpuEncoder) and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    assert isinstance(make_encoder("cpu", 1), CpuEncoder)
    with share_encoder("cuda", 0, 2) as (device, encoder):  # nothing to encode: no CUDA context, torch left alone
        assert device == "cpu" and torch.get_num_threads() == before


def test_weights_adjacent_in_memory_stack_as_a_view_others_as_a_copy() -> None:
    stack = torch.randn(4 * 128, 64).bfloat16()
    parts = list(stack.split(128))
    assert _rows(parts).data_ptr() == stack.data_ptr() and torch.equal(_rows(parts), stack)
    swapped = [parts[1], parts[0], parts[2]]
    assert _rows(swapped).data_ptr() != stack.data_ptr() and torch.equal(_rows(swapped), torch.cat(swapped))
    assert _rows([parts[0], parts[2]]).data_ptr() != stack.data_ptr()  # a gap between them


def test_a_steps_weights_in_any_order_get_their_own_bytes_stacked_without_a_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ws, _ = _experts(4, 128, 256)
    views = list(torch.cat(ws).split(128))  # a read chunk's experts, handed over in another order
    order = [2, 0, 3, 1]
    cat = torch.cat
    copies: list[int] = []
    monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: copies.append(len(ts)) or cat(ts, *a, **k))
    encoder = CpuEncoder(1)  # 128-row weights: encoded stacked
    got = _encode_fp8([(TensorSpec(f"w{i}", (128, 256), "F8_E4M3"), views[i]) for i in order], None, encoder)
    assert copies == []
    assert [_bytes(g) for g in got] == [_bytes(encode(views[i], None)) for i in order]

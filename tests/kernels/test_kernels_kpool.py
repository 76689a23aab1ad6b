"""glmconv's triton kpool indexer (glmconv.kernels.kpool) against its torch reference, on the CPU.

Without CUDA the triton kernels run under TRITON_INTERPRET=1 (set here before the kernels are defined) at
tiny sizes: packed sequences shorter than, equal to and longer than index_topk, with and without the tail,
fp32 and bf16. Selections must be the same sets (exact ties aside, each checked in fp64), with the same
layout of pool slots, tail and -1 padding.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from glmconv.kernels.bench import cu_seqlens, indexer_inputs, kpool_disagreements
from glmconv.kernels.kpool import kpool_topk, layout
from glmconv.ops.kpool import KpoolParams
from glmconv.ops.kpool import kpool_topk as reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = (100, 1, 3, 4, 16, 17, 45)


@pytest.mark.parametrize("p", [KpoolParams(4, 16, 16, 4, True), KpoolParams(4, 16, 16, 4, False),
                               KpoolParams(8, 16, 24, 8, True), KpoolParams(4, 32, 16, 1, True)],
                         ids=["tiny", "no-tail", "kpool8", "kpool1"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_selections_equal_reference(p: KpoolParams, dtype: torch.dtype) -> None:
    x, q, w = indexer_inputs(sum(LENGTHS), DEV, dtype=dtype, seed=p.kpool, p=p, hidden=64, q_lora=32)
    cu = cu_seqlens(LENGTHS, DEV)
    got, want = kpool_topk(x, q, w, p, cu), reference(x, q, w, p, cu)
    assert got.shape == want.shape == (sum(LENGTHS), p.width) and got.dtype == want.dtype
    assert torch.equal(got < 0, want < 0)
    d = kpool_disagreements(x, q, w, p, cu, got, want)
    assert d["beyond_tie"] == 0 and d["differ"] <= 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_token_level_selections_without_compress_tensors_equal_reference(dtype: torch.dtype) -> None:
    """indexer_kpool=off: megatron-core's token-level indexer, pools of one token and no compress gate/ape."""
    import dataclasses

    from glmconv.ops.kpool import token_params

    p = token_params(KpoolParams(4, 16, 16, 4, True))
    x, q, w = indexer_inputs(sum(LENGTHS), DEV, dtype=dtype, seed=5, p=p, hidden=64, q_lora=32)
    w = dataclasses.replace(w, compress_gate=None, compress_ape=None)
    cu = cu_seqlens(LENGTHS, DEV)
    got, want = kpool_topk(x, q, w, p, cu), reference(x, q, w, p, cu)
    assert got.shape == want.shape == (sum(LENGTHS), 16)
    assert torch.equal(got < 0, want < 0)
    d = kpool_disagreements(x, q, w, p, cu, got, want)
    assert d["beyond_tie"] == 0 and d["differ"] <= 3


@torch.no_grad()
def test_int32_padded_width_for_the_attention_kernel() -> None:
    p = KpoolParams(4, 16, 16, 4, True)
    x, q, w = indexer_inputs(sum(LENGTHS), DEV, dtype=torch.float32, p=p, hidden=64, q_lora=32)
    cu = cu_seqlens(LENGTHS, DEV)
    a = kpool_topk(x, q, w, p, cu)
    b = kpool_topk(x, q, w, p, cu, width=64, dtype=torch.int32)
    assert b.dtype == torch.int32 and b.shape == (a.shape[0], 64)
    assert torch.equal(b[:, : a.shape[1]].long(), a) and bool((b[:, a.shape[1]:] == -1).all())


def test_layout_without_host_loop() -> None:
    """Pools numbered over the packed batch; each query sees one contiguous range of its own sequence's pools."""
    lay = layout(torch.tensor([0, 9, 10, 18]), 18, 4, 2)
    assert lay.pool_tok.tolist() == [0, 4, 10, 14]  # 9 -> 2 pools, 1 -> none, 8 -> 2
    assert lay.lo.tolist() == [0] * 9 + [2] + [2] * 8
    assert lay.hi.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert lay.krow.tolist() == [2] * 9 + [0] + [2] * 8
    assert lay.tail.tolist() == [1, 2, 3, 0, 1, 2, 3, 0, 1, 1, 1, 2, 3, 0, 1, 2, 3, 0]

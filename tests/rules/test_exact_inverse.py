"""verify checks an `exact_inverse` transform in one direction only: the claim must hold, and every transform
must make it (or deny it) itself."""

from __future__ import annotations

import pytest
import torch

from glmconv.rules import ops
from glmconv.rules.ops import Concat, Rename, SplitVector, StackExperts, Transform

CASES = [
    (Rename(), [(3, 4), (5,)], 2),
    (Concat(dim=0), [(2, 4), (3, 4)], 1),
    (Concat(dim=1), [(4, 2), (4, 3)], 1),
    (SplitVector(), [(4,)], 4),
    (StackExperts(parts=1), [(2, 5)] * 3, 1),
    (StackExperts(parts=2), [(2, 5)] * 6, 1),
]


@pytest.mark.parametrize(("transform", "shapes", "n_mcore"), CASES, ids=lambda c: repr(c)[:40])
def test_an_exact_inverse_gives_every_bit_back_both_ways(transform: Transform, shapes: list[tuple[int, ...]],
                                                         n_mcore: int) -> None:
    g = torch.Generator().manual_seed(0)
    hf = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    mcore = transform.forward(hf, n_mcore)
    assert transform.exact_inverse
    back = transform.backward(mcore, shapes)
    assert [b.view(torch.int16).tolist() for b in back] == [h.view(torch.int16).tolist() for h in hf]
    again = transform.forward(back, n_mcore)
    assert [a.view(torch.int16).tolist() for a in again] == [m.view(torch.int16).tolist() for m in mcore]


def test_every_transform_says_whether_it_is_an_exact_inverse() -> None:
    kinds = [c for c in vars(ops).values() if isinstance(c, type) and issubclass(c, Transform) and c is not Transform]
    assert sorted(c.__name__ for c in kinds) == ["Concat", "Rename", "SplitVector", "StackExperts"]
    assert all("exact_inverse" in vars(c) for c in kinds)
    assert Transform.exact_inverse is False

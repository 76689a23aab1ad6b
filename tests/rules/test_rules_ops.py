"""Each transform is exactly reversible and infers the Megatron shapes it produces."""

import pytest
import torch

from glmconv.rules.ops import Concat, Rename, SplitVector, StackExperts


def _rand(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


@pytest.mark.parametrize(("op", "hf"), [
    (Rename(), [_rand(5, 3)]),
    (Concat(0), [_rand(4, 1, 3), _rand(4, 1, 3), _rand(4, 1, 3)]),
    (SplitVector(), [_rand(3, dtype=torch.float32)]),
    (StackExperts(parts=2), [_rand(6, 4) for _ in range(6)]),
    (StackExperts(parts=1), [_rand(4, 6) for _ in range(3)]),
])


def test_forward_then_backward_is_bit_exact_and_shapes_agree(op, hf):
    n_mcore = 3 if isinstance(op, SplitVector) else 1
    mc = op.forward(hf, n_mcore)
    assert [tuple(t.shape) for t in mc] == op.mcore_shapes([tuple(t.shape) for t in hf], n_mcore)
    back = op.backward(mc, [tuple(t.shape) for t in hf])
    assert len(back) == len(hf)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, hf))


def test_stacked_fc1_holds_all_gates_then_all_ups():
    gates = [torch.full((2, 3), float(e)) for e in range(4)]
    ups = [torch.full((2, 3), 10.0 + e) for e in range(4)]
    (fc1,) = StackExperts(parts=2).forward(gates + ups, 1)
    assert fc1.shape == (4, 4, 3)
    assert fc1[2, :2].unique().tolist() == [2.0] and fc1[2, 2:].unique().tolist() == [12.0]


def test_split_vector_gives_pre_post_res_in_order():
    alphas = SplitVector().forward([torch.tensor([1.0, 2.0, 3.0])], 3)
    assert [a.tolist() for a in alphas] == [[1.0], [2.0], [3.0]]


def test_split_vector_refuses_a_wrong_length():
    with pytest.raises(ValueError, match=r"expects a \[3\] vector"):
        SplitVector().mcore_shapes([(4,)], 3)


@pytest.mark.parametrize("parts", [1, 2])
def test_rows_of_the_stack_come_from_the_hf_tensors_hf_for_rows_names(parts: int) -> None:
    experts = 5
    hf = [_rand(3, 4) + i for i in range(parts * experts)]
    op = StackExperts(parts=parts)
    (full,) = op.forward(hf, 1)
    for rows in (range(0, 1), range(1, 4), range(4, 5)):
        picks = op.hf_for_rows(rows, len(hf))
        (chunk,) = op.forward([hf[i] for i in picks], 1)
        assert torch.equal(chunk, full[rows.start:rows.stop])


def test_gated_expert_rows_pick_gate_then_up() -> None:
    assert StackExperts(parts=2).hf_for_rows(range(1, 3), 10) == [1, 2, 6, 7]


@pytest.mark.parametrize("op", [Rename(), Concat(0), SplitVector()])
def test_whole_tensor_transforms_do_not_split_by_rows(op) -> None:
    assert op.hf_for_rows(range(0, 1), 3) is None

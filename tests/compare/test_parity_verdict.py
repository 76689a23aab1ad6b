"""The parity verdict's parts: noise and excess, the reasons a record diverges, the judge's first divergence and
cause, Shapley attribution, and the bit-for-bit weight comparison with its names."""

from __future__ import annotations

import math

import pytest
import torch

from glmconv.compare import verdict
from glmconv.compare.attribution import shapley
from glmconv.compare.records import SelectionMeasure, SubBlockRecord
from glmconv.compare.verdict import Floors, Judge
from glmconv.compare.weight_diff import DIFFER, EQUAL, ROUNDED, row_ranges, status, structure_diffs, tensor_diff
from glmconv.models.weights import HcSite


def _rec(rel: float, noise: float = 0.0, ref: float | None = None, layer: int = 0,
         **kw: object) -> SubBlockRecord:
    return SubBlockRecord(layer, "attention", "kda", "dense", rel, rel, noise_serve=noise / 2, noise_train=noise / 2,
                          ref_rel_err=rel if ref is None else ref, **kw)  # type: ignore[arg-type]


def _topk(overlap: float, noise: float, ref_overlap: float) -> SelectionMeasure:
    return SelectionMeasure(overlap, noise, ref_overlap)


def test_excess_is_the_error_over_the_noise() -> None:
    assert verdict.excess(3e-3, 1e-3) == pytest.approx(3.0)
    assert verdict.excess(0.0, 0.0) == 0.0 and verdict.excess(1e-3, 0.0) == math.inf
    assert math.isnan(verdict.excess(math.nan, 0.0))


def test_an_error_within_twice_the_noise_with_equal_references_is_no_divergence() -> None:
    rec = verdict.with_noise(_rec(1.9e-2, noise=1e-2, ref=0.0))
    assert verdict.reasons(rec, Floors()) == [] and rec.excess == pytest.approx(1.9)


def test_an_error_beyond_twice_the_noise_diverges() -> None:
    rec = verdict.with_noise(_rec(2.1e-2, noise=1e-2, ref=0.0))
    assert verdict.reasons(rec, Floors()) == ["rel err beyond noise"]


def test_a_reference_difference_above_the_floor_diverges_even_inside_the_noise() -> None:
    rec = verdict.with_noise(_rec(1e-3, noise=1e-2, ref=2e-5))
    assert verdict.reasons(rec, Floors()) == ["reference rel err"]
    assert verdict.reasons(rec, Floors(stream=1e-4)) == []


def test_differing_weights_diverge_unless_weights_may_differ() -> None:
    rec = _rec(0.0, weights=DIFFER)
    assert verdict.reasons(rec, Floors()) == ["weights differ"]
    assert verdict.reasons(rec, Floors(), check_weights=False) == []


def test_a_nan_error_always_diverges() -> None:
    rec = verdict.with_noise(_rec(math.nan, noise=1.0))
    assert "rel err beyond noise" in verdict.reasons(rec, Floors())


def test_selection_disagreement_is_judged_against_its_own_noise_and_not_when_replayed() -> None:
    rec = _rec(0.0, topk=_topk(0.99, 0.006, 1.0))
    assert verdict.reasons(rec, Floors()) == []  # 1% flips, noise alone flips 0.6%: within 2x
    rec = rec.replace(topk=_topk(0.99, 0.004, 1.0))
    assert verdict.reasons(rec, Floors()) == ["topk beyond noise"]
    rec = rec.replace(topk=_topk(0.99, 0.004, 0.99))
    assert verdict.reasons(rec, Floors()) == ["reference topk", "topk beyond noise"]
    assert verdict.reasons(rec.replace(replayed="topk"), Floors()) == []


def test_the_judge_keeps_the_first_divergence_and_names_its_cause() -> None:
    judge = Judge()
    recs = [_rec(0.0), _rec(0.5, layer=1, weights=DIFFER), _rec(0.5, layer=2)]
    judged = [judge(r, []) for r in recs]
    assert [first for _, first in judged] == [False, True, False] and judge.diverged == 2
    assert judge.first is not None and (judge.first.layer, judge.first.cause) == (1, "weights")
    assert judged[2][0].cause == "upstream" and judged[0][0].diverged is False
    isolated = Judge(propagated=False)
    isolated(recs[1], [])
    assert isolated(recs[2], [])[0].cause == "numerics"  # no upstream in isolated mode
    conv = Judge()
    conv(_rec(0.1), ["proj_rms=megatron"])
    assert conv.first is not None and (conv.first.cause, conv.first.switches) == ("conventions", ("proj_rms=megatron",))


def test_a_record_reads_back_from_its_json_unchanged() -> None:
    rec = verdict.with_noise(_rec(0.25, noise=1e-2, topk=_topk(0.5, 0.01, 1.0), weights=DIFFER))
    rec = rec.replace(diverged=True, why=("weights differ",), cause="weights")
    assert SubBlockRecord.from_json(rec.as_json()) == rec
    assert list(rec.as_json()) == ["layer", "sub_block", "attn_type", "mlp_type", "rel_err", "max_abs",
                                   "noise_serve", "noise_train", "ref_rel_err", "topk_overlap", "topk_noise",
                                   "topk_ref_overlap", "weights", "noise", "excess", "topk_excess", "diverged", "why",
                                   "cause"]


def test_shapley_shares_add_up_to_the_total_less_the_rest() -> None:
    effect = {"a": 3.0, "b": 1.0}

    def v(on: frozenset[str]) -> float:  # an interaction: both on gives more than the sum
        return 0.5 + sum(effect[s] for s in on) + (2.0 if on == {"a", "b"} else 0.0)

    att = shapley(["a", "b"], v)
    assert att["total"] == 6.5 and att["rest"] == 0.5
    assert att["shares"] == {"a": pytest.approx(4.0), "b": pytest.approx(2.0)}
    assert sum(att["shares"].values()) == pytest.approx(att["total"] - att["rest"])


def test_equal_tensors_have_no_diff_and_nan_equals_the_same_nan() -> None:
    a = torch.tensor([[1.0, math.nan], [3.0, 4.0]], dtype=torch.bfloat16)
    assert tensor_diff(a, a.clone(), ("w",)) is None


def test_a_differing_row_is_located_and_measured() -> None:
    a = torch.zeros(6, 4)
    b = a.clone()
    b[2, 1], b[3, 0] = 0.5, -0.25
    d = tensor_diff(a, b, ("kda", "q_proj"))
    assert d is not None and (d.kind, d.rows, d.elements, d.max_abs_diff) == (DIFFER, [2, 3], 2, 0.5)


def test_bf16_rounding_is_told_from_a_defect() -> None:
    a = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    d = tensor_diff(a, a.to(torch.bfloat16).float(), ("w",))
    assert d is not None and d.kind == ROUNDED
    assert status([d]) == ROUNDED and status([]) == EQUAL


def test_structure_diffs_walk_dataclasses_and_name_the_field() -> None:
    a = HcSite(torch.ones(3, 2), torch.zeros(3), torch.ones(3))
    b = HcSite(torch.ones(3, 2), torch.zeros(3), torch.tensor([1.0, 2.0, 1.0]))
    (d,) = structure_diffs(a, b, ("hc",))
    assert d.path == ("hc", "scale") and d.rows == [1]


def test_row_ranges_are_compact() -> None:
    assert row_ranges([0, 1, 2, 3, 17, 40, 41]) == "0-3, 17, 40-41"
    assert row_ranges(list(range(0, 40, 2)), most=2) == "0, 2, ... (20 rows)"

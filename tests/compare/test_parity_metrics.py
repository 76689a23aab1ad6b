"""Parity metrics on hand-made tensors with answers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from glmconv.compare import metrics as m
from glmconv.compare.metric_table import bound_names, scalars
from glmconv.compare.records import SubBlockRecord
from glmconv.compare.verdict import with_noise
from glmconv.errors import GlmconvError


def test_rel_err_and_max_abs() -> None:
    b = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    a = b.clone()
    a[0, 0] += 0.05  # ||a-b|| = 0.05, ||b|| = 5
    assert m.rel_err(a, b) == pytest.approx(0.01, rel=1e-12)
    assert m.max_abs(a, b) == pytest.approx(0.05, rel=1e-6)
    assert m.rel_err(b, b) == 0.0
    assert m.rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
    assert m.rel_err(torch.ones(3), torch.zeros(3)) == math.inf


def test_rel_err_is_exact_for_bf16_inputs() -> None:
    b = torch.ones(4, dtype=torch.bfloat16)
    a = b.clone()
    a[0] = 2.0  # ||(1,0,0,0)|| / ||(1,1,1,1)|| = 1/2
    assert m.rel_err(a, b) == 0.5


def test_expert_overlap_is_set_intersection_over_k() -> None:
    serve = torch.tensor([[0, 1], [2, 3], [5, 6]])
    train = torch.tensor([[1, 0], [2, 4], [7, 0]])  # order does not matter: 2/2, 1/2, 0/2
    assert m.selection_overlap(train, serve) == pytest.approx(0.5)
    assert m.selection_overlap(serve, serve) == 1.0


def test_topk_overlap_ignores_sentinels_and_empty_rows() -> None:
    serve = torch.tensor([[0, 1, -1], [0, 1, 2], [-1, -1, -1]], dtype=torch.int32)
    train = torch.tensor([[1, -1, -1], [0, 2, 5], [3, -1, -1]], dtype=torch.int32)
    # token 0: {1} & {0,1} -> 1/2; token 1: {0,2} & {0,1,2} -> 2/3; token 2: serve selects nothing -> left out
    assert m.selection_overlap(train, serve) == pytest.approx((0.5 + 2 / 3) / 2)
    assert m.selection_overlap(serve, serve) == 1.0
    assert m.selection_overlap(torch.full((2, 3), -1), torch.full((2, 3), -1)) == 1.0


def test_topk_overlap_with_different_widths() -> None:
    serve = torch.tensor([[4, 3, 2, 1]])
    train = torch.tensor([[1, 2]])
    assert m.selection_overlap(train, serve) == pytest.approx(0.5)


def test_next_token_positions_stay_inside_each_sequence() -> None:
    assert m.next_token_positions(torch.tensor([0, 3, 5, 6])).tolist() == [0, 1, 3]


def test_logit_stats_known_answer() -> None:
    serve = torch.zeros(2, 2)  # p = (1/2, 1/2) at both positions
    train = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])  # p = (3/4, 1/4) at position 0
    ids = torch.tensor([0, 0])  # one sequence: position 0 predicts token 0; position 1 has no next token
    s = m.logit_stats(train, serve, ids, torch.tensor([0, 2])).summary()
    assert s["next_token_positions"] == 1 and s["positions"] == 2
    assert s["logprob_abs_diff"]["max"] == pytest.approx(math.log(1.5))
    assert s["logprob_abs_diff"]["mean"] == pytest.approx(math.log(1.5))
    # KL(serve||train) at position 0: 1/2 log(2/3) + 1/2 log 2 = 1/2 log(4/3); position 1: 0
    assert s["kl"] == pytest.approx(0.5 * math.log(4 / 3) / 2)
    assert s["top1_agreement"] == 1.0  # serve's ties resolve to the first index, train's argmax is 0 too


def test_logit_stats_shift_invariant_and_top1() -> None:
    g = torch.Generator().manual_seed(0)
    serve = torch.randn(10, 7, generator=g, dtype=torch.float64)
    s = m.logit_stats(serve + 3.0, serve, torch.arange(10) % 7, torch.tensor([0, 4, 10])).summary()
    assert s["logprob_abs_diff"]["max"] < 1e-12 and s["kl"] < 1e-12 and s["top1_agreement"] == 1.0
    swapped = serve.clone()
    swapped[0] = -serve[0]  # the top-1 of position 0 becomes its bottom-1
    assert m.logit_stats(swapped, serve, torch.arange(10) % 7, torch.tensor([0, 10])).summary()[
        "top1_agreement"] == pytest.approx(0.9)


def test_logit_stats_chunks_agree_with_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(37, 11, generator=g), torch.randn(37, 11, generator=g)
    ids, cu = torch.randint(0, 11, (37,), generator=g), torch.tensor([0, 20, 37])
    whole = m.logit_stats(a, b, ids, cu)
    monkeypatch.setattr(m, "LOGIT_CHUNK", 5)
    chunked = m.logit_stats(a, b, ids, cu)
    for name in ("logprob_abs_diff", "top1_agree", "kl"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name


def test_quantile_summary() -> None:
    s = m.quantile_summary(torch.arange(101, dtype=torch.float64))  # 0..100
    assert s == {"mean": 50.0, "p99": 99.0, "max": 100.0}
    assert m.quantile_summary(torch.zeros(0)) == {"mean": 0.0, "p99": 0.0, "max": 0.0}


def _rec(layer: int, sub: str, err: float) -> dict:
    return {"layer": layer, "sub_block": sub, "rel_err": err}


@pytest.mark.parametrize("text,metric,op,limit", [
    ("logprob_abs_diff.max>1e-4", "logprob_abs_diff.max", ">", 1e-4),
    ("top1_agreement<0.99", "top1_agreement", "<", 0.99),
    (" kl > 0.5 ", "kl", ">", 0.5),
    ("expert_overlap_min<1", "expert_overlap_min", "<", 1.0),
    ("kl>=1", "kl", ">=", 1.0),
    ("top1_agreement <= 0.5", "top1_agreement", "<=", 0.5),
    ("divergences>=1", "divergences", ">=", 1.0),
])


def test_parse_bound(text: str, metric: str, op: str, limit: float) -> None:
    b = m.parse_bound(text)
    assert (b.metric, b.op, b.limit) == (metric, op, limit)


@pytest.mark.parametrize("text", ["kl", "kl>1>2", "kl<>1", "nope>1", "kl>abc", "kl>nan", ">1", "kl>", "kl>=1<=2"])
def test_parse_bound_rejects(text: str) -> None:
    with pytest.raises(GlmconvError, match="--fail-on"):
        m.parse_bound(text)


@pytest.mark.parametrize("text,op", [("kl=1", "="), ("kl==1", "=="), ("kl=>1", "=>"), ("kl!=1", "!="), ("kl<>1", "<>")])
def test_an_unknown_operator_is_named_with_the_ones_accepted(text: str, op: str) -> None:
    with pytest.raises(GlmconvError) as exc:
        m.parse_bound(text)
    assert str(exc.value) == (f"--fail-on {text!r}: operator {op!r} is not one of <, <=, >, >= (expected METRIC>VALUE, "
                              "METRIC>=VALUE, METRIC<VALUE or METRIC<=VALUE)")


def test_or_equal_bounds_break_at_the_limit_itself() -> None:
    values = {"kl": 1.0, "top1_agreement": 0.5, "max_rel_err": math.nan}
    got = m.check_bounds([m.parse_bound(t) for t in ("kl>=1", "kl>1", "kl>=1.5", "top1_agreement<=0.5",
                                                       "top1_agreement<0.5", "max_rel_err>=1", "max_rel_err<=1")],
                         values)
    assert [r.broken for r in got] == [True, False, False, True, False, True, True]
    assert got[0].as_json() == {"bound": "kl>=1", "metric": "kl", "op": ">=", "limit": 1.0, "value": 1.0,
                                "broken": True}


def test_check_bounds() -> None:
    values = {"kl": 0.2, "top1_agreement": 0.98, "max_rel_err": math.nan, "expert_overlap_min": None}
    got = m.check_bounds([m.parse_bound(t) for t in ("kl>0.1", "kl>0.2", "top1_agreement<0.99",
                                                       "top1_agreement<0.98", "max_rel_err>1")], values)
    assert [r.broken for r in got] == [True, False, True, False, True]
    assert got[0].as_json() == {"bound": "kl>0.1", "metric": "kl", "op": ">", "limit": 0.1, "value": 0.2,
                                "broken": True}
    with pytest.raises(GlmconvError, match="not measured"):
        m.check_bounds([m.parse_bound("expert_overlap_min<1")], values)
    with pytest.raises(GlmconvError) as exc:
        m.check_bounds([m.parse_bound("expert_overlap_min<1")], values,
                       {"expert_overlap_min": "not measured in this run: no MoE layer"})
    assert str(exc.value) == ("--fail-on expert_overlap_min<1: expert_overlap_min was not measured in this run: "
                              "no MoE layer")


def _records(*recs: dict) -> list[SubBlockRecord]:
    return [SubBlockRecord.from_json({"attn_type": "kda", "mlp_type": "moe", "max_abs": 0.0, **r}) for r in recs]


def test_scalars() -> None:
    layers = _records({**_rec(0, "attention", 1e-3), "topk_overlap": 0.75},
                      {**_rec(0, "mlp", 2e-3), "expert_overlap": 0.5}, _rec(1, "attention", 1e-4),
                      {**_rec(1, "mlp", 5e-4), "expert_overlap": 0.9})
    logits = {"logprob_abs_diff": {"mean": 0.1, "p99": 0.2, "max": 0.3}, "kl": 0.01, "top1_agreement": 0.75}
    v = scalars(layers, logits)
    assert v["max_rel_err"] == 2e-3 and v["final_rel_err"] == 5e-4
    assert v["expert_overlap_min"] == 0.5 and v["topk_overlap_min"] == 0.75
    assert v["top1_disagreement"] == 0.25 and v["logprob_abs_diff.p99"] == 0.2
    assert set(v) == set(bound_names()) and v["excess.max"] is None and v["divergences"] == 0.0


def test_the_selections_excess_maxima_are_their_records_largest() -> None:
    """A record's selection ratios are `topk_excess` and `experts_excess` (records.SELECTIONS): expert_excess.max
    was never measured, so `--fail-on expert_excess.max>4` was refused on every run."""
    layers = [with_noise(r) for r in _records(
        {**_rec(0, "mlp", 1e-3), "expert_overlap": 0.75, "experts_noise": 0.05, "noise_serve": 1e-3},
        {**_rec(1, "attention", 1e-3), "topk_overlap": 0.9, "topk_noise": 0.05, "noise_serve": 1e-3})]
    logits = {"logprob_abs_diff": {"mean": 0.1, "p99": 0.2, "max": 0.3}, "kl": 0.01, "top1_agreement": 0.75}
    v = scalars(layers, logits)
    assert v["expert_excess.max"] == pytest.approx(5.0) and v["topk_excess.max"] == pytest.approx(2.0)
    assert v["excess.max"] == pytest.approx(1.0)

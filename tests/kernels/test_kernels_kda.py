"""glmconv's KDA reference against fla's own torch references (fla.ops.kda.naive, fla's gate), on the CPU.

fla's naive code is an independent second oracle of the recurrence and of the lower-bound gate that the
GPU path (glmconv.kernels.kda -> fla's chunk_kda with the gate, beta and l2 norm in kernel) relies on.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from glmconv import fla_guard

with mock.patch.dict(os.environ, {fla_guard.ENV: "1"}):  # fla's torch references run on a CPU: import them there
    pytest.importorskip("fla.ops.kda.naive")
    from fla.ops.kda.gate import naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from glmconv.kernels.bench import cu_seqlens, kda_inputs
from glmconv.ops.kda import KdaParams, chunk_kda, forget_gate, l2norm, recurrent_kda, segments

P = KdaParams(heads=4, head_dim=16, lower_bound=-5.0, norm_eps=1e-5)
LENGTHS = (70, 1, 64, 5)
CHUNK_LENGTHS = (128, 64)  # fla's naive_chunk_kda takes whole chunks only


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_forget_gate_equals_fla_lower_bound_gate() -> None:
    a = kda_inputs(50, "cpu", torch.float32, p=P)
    want = naive_kda_lowerbound_gate(a["f"].view(50, P.heads, P.head_dim), a["a_log"], a["dt_bias"], P.lower_bound)
    assert _rel(forget_gate(a["f"], a["a_log"], a["dt_bias"], P), want) < 1e-6


@pytest.mark.parametrize("fla_naive", [naive_recurrent_kda, naive_chunk_kda], ids=["recurrent", "chunk"])
def test_glmconv_kda_equals_fla_naive_per_packed_sequence(fla_naive) -> None:  # type: ignore[no-untyped-def]
    lengths = CHUNK_LENGTHS if fla_naive is naive_chunk_kda else LENGTHS
    a = kda_inputs(sum(lengths), "cpu", torch.float32, seed=1, p=P)
    g = forget_gate(a["f"], a["a_log"], a["dt_bias"], P)
    beta = torch.sigmoid(a["b"])
    cu = cu_seqlens(lengths, "cpu")
    ours = {"recurrent": recurrent_kda, "chunk": chunk_kda}[fla_naive.__name__.split("_")[1]]
    got = ours(a["q"], a["k"], a["v"], g, beta, cu)
    for s, e in segments(cu):
        want, _ = fla_naive(l2norm(a["q"][s:e]).unsqueeze(0), l2norm(a["k"][s:e]).unsqueeze(0),
                            a["v"][s:e].unsqueeze(0), g[s:e].unsqueeze(0), beta[s:e].unsqueeze(0))
        assert _rel(got[s:e], want.squeeze(0)) < 1e-5

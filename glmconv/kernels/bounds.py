"""What a correct kernel's error against its torch reference stays within, per op and dtype (docs/kernels.md).

Each bound was measured at the real dimensions (real-cut4, 4,096 tokens in 3,072 + 1,024, H100 and H200) as the
worst error of the kernel against its reference on the same input over both parity modes, then given headroom;
the figures are in docs/kernels.md and benchmarks/RESULTS.md. A rounding error is unbiased: `bias` bounds the
part of the error that is a per-channel offset or gain on the reference output (a dropped bias, a wrong softmax
scale, a gate off by a factor), of which rounding spread over T tokens leaves about sqrt(2 / T) of the error.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    """A kernel's allowance: `rel_err` (||kernel - reference|| / ||reference||) and |bias|; for a selection,
    `mismatch` (the share of selected ids that differ beyond a score tie)."""

    rel_err: float = 0.0
    bias: float = 0.0
    mismatch: float = 0.0


# op -> dtype -> bound: about 3x the worst correct kernel measured on real-cut4 (H100, 2026-12-05: docs/kernels.md),
# wider where the tiny fixtures' padding (SparseMLA: 4 heads run as 16, a 32-wide latent as 576) needs it.
# SparseMLA runs bf16 whatever the run dtype; fla's chunk_kda uses tf32 dots on fp32 inputs, which leaves a
# systematic part (bias 1.1e-3 of its 1.6e-3 error), so its fp32 bias floor is wide.
BOUNDS: dict[str, dict[str, Bound]] = {
    "short_conv": {"bf16": Bound(rel_err=2e-4, bias=2e-5), "fp32": Bound(rel_err=1e-6, bias=2e-7)},
    "kda_core": {"bf16": Bound(rel_err=1.5e-2, bias=2.5e-3), "fp32": Bound(rel_err=5e-3, bias=4e-3)},
    "sparse_mla": {"bf16": Bound(rel_err=1.5e-2, bias=1e-3), "fp32": Bound(rel_err=1.5e-2, bias=1e-3)},
    "indexer": {"bf16": Bound(mismatch=1e-3), "fp32": Bound(mismatch=1e-3)},
}
BIAS_Z = 4.0  # a bias up to 4x what rounding of the call's own error leaves systematic by chance is rounding
TIE_RTOL = 1e-5  # two selected pools whose reference scores differ by at most this x the row's largest score tie


def bound(op: str, dtype: str) -> Bound:
    """The bound of `op` in a run of `dtype` ("bf16" or "fp32")."""
    return BOUNDS[op][dtype]

"""Before a parity run: are the two checkpoints a conversion of each other at all?

Two unrelated checkpoints give a report full of "divergences" that are no train-vs-serve difference (top-1
agreement 0, exit 0 without a bound). The leading rows of the embedding and of the output head, read through
the mapping, tell that in milliseconds; they are random-looking in any real or generated checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from glmconv.compare.verdict import DIFFER
from glmconv.compare.weight_diff import tensor_diff
from glmconv.errors import GlmconvError
from glmconv.models.weights import WeightSource
from glmconv.rules import roles as R

FINGERPRINT_ROLES = (R.EMBED, R.LM_HEAD)
FINGERPRINT_ROWS = 8
UNRELATED = 0.5  # more than half the fingerprint's values differ in every role: not the same model's weights


class DifferentWeightsError(GlmconvError):
    """The torch_dist checkpoint is not a conversion of the HF checkpoint."""


def check_same_weights(serve: WeightSource, train: WeightSource, hf_dir: Path, mcore_dir: Path) -> None:
    """Refuse a pair whose fingerprint tensors all differ almost everywhere: unrelated checkpoints, not a conversion
    with a defect in some rows (the verdict names those) or rounded to BF16 (`convert --dtype bf16`)."""

    gaps = []
    for role in FINGERPRINT_ROLES:
        a, b = serve.leading_rows(role, FINGERPRINT_ROWS), train.leading_rows(role, FINGERPRINT_ROWS)
        d = tensor_diff(a, b, (role,))
        if d is None or d.kind != DIFFER or (a.shape == b.shape and d.elements <= UNRELATED * a.numel()):
            return
        gaps.append(f"{role}: " + (f"max abs diff {d.max_abs_diff:.3g}" if a.shape == b.shape
                                   else f"shapes {list(a.shape)} vs {list(b.shape)}"))
    raise DifferentWeightsError(
        f"{mcore_dir} is not a conversion of {hf_dir}: their {' and '.join(FINGERPRINT_ROLES)} weights differ in "
        f"the first {FINGERPRINT_ROWS} rows almost everywhere ({'; '.join(gaps)}); pass --allow-different-weights "
        "to compare them anyway")

"""Before a parity run: are the two checkpoints a conversion of each other at all?

Two unrelated checkpoints give a report full of "divergences" that are no train-vs-serve difference (top-1
agreement 0, exit 0 without a bound). The leading rows of the embedding and of the output head, read through
the mapping, tell that in milliseconds; they are random-looking in any real or generated checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from glmconv.errors import GlmconvError
from glmconv.rules import roles as R

if TYPE_CHECKING:
    from glmconv.models.weights import WeightSource

FINGERPRINT_ROLES = (R.EMBED, R.LM_HEAD)
FINGERPRINT_ROWS = 8


class DifferentWeightsError(GlmconvError):
    """The torch_dist checkpoint is not a conversion of the HF checkpoint."""


def check_same_weights(serve: WeightSource, train: WeightSource, hf_dir: Path, mcore_dir: Path) -> None:
    """Refuse a pair whose fingerprint tensors differ (values compared exactly, in float32)."""
    for role in FINGERPRINT_ROLES:
        a = serve.leading_rows(role, FINGERPRINT_ROWS).float()
        b = train.leading_rows(role, FINGERPRINT_ROWS).float()
        if a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all()):
            continue
        diff = f"max abs diff {float((a - b).abs().max()):.3g}" if a.shape == b.shape else \
            f"shapes {list(a.shape)} vs {list(b.shape)}"
        raise DifferentWeightsError(
            f"{mcore_dir} is not a conversion of {hf_dir}: their {role} weights differ in the first "
            f"{FINGERPRINT_ROWS} rows ({diff}); pass --allow-different-weights to compare them anyway")

"""Both sides' weights of a sub-block, compared bit for bit as the models hold them, and each difference named.

Parity already holds the serve and the train side's prepared weights of the layer it runs; comparing them says
whether a divergence there is a conversion defect (weights differ: the tensor, its HF and Megatron names, rows,
max abs difference) or conventions and numerics (weights equal). A difference that is exactly the BF16 rounding
of the serve value (`convert --dtype bf16`) is "rounded", not a defect.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from glmconv.compare.verdict import DIFFER, EQUAL, ROUNDED
from glmconv.models.weights import ExpertBank, FieldSource, WeightSource, field_source
from glmconv.plan import TensorSpec
from glmconv.rules import roles as R

if TYPE_CHECKING:
    import torch


_BITS = {2: "int16", 4: "int32", 8: "int64"}  # a float compared bit for bit as the int of its size


@dataclass
class TensorDiff:
    """Where one field of one sub-block differs between the two sides."""

    path: tuple[str, ...]
    kind: str  # DIFFER or ROUNDED
    rows: list[int]  # rows of the field (dim 0) holding a difference
    elements: int
    max_abs_diff: float
    expert: int | None = None

    def as_dict(self, layer: int | None, sub_block: str, serve: Any, train: Any) -> dict[str, Any]:
        src = field_source(sub_block, self.path) if sub_block in ("attention", "mlp") else FieldSource(sub_block)
        names = tensor_names(src, layer, self, serve, train) if src is not None else {}
        field = ".".join(self.path) + ("" if self.expert is None else f"[expert {self.expert}]")
        return {"layer": layer, "sub_block": sub_block, "field": field, "kind": self.kind, **names,
                "rows": row_ranges(self.rows), "elements": self.elements, "max_abs_diff": self.max_abs_diff}


def tensor_diff(a: torch.Tensor, b: torch.Tensor, path: tuple[str, ...], expert: int | None = None
                ) -> TensorDiff | None:
    """None when `b` (train) holds `a`'s (serve) bits; else where and how much it differs."""
    if a.shape != b.shape:
        return TensorDiff(path, DIFFER, [], max(a.numel(), b.numel()), float("inf"), expert)
    mask = _differs(a, b)
    if not bool(mask.any()):
        return None
    rows = mask.reshape(mask.shape[0], -1).any(1).nonzero().flatten().tolist() if mask.dim() else [0]
    gap = (a.double() - b.double()).abs()[mask]
    biggest = float(gap.nan_to_num(nan=float("inf")).max())
    kind = ROUNDED if _is_bf16_rounding(a, b) else DIFFER
    return TensorDiff(path, kind, rows, int(mask.sum()), biggest, expert)


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit difference (NaN equals the same NaN); values when the dtypes differ."""
    import torch

    if a.dtype == b.dtype and a.dtype.is_floating_point and a.element_size() in _BITS:
        bits = getattr(torch, _BITS[a.element_size()])
        return a.contiguous().view(bits) != b.contiguous().view(bits)
    a64, b64 = a.double(), b.double()
    return (a64 != b64) & ~(a64.isnan() & b64.isnan())


def _is_bf16_rounding(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether one side is the other rounded to BF16 (a requested `convert --dtype bf16`)."""
    import torch

    for wide, narrow in ((a, b), (b, a)):
        rounded = wide.to(torch.bfloat16).to(narrow.dtype)
        if not bool(_differs(rounded, narrow).any()):
            return True
    return False


def structure_diffs(serve: Any, train: Any, path: tuple[str, ...] = ()) -> Iterator[TensorDiff]:
    """Every differing tensor field of two weight structures (dataclasses, expert banks); a field one side does
    not hold (None, e.g. the kpool tensors under the token-level indexer) is not compared."""
    import torch

    if serve is None or train is None:
        return
    if isinstance(serve, torch.Tensor):
        d = tensor_diff(serve, train, path)
        if d is not None:
            yield d
    elif isinstance(serve, ExpertBank):
        yield from _bank_diffs(serve, train, path)
    elif dataclasses.is_dataclass(serve):
        for f in dataclasses.fields(serve):
            yield from structure_diffs(getattr(serve, f.name), getattr(train, f.name), (*path, f.name))


def _bank_diffs(serve: ExpertBank, train: ExpertBank, path: tuple[str, ...]) -> Iterator[TensorDiff]:
    if serve.num != train.num:
        yield TensorDiff((*path, "experts"), DIFFER, [], abs(serve.num - train.num), float("inf"))
        return
    for e in range(serve.num):
        a, b = serve.get(e), train.get(e)
        for name in ("gate", "up", "down"):
            d = tensor_diff(getattr(a, name), getattr(b, name), (*path, name), expert=e)
            if d is not None:
                yield d


def status(diffs: list[TensorDiff]) -> str:
    """EQUAL, ROUNDED (only BF16 rounding) or DIFFER, for a sub-block's diffs."""
    if not diffs:
        return EQUAL
    return DIFFER if any(d.kind == DIFFER for d in diffs) else ROUNDED


def model_wide_diffs(serve: WeightSource, train: WeightSource) -> Iterator[tuple[str, TensorDiff]]:
    """The embedding, the final norm and the output head, the tables window by window (never whole at once)."""
    for role in (R.EMBED, R.LM_HEAD):
        for start, stop in serve.row_windows(role):
            d = tensor_diff(serve.row_range(role, start, stop), train.row_range(role, start, stop), ("weight",))
            if d is not None:
                d.rows = [r + start for r in d.rows]
                yield role, d
    d = tensor_diff(serve.final_norm(), train.final_norm(), ("weight",))
    if d is not None:
        yield R.FINAL_NORM, d


# ---- names ----------------------------------------------------------------------------------------------------

def tensor_names(src: FieldSource, layer: int | None, d: TensorDiff, serve: Any, train: Any) -> dict[str, Any]:
    """The HF tensor(s) behind the differing rows (serve's plan) and the Megatron tensor(s) (train's plan)."""
    out: dict[str, Any] = {}
    if isinstance(serve, WeightSource) and serve.has(layer, src.role):
        out["hf"] = _side_names(serve.mapping(layer, src.role).hf, serve.mapping(layer, src.role), src, d, hf=True)
    if isinstance(train, WeightSource) and train.has(layer, src.role):
        out["megatron"] = _side_names(train.mapping(layer, src.role).mcore, train.mapping(layer, src.role), src, d,
                                      hf=False)
    return out


def _side_names(specs: tuple[TensorSpec, ...], mapping: Any, src: FieldSource, d: TensorDiff, hf: bool) -> list[str]:
    """Names of `specs` holding `d.rows` of the field, `name[rows]` where the field is part of a tensor."""
    if d.expert is not None:
        if hf:
            picks = mapping.rule.transform.hf_for_rows(range(d.expert, d.expert + 1), len(specs)) or []
            specs = tuple(specs[i] for i in picks)
        else:
            return [f"{specs[0].name}[expert {d.expert}]"]
    if src.part is not None:
        if hf and len(specs) > 1:
            return [specs[src.part].name]
        return [f"{specs[0].name}[{_half(src.part)} half]"]
    return _covering(specs, d.rows)


def _half(part: int) -> str:
    return ("first", "second")[part]


def _covering(specs: tuple[TensorSpec, ...], rows: list[int]) -> list[str]:
    """The specs whose rows (stacked along dim 0 in order, as the field concatenates them) hold `rows`."""
    out, start = [], 0
    for spec in specs:
        stop = start + (spec.shape[0] if spec.shape else 1)
        if not rows or any(start <= r < stop for r in rows):
            out.append(spec.name)
        start = stop
    return out or [s.name for s in specs]


def row_ranges(rows: list[int], most: int = 6) -> str:
    """"0-3, 17, 40-41" (at most `most` runs, then "... (N rows)")."""
    runs: list[list[int]] = []
    for r in sorted(rows):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:most])
    return text + (f", ... ({len(rows)} rows)" if len(runs) > most else "")

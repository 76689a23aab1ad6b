"""The NaN/Inf check reads bit patterns (the largest sign-cleared pattern against one table): it must say what
`torch.isfinite` says for every pattern of every dtype glmconv checks, in tensors and in copied bytes alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glmconv.io.byte_copy import Extent
from glmconv.io.finite import require_finite_extents
from glmconv.numerics import finite
from glmconv.numerics.finite import NonFiniteError, any_non_finite, require_finite

INTS = {1: torch.uint8, 2: torch.int16}


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """All 2^8 or 2^16 bit patterns of a one- or two-byte dtype."""
    size = torch.empty((), dtype=dtype).element_size()
    return torch.arange(2 ** (8 * size), dtype=torch.int64).to(INTS[size]).view(dtype)


def torch_says_bad(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return torch.isnan(t.float())
    return ~torch.isfinite(t.float() if t.element_size() < 4 else t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_every_bit_pattern_is_judged_as_torch_judges_it(dtype: torch.dtype) -> None:
    patterns = every_pattern(dtype)
    bad = torch_says_bad(patterns)
    assert int(bad.sum()) == {torch.bfloat16: 256, torch.float16: 2048, torch.float8_e4m3fn: 2}[dtype]
    for value, is_bad in zip(patterns, bad):
        assert any_non_finite(value.reshape(1)) == bool(is_bad)
    assert not any_non_finite(patterns[~bad])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), -float("nan")])
def test_a_wide_float_with_one_bad_value_is_caught(dtype: torch.dtype, value: float) -> None:
    t = torch.randn(1000, dtype=dtype)
    t[[0, -1]] = torch.finfo(dtype).max * torch.tensor([1.0, -1.0], dtype=dtype)
    assert not any_non_finite(t)
    t[417] = value
    assert any_non_finite(t)


def test_a_bad_value_in_the_last_window_of_a_long_tensor_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finite, "SCAN_ELEMENTS", 64)
    t = torch.randn(10, 100).to(torch.bfloat16)
    assert not any_non_finite(t)
    t[9, 99] = float("inf")
    assert any_non_finite(t)


def test_a_non_contiguous_view_is_checked_by_its_own_values() -> None:
    t = torch.randn(64, 64).to(torch.bfloat16)
    t[3, 5] = float("nan")
    assert any_non_finite(t.t()[5:, :])
    assert not any_non_finite(t.t()[6:, :])


def test_integer_and_empty_tensors_are_never_non_finite() -> None:
    assert not any_non_finite(torch.tensor([-1, 2**31 - 1], dtype=torch.int32))
    assert not any_non_finite(torch.empty(0, dtype=torch.bfloat16))


def test_require_finite_still_names_the_first_bad_value_and_counts_them() -> None:
    t = torch.zeros(300, 300, dtype=torch.bfloat16)
    t[200, 10] = float("-inf")
    t[250, 299] = float("nan")
    with pytest.raises(NonFiniteError, match=r"^w \(here\): 2 non-finite values \(NaN/Inf\), the first -inf in "
                                             r"block \[1, 0\] at index \[200, 10\]"):
        require_finite(t, "w", "here")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_the_byte_scan_counts_what_torch_counts_over_every_pattern(dtype: torch.dtype, tmp_path: Path) -> None:
    patterns = every_pattern(dtype)
    path = tmp_path / "data"
    path.write_bytes(b"\0" * 3 + patterns.view(torch.uint8).numpy().tobytes())
    bad = torch_says_bad(patterns)
    first = int(bad.nonzero()[0, 0])
    with pytest.raises(NonFiniteError, match=rf": {int(bad.sum()):,} non-finite values .* at index \[{first}\]"):
        require_finite_extents([Extent(path, 3, patterns.numel() * patterns.element_size())], dtype,
                               (patterns.numel(),), "w", "scan")
    good = patterns[~bad].contiguous()
    path.write_bytes(good.view(torch.uint8).numpy().tobytes())
    require_finite_extents([Extent(path, 0, good.numel() * good.element_size())], dtype, (good.numel(),), "w", "scan")

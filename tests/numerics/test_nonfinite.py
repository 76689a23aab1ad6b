"""Issue 25: NaN and Inf never pass silently where glmconv computes: FP8 NaN codes are refused at dequantisation
(convert), and a non-finite value in any weight `export --fp8` re-quantises is refused, naming the tensor and its
block (re-quantising would wipe that block: scale 1.0 or inf, every code 0)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers.bad_input import assert_refused, edit_tensor, invoke, weight_map
from helpers.fuzzing import fuzz
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def fp8_weights(src: Path) -> list[str]:
    return sorted(n[:-len("_scale_inv")] for n in weight_map(src) if n.endswith("_scale_inv"))


@given(data=st.data())
@fuzz(4)
def test_a_nan_code_in_any_fp8_weight_is_refused_by_convert(tiny_fp8_ckpt: Path,
                                                           tmp_path_factory: pytest.TempPathFactory,
                                                           data: st.DataObject) -> None:
    tmp = tmp_path_factory.mktemp("nan-code")
    src = tmp / "src"
    shutil.copytree(tiny_fp8_ckpt, src)
    name = data.draw(st.sampled_from(fp8_weights(src)), label="tensor")
    code = data.draw(st.sampled_from([0x7F, 0xFF]), label="code")
    picked: list[tuple[int, int]] = []

    def plant(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        r = data.draw(st.integers(0, t.shape[0] - 1), label="row")
        c = data.draw(st.integers(0, t.shape[1] - 1), label="col")
        t.view(torch.uint8)[r, c] = code
        picked.append((r, c))
        return t

    edit_tensor(src, name, plant)
    (r, c), = picked
    assert_refused(["convert", str(src), str(tmp / "out")], [src], tmp / "out",
                   rf"^error: {name} \(.*\): 1 non-finite value \(NaN/Inf\), the first FP8 code 0x{code:02X} in block "
                   rf"\[{r // 128}, {c // 128}\] at index \[{r}, {c}\]; glmconv refuses NaN/Inf weights$")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_export_fp8_refuses_a_non_finite_weight_instead_of_wiping_its_block(value: float, dtype: str,
                                                                           tiny_fp8_ckpt: Path,
                                                                           tmp_path: Path) -> None:
    """A FP8-eligible weight with one NaN/Inf in the torch_dist checkpoint (a trainer's divergence)."""
    from helpers.bad_input import set_mcore
    from helpers.mcore_helpers import rewrite_dcp as rewrite_torch_dist

    mc = tmp_path / "mc"
    assert invoke(["convert", str(tiny_fp8_ckpt), str(mc), "--dtype", {"BF16": "bf16", "F32": "fp32"}[dtype]]
                  ).exit_code == 0
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    rewrite_torch_dist(mc, tmp_path / "edited", set_mcore(name, value, (30, 130)))
    edited, hf = tmp_path / "edited", tmp_path / "hf"
    assert_refused(["export", str(edited), str(hf), "--fp8"], [edited], hf,
                   r"^error: decoder\.layers\.0\.mlp\.linear_fc2\.weight \(.*/edited/release\): "
                   rf"1 non-finite value \(NaN/Inf\), the first {value} in block \[0, 1\] at index \[30, 130\]")


@pytest.mark.parametrize("like", [False, True])
def test_export_fp8_refuses_a_non_finite_expert_by_its_megatron_name(like: bool, tiny_fp8_ckpt: Path,
                                                                     tmp_path: Path) -> None:
    """Experts are encoded a step of many at a time without the reader's scan: the refusal still names the Megatron
    tensor and the value's index in it, as that scan does."""
    from helpers.bad_input import EXPERTS_FC2, set_mcore
    from helpers.mcore_helpers import rewrite_dcp as rewrite_torch_dist

    mc, edited, hf = tmp_path / "mc", tmp_path / "edited", tmp_path / "hf"
    assert invoke(["convert", str(tiny_fp8_ckpt), str(mc)]).exit_code == 0
    rewrite_torch_dist(mc, edited, set_mcore(EXPERTS_FC2, float("inf"), (5, 3, 7)))
    assert_refused(["export", str(edited), str(hf), "--fp8", *(["--like", str(tiny_fp8_ckpt)] if like else [])],
                   [edited], hf, rf"^error: {re.escape(EXPERTS_FC2)} \(.*/edited/release\): 1 non-finite value "
                                 r"\(NaN/Inf\), the first inf in block \[5, 0, 0\] at index \[5, 3, 7\]; glmconv")


def test_export_fp8_refuses_a_nan_code_in_like_by_name(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    """A NaN code in --like is refused, naming the weight and --like (not the weight being exported)."""
    from helpers.bad_input import fp8_nan_code

    mc, like, hf = tmp_path / "mc", tmp_path / "like", tmp_path / "hf"
    assert invoke(["convert", str(tiny_fp8_ckpt), str(mc)]).exit_code == 0
    shutil.copytree(tiny_fp8_ckpt, like)
    name = fp8_weights(like)[0]
    edit_tensor(like, name, fp8_nan_code)
    assert_refused(["export", str(mc), str(hf), "--fp8", "--like", str(like)], [mc, like], hf,
                   rf"^error: {re.escape(name)} \(--like\): 1 non-finite value \(NaN/Inf\), the first FP8 code 0x7F in "
                   r"block \[0, 0\] at index \[2, 9\]; glmconv refuses NaN/Inf weights$")


def test_the_scan_of_copied_bytes_names_a_file_that_ends_too_soon(tmp_path: Path) -> None:
    """A source cut short after it was planned (another process rewrote it): one line naming it, no fault."""
    from glmconv.errors import CheckpointError
    from glmconv.io.byte_copy import Extent
    from glmconv.io.finite import require_finite_extents

    short = tmp_path / "shard.safetensors"
    short.write_bytes(bytes(1000))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(short))}: ends before byte 2048 \(truncated"):
        require_finite_extents([Extent(short, 1024, 1024)], torch.bfloat16, (512,), "w", "shard.safetensors")

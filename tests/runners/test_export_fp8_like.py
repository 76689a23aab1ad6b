"""`export --fp8 --like`: --like's own FP8 blocks are kept where they reproduce the weights, the rest re-quantised."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers.hf_helpers import raw_tensors

from glmconv.io.file_names import MANIFEST_NAME
from glmconv.io.torch_dist.metadata import inspect_torch_dist
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.numerics.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from glmconv.numerics.fp8_reuse import encode
from glmconv.rules import names
from glmconv.runners import convert as convert_mod
from glmconv.runners import export as export_mod
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FP8_WEIGHTS, FP8_BLOCKS = 95, 101  # the tiny fixture's FP8 set


def _export(mc: Path, out: Path, like: Path) -> dict[str, Any]:
    job = export_mod.prepare(mc, out, like=like, fp8=True)
    return export_mod.export(job, export_mod.ExportOptions(progress=False))


@pytest.fixture(scope="module")
def fp8_mc(tiny_fp8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp8like") / "mc"
    convert_mod.convert(convert_mod.prepare(tiny_fp8_ckpt, out), convert_mod.RunOptions(progress=False))
    return out


# ---- one weight ------------------------------------------------------------------------------------------

def _release_weight() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 300 x 200 weight (3 x 2 blocks, cropped edges) as the release stores it, and what convert makes of it."""
    torch.manual_seed(0)
    q, s = quantize_fp8_blocks(torch.randn(300, 200) * 0.02)
    return q, s, dequantize_fp8_blocks(q, s)


def test_an_unchanged_weight_keeps_like_codes_and_scales() -> None:
    q, s, w = _release_weight()
    got = encode(w, (q, s))
    assert (got.requantized, torch.equal(got.codes.view(torch.uint8), q.view(torch.uint8)),
            torch.equal(got.scales, s)) == (0, True, True)


def test_one_changed_value_requantises_exactly_its_block() -> None:
    q, s, w = _release_weight()
    w[130, 150] = -w[130, 150] * 2  # block [1, 1]
    got = encode(w, (q, s))
    changed_codes = (got.codes.view(torch.uint8) != q.view(torch.uint8)).nonzero()
    assert got.requantized == 1
    assert (got.scales != s).nonzero().tolist() == [[1, 1]]
    assert {(r // 128, c // 128) for r, c in changed_codes.tolist()} == {(1, 1)}


def test_a_like_scale_convert_would_refuse_is_never_reused() -> None:
    q, s, w = _release_weight()
    zero = torch.zeros_like(w)
    zero[:128, :128] = 0  # block [0, 0] of `zero` is all zeros: q * 0 reproduces it, but scale 0 is invalid
    bad_s = s.clone()
    bad_s[0, 0] = 0.0
    got = encode(zero, (q, bad_s))
    assert got.requantized == 6 and bool((got.scales > 0).all())


def test_without_like_every_block_is_requantised() -> None:
    _, _, w = _release_weight()
    assert encode(w, None).requantized == 6


# ---- the whole checkpoint ------------------------------------------------------------------------------

def test_untouched_fp8_checkpoint_round_trips_byte_identical(tiny_fp8_ckpt: Path, fp8_mc: Path,
                                                             tmp_path: Path) -> None:
    summary = _export(fp8_mc, tmp_path / "hf2", tiny_fp8_ckpt)
    src, got = raw_tensors(tiny_fp8_ckpt), raw_tensors(tmp_path / "hf2")
    assert sorted(got) == sorted(src)
    assert [n for n in src if got[n] != src[n]] == []  # dtype, shape and bytes: codes, scales and the rest
    fp8 = summary["fp8_requantized"]
    assert (fp8["tensors"], fp8["blocks"], fp8["requantized_tensors"], fp8["requantized_blocks"]) == (
        FP8_WEIGHTS, FP8_BLOCKS, 0, 0)
    manifest = json.loads((tmp_path / "hf2" / MANIFEST_NAME).read_text())
    assert manifest["fp8_requantized"] == fp8


def _bump_one_expert_value(mc: Path) -> str:
    """Move the first value of the first routed expert's down projection up by one bf16 step, in the .distcp
    file itself; returns the Megatron tensor's name."""
    name = next(n for n in sorted(inspect_torch_dist(mc).tensors) if "experts" in n and "linear_fc2" in n)
    (extent,) = DcpReader(mc).byte_extents(name, 0, 2) or [None]
    with open(extent.path, "r+b") as f:
        f.seek(extent.offset)
        bits = int.from_bytes(f.read(2), "little") + 1
        f.seek(extent.offset)
        f.write(bits.to_bytes(2, "little"))
    return name


def test_one_changed_expert_value_requantises_one_block(tiny_fp8_ckpt: Path, fp8_mc: Path, tmp_path: Path) -> None:
    mc = tmp_path / "mc"
    shutil.copytree(fp8_mc, mc)
    _bump_one_expert_value(mc)
    summary = _export(mc, tmp_path / "hf2", tiny_fp8_ckpt)
    src, got = raw_tensors(tiny_fp8_ckpt), raw_tensors(tmp_path / "hf2")
    differ = {n for n in src if got[n] != src[n]}
    touched = [n for n in src if src[n][0] == "F8_E4M3" and {n, names.scale_name(n)} & differ]
    assert len(touched) == 1 and differ <= {touched[0], names.scale_name(touched[0])}  # one weight
    fp8 = summary["fp8_requantized"]
    assert (fp8["requantized_tensors"], fp8["requantized_blocks"]) == (1, 1)
    scales = [_f32(t[names.scale_name(touched[0])]) for t in (src, got)]
    codes = [torch.frombuffer(bytearray(t[touched[0]][2]), dtype=torch.uint8) for t in (src, got)]
    assert int((scales[0] != scales[1]).sum()) <= 1  # that block alone; a changed value may keep its codes
    assert codes[0].numel() == codes[1].numel()


def _f32(entry: tuple[str, tuple[int, ...], bytes]) -> torch.Tensor:
    dtype, shape, data = entry
    assert dtype == "F32"
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)


def test_like_from_another_seed_requantises_everything(fp8_mc: Path, tmp_path: Path) -> None:
    from glmconv.fixtures import make_fixture

    other = make_fixture(tmp_path / "seed1", "tiny", fp8=True, seed=1)
    fp8 = _export(fp8_mc, tmp_path / "hf2", other)["fp8_requantized"]
    assert (fp8["requantized_tensors"], fp8["requantized_blocks"]) == (FP8_WEIGHTS, FP8_BLOCKS)


def test_cli_says_how_many_blocks_were_requantised(tiny_fp8_ckpt: Path, fp8_mc: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["export", str(fp8_mc), str(tmp_path / "hf2"), "--fp8", "--like",
                                   str(tiny_fp8_ckpt)])
    assert res.exit_code == 0, res.output
    assert (f"fp8: {FP8_WEIGHTS} weights, {FP8_BLOCKS} blocks: 0 blocks re-quantised (in 0 weights), "
            f"{FP8_BLOCKS} blocks kept as --like stores them;") in res.stdout

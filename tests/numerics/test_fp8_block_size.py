"""An FP8 config whose `quantization_config.weight_block_size` lies about the scales is refused (issue 39, item 4).

A loader maps each `_scale_inv` element onto the weight by the config's block size; glmconv reads and writes
128x128 blocks. A block size that disagrees with a scale's shape (ceil(rows/block) x ceil(cols/block)), one that
is no block size at all (zeros, negatives, floats, bools, a string, null, a length other than 2) and none at all
beside FP8 weights would each publish, or accept, a checkpoint dequantised wrongly. Every command that reads or
writes an FP8 config refuses them with one `error:` line naming the config file and the key (and, for a lie, a
scale with the block size expected and found), exit 2, inputs untouched, nothing published (`assert_refused`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from helpers.bad_input import DOWN0, assert_refused

from glmconv.errors import ConfigError
from glmconv.io.file_names import CONFIG_NAME
from glmconv.numerics.fp8 import check_block_size
from glmconv.runners import convert as convert_mod
from glmconv.runners import export as export_mod

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KEY = "quantization_config.weight_block_size"
SCALE = DOWN0 + "_scale_inv"  # F32 [1, 2] of an FP8 [64, 160] weight: the first scale by name
ABSENT = object()

# (value written to the config, what the line says after `KEY`)
LIES = {
    "64x64": ([64, 64], rf": expected \[128, 128\], found \[64, 64\]; {re.escape(SCALE)} holds \[1, 2\] block "
                        r"scales of a \[64, 160\] FP8 weight \(128x128 blocks; \[64, 64\] blocks would need "
                        r"\[1, 3\]\)"),
    "256x256": ([256, 256], rf": expected \[128, 128\], found \[256, 256\]; {re.escape(SCALE)} holds \[1, 2\] block "
                            r"scales of a \[64, 160\] FP8 weight \(128x128 blocks; \[256, 256\] blocks would need "
                            r"\[1, 1\]\)"),
    "128x64": ([128, 64], rf": expected \[128, 128\], found \[128, 64\]; {re.escape(SCALE)} holds \[1, 2\] block "
                          r"scales of a \[64, 160\] FP8 weight \(128x128 blocks; \[128, 64\] blocks would need "
                          r"\[1, 3\]\)"),
    "absent": (ABSENT, rf": expected \[128, 128\], found absent; {re.escape(SCALE)} holds \[1, 2\] block scales of a "
                       r"\[64, 160\] FP8 weight \(128x128 blocks\)"),
}
MALFORMED = {
    "zeros": ([0, 0], r"\[0, 0\]"),
    "negative": ([-128, 128], r"\[-128, 128\]"),
    "floats": ([128.0, 128.0], r"\[128\.0, 128\.0\]"),
    "bools": ([True, True], r"\[true, true\]"),
    "one-item": ([128], r"\[128\]"),
    "three-items": ([128, 128, 128], r"\[128, 128, 128\]"),
    "string": ("128", r"'128' \(a string\)"),
    "null": (None, "null"),
    "absurd": ([1 << 40, 128], r"\[1099511627776, 128\]"),
}
MALFORMED_LINE = (" must be a list of 2 positive integers up to 16777216 (the rows and columns of one scale block, "
                  "[128, 128] in the release), got ")
CASES = [*LIES, *MALFORMED]


def _line(case: str) -> str:
    """The error line after `CONFIG_FILE: `."""
    if case in LIES:
        return re.escape(KEY) + LIES[case][1]
    return re.escape(KEY + MALFORMED_LINE) + MALFORMED[case][1]


def _set_block(config_dir: Path, case: str) -> None:
    value = LIES[case][0] if case in LIES else MALFORMED[case][0]
    cfg = json.loads((config_dir / CONFIG_NAME).read_text())
    q = cfg["quantization_config"]
    if value is ABSENT:
        del q["weight_block_size"]
    else:
        q["weight_block_size"] = value
    (config_dir / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))


def _lying_copy(src: Path, dst: Path, case: str) -> Path:
    shutil.copytree(src, dst)
    _set_block(dst, case)
    return dst


@pytest.fixture(scope="module")
def fp8_mc(tiny_fp8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FP8 tiny fixture converted: its config.json is the HF one, quantization_config and all."""
    out = tmp_path_factory.mktemp("block-size") / "mc"
    convert_mod.convert(convert_mod.prepare(tiny_fp8_ckpt, out), convert_mod.RunOptions(progress=False))
    return out


@pytest.fixture(scope="module")
def fp8_export(fp8_mc: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("block-size-export") / "hf"
    export_mod.export(export_mod.prepare(fp8_mc, out, fp8=True), export_mod.ExportOptions(progress=False))
    return out


def _refused(args: list[str], inputs: list[Path], out: Path, config_dir: Path, case: str, tail: str = "") -> None:
    assert_refused(args, inputs, out,
                   "^error: " + re.escape(f"{config_dir / CONFIG_NAME}: ") + _line(case) + re.escape(tail) + "$")


@pytest.mark.parametrize("case", CASES)
def test_convert_refuses(case: str, tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    src = _lying_copy(tiny_fp8_ckpt, tmp_path / "src", case)
    _refused(["convert", str(src), str(tmp_path / "out")], [src], tmp_path / "out", src, case)


@pytest.mark.parametrize("case", CASES)
def test_audit_names_refuses(case: str, tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    """Exit 2, not the findings table's 1: the config is no config of these tensors."""
    src = _lying_copy(tiny_fp8_ckpt, tmp_path / "src", case)
    _refused(["audit-names", str(src)], [src], tmp_path / "none", src, case)


@pytest.mark.parametrize("case", CASES)
def test_audit_names_of_an_export_refuses(case: str, fp8_export: Path, tmp_path: Path) -> None:
    """An export whose config was edited (or that an older glmconv published from a lying config)."""
    hf = _lying_copy(fp8_export, tmp_path / "hf", case)
    _refused(["audit-names", str(hf)], [hf], tmp_path / "none", hf, case)


@pytest.mark.parametrize("case", CASES)
def test_export_fp8_refuses_a_lying_torch_dist_config(case: str, fp8_mc: Path, tmp_path: Path) -> None:
    """The config convert left in MCORE_DIR is the one export --fp8 publishes: its block size must be the one
    export writes."""
    mc = _lying_copy(fp8_mc, tmp_path / "mc", case)
    tail = "; export --fp8 writes 128x128 blocks" if case in LIES else ""  # whatever the config says
    _refused(["export", str(mc), str(tmp_path / "out"), "--fp8"], [mc], tmp_path / "out", mc, case, tail)


@pytest.mark.parametrize("case", CASES)
def test_export_fp8_like_refuses_a_lying_like_config(case: str, fp8_mc: Path, tiny_fp8_ckpt: Path,
                                                    tmp_path: Path) -> None:
    like = _lying_copy(tiny_fp8_ckpt, tmp_path / "like", case)
    _refused(["export", str(fp8_mc), str(tmp_path / "out"), "--fp8", "--like", str(like)], [fp8_mc, like],
             tmp_path / "out", like, case)


@pytest.mark.parametrize("case", ["64x64", "absent"])
def test_export_fp8_like_refuses_a_bf16_like_whose_config_would_be_published(case: str, fp8_mc: Path,
                                                                            tiny_ckpt: Path, tmp_path: Path) -> None:
    """A BF16 --like has no scales to contradict its fp8 quantization_config; the scales export writes do."""
    like = tmp_path / "like"
    shutil.copytree(tiny_ckpt, like)
    cfg = json.loads((like / CONFIG_NAME).read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (like / CONFIG_NAME).write_text(json.dumps(cfg))
    _set_block(like, case)
    _refused(["export", str(fp8_mc), str(tmp_path / "out"), "--fp8", "--like", str(like)], [fp8_mc, like],
             tmp_path / "out", like, case, "; export --fp8 writes 128x128 blocks")


@pytest.mark.parametrize("case", CASES)
def test_verify_refuses(case: str, tiny_fp8_ckpt: Path, fp8_mc: Path, tmp_path: Path) -> None:
    src = _lying_copy(tiny_fp8_ckpt, tmp_path / "src", case)
    _refused(["verify", str(src), str(fp8_mc)], [src, fp8_mc], tmp_path / "none", src, case)


@pytest.mark.parametrize("case", CASES)
def test_parity_refuses(case: str, tiny_fp8_ckpt: Path, fp8_mc: Path, tmp_path: Path) -> None:
    """parity dequantises the FP8 weights by the scales: a config saying otherwise is refused before."""
    src = _lying_copy(tiny_fp8_ckpt, tmp_path / "src", case)
    _refused(["parity", str(src), str(fp8_mc), "--tokens", "8"], [src, fp8_mc], tmp_path / "none", src, case)


def test_plain_export_drops_the_quantization_config_it_does_not_use(fp8_mc: Path, tmp_path: Path) -> None:
    """A BF16 export publishes no quantization_config: a lie in MCORE_DIR's is not carried anywhere."""
    from helpers.bad_input import invoke

    mc = _lying_copy(fp8_mc, tmp_path / "mc", "64x64")
    got = invoke(["export", str(mc), str(tmp_path / "out")])
    assert got.exit_code == 0, got.stderr
    assert "quantization_config" not in json.loads((tmp_path / "out" / CONFIG_NAME).read_text())


# ---- the rule itself -----------------------------------------------------------------------------------------

def _config(block: object = ABSENT, method: str = "fp8") -> dict[str, object]:
    q: dict[str, object] = {"quant_method": method}
    if block is not ABSENT:
        q["weight_block_size"] = block
    return {"quantization_config": q}


@pytest.mark.parametrize(("block", "weight", "scale"), [
    ([128, 128], (300, 200), (3, 2)),
    ([256, 256], (100, 120), (1, 1)),  # one block either way: a loader reads the same values
    ([128, 256], (64, 64), (1, 1)),
    ([128, 128], (300, 200), (5, 5)),  # fits no block size: the plan's scale-shape check names it
])
def test_block_sizes_that_describe_the_scales_are_accepted(block: list[int], weight: tuple[int, int],
                                                           scale: tuple[int, int]) -> None:
    check_block_size(_config(block), [("w_scale_inv", scale, weight)])


def test_no_fp8_weights_no_block_size_needed() -> None:
    check_block_size(_config(), [])
    check_block_size({}, [("w_scale_inv", (1, 1), (10, 10))])  # no quantization_config: the audit's finding
    check_block_size(_config(method="other"), [("w_scale_inv", (1, 1), (10, 10))])


def test_the_first_lying_scale_by_name_is_named() -> None:
    scales: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = [
        ("b_scale_inv", (2, 2), (256, 256)), ("a_scale_inv", (1, 1), (64, 64)), ("c_scale_inv", (3, 1), (300, 10))]
    with pytest.raises(ConfigError, match=r"found \[64, 64\]; b_scale_inv holds \[2, 2\] block scales of a "
                                          r"\[256, 256\] FP8 weight \(128x128 blocks; \[64, 64\] blocks would need "
                                          r"\[4, 4\]\)$"):
        check_block_size(_config([64, 64]), scales)


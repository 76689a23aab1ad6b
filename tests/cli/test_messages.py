"""One wording per mistake, naming what was found and the command the user most likely meant (glmconv/mistakes.py).

Each refusal is one `error:` line and exit 2; no hint names an option the command does not have.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.hf_helpers import save_with_transformers

import glmconv
from glmconv.io.file_names import CONFIG_NAME
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def tiny_mc(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(glmconv.convert(tiny_ckpt, tmp_path_factory.mktemp("messages") / "mc")["published"])


@pytest.fixture(scope="module")
def no_config_mc(tiny_mc: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    bare = tmp_path_factory.mktemp("messages") / "bare"
    shutil.copytree(tiny_mc, bare)
    (bare / CONFIG_NAME).unlink()
    return bare


def _error(*args: object) -> str:
    res = CliRunner().invoke(cli, [str(a) for a in args])
    assert res.exit_code == 2, res.output
    return res.stderr.strip()


def test_convert_given_a_torch_dist_checkpoint_names_export(tiny_mc: Path, tmp_path: Path) -> None:
    assert _error("convert", tiny_mc, tmp_path / "out") == (
        f"error: {tiny_mc}: this is a torch_dist checkpoint, but convert takes an HF checkpoint as HF_DIR; did you "
        f"mean `glmconv export {tiny_mc} OUT_DIR`?")


def test_export_given_an_hf_checkpoint_names_convert(tiny_ckpt: Path, tmp_path: Path) -> None:
    assert _error("export", tiny_ckpt, tmp_path / "out") == (
        f"error: {tiny_ckpt}: this is an HF checkpoint, but export takes a torch_dist checkpoint as MCORE_DIR; did "
        f"you mean `glmconv convert {tiny_ckpt} OUT_DIR`?")


@pytest.mark.parametrize("command", ["verify", "parity"])
def test_swapped_arguments_name_the_command_the_right_way_round(command: str, tiny_ckpt: Path,
                                                                 tiny_mc: Path) -> None:
    assert _error(command, tiny_mc, tiny_ckpt) == (
        f"error: {tiny_mc}: this is a torch_dist checkpoint, but {command} takes an HF checkpoint as HF_DIR; did "
        f"you mean `glmconv {command} {tiny_ckpt} {tiny_mc}`?")


@pytest.mark.parametrize("command", ["verify", "parity"])
def test_an_hf_checkpoint_as_mcore_dir_names_convert(command: str, tiny_ckpt: Path) -> None:
    assert _error(command, tiny_ckpt, tiny_ckpt) == (
        f"error: {tiny_ckpt}: this is an HF checkpoint, but {command} takes a torch_dist checkpoint as MCORE_DIR; "
        f"did you mean `glmconv convert {tiny_ckpt} OUT_DIR`?")


@pytest.mark.parametrize("command", ["verify", "parity"])
def test_a_conversion_of_another_model_is_named_with_its_differences(command: str, cut8_ckpt: Path,
                                                                     tiny_mc: Path) -> None:
    assert _error(command, cut8_ckpt, tiny_mc) == (
        f"error: {tiny_mc} is not a conversion of {cut8_ckpt}: another model (first_k_dense_replace: 2 in {tiny_mc}, "
        f"3 in {cut8_ckpt}; num_hidden_layers: 4 in {tiny_mc}, 8 in {cut8_ckpt}; 4 other keys)")


@pytest.mark.parametrize("command", ["parity", "relayout"])
def test_a_missing_config_names_no_option_the_command_lacks(command: str, tiny_ckpt: Path, no_config_mc: Path,
                                                            tmp_path: Path) -> None:
    args = [tiny_ckpt, no_config_mc] if command == "parity" else [no_config_mc, tmp_path / "out", "--to", "mcore"]
    assert _error(command, *args) == (
        f"error: {no_config_mc}: torch_dist checkpoint has no config.json next to it (convert writes one there): "
        f"copy the model's config.json into {no_config_mc}")


def test_a_missing_config_offers_export_its_config_option(no_config_mc: Path, tmp_path: Path) -> None:
    assert _error("export", no_config_mc, tmp_path / "out").endswith(
        f"copy the model's config.json into {no_config_mc}, or pass --config CONFIG")


@pytest.fixture(scope="module")
def f32_and_bf16_conversion(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """transformers' own F32 save of tiny, converted with --dtype bf16."""
    root = tmp_path_factory.mktemp("rounded")
    f32 = save_with_transformers(tiny_ckpt, root / "f32", "float32")
    return f32, Path(glmconv.convert(f32, root / "mc", dtype="bf16")["published"])


def test_verify_counts_the_f32_tensors_a_bf16_conversion_rounded(f32_and_bf16_conversion: tuple[Path, Path]) -> None:
    f32, mc = f32_and_bf16_conversion
    summary = glmconv.verify(f32, mc)
    assert (summary["equal"], summary["rounded_f32_to_bf16"], summary["widened_bf16_to_f32"]) == (True, 164, 0)


def test_verify_says_equal_after_rounding_not_bit_for_bit(f32_and_bf16_conversion: tuple[Path, Path]) -> None:
    f32, mc = f32_and_bf16_conversion
    res = CliRunner().invoke(cli, ["verify", str(f32), str(mc)])
    assert res.exit_code == 0
    assert " ".join(res.stdout.split()).startswith(
        "verify: equal after rounding 164 HF tensors stored F32 to the BF16 that MCORE_DIR holds (convert --dtype "
        "bf16), every other value bit for bit: ")


def test_verify_of_a_keep_conversion_rounds_nothing(tiny_ckpt: Path, tiny_mc: Path) -> None:
    summary = glmconv.verify(tiny_ckpt, tiny_mc)
    assert (summary["equal"], summary["rounded_f32_to_bf16"]) == (True, 0)
    assert json.loads(json.dumps(summary)) == summary

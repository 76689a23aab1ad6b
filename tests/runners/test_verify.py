"""`glmconv verify HF MCORE`: every value through the mapping, bit for bit; one value changed on either side is named
(exit 1); a checkpoint of another model is refused (exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.mcore_helpers import rewrite_dcp as _rewrite

import glmconv
from glmconv.io.safetensors.checkpoint import inspect_hf_checkpoint, shard_path
from glmconv.io.safetensors.header import read_header
from glmconv.plan import Mapping, build_plan
from glmconv.rules import roles as R
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tiny_fp8_ckpt: Path, cut8_ckpt: Path,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("verify")
    pairs = {"tiny": tiny_ckpt, "tiny-fp8": tiny_fp8_ckpt, "cut8": cut8_ckpt}
    for name, hf in pairs.items():
        glmconv.convert(hf, root / name)
    return {name: (hf, root / name) for name, hf in pairs.items()}


def _mapping(hf: Path, role: str) -> Mapping:
    plan = build_plan(glmconv.load_config(hf))
    return next(m for m in plan.mappings if m.rule.role == role)


def _nudge_hf(src: Path, dst: Path, name: str, index: int) -> None:
    """A copy of `src` whose tensor `name` has its `index`-th value changed (the low byte of the element)."""
    shutil.copytree(src, dst)
    _nudge_in_place(dst, name, index)


def _nudge_in_place(dst: Path, name: str, index: int) -> None:
    entry = inspect_hf_checkpoint(dst).tensors[name]
    path = shard_path(dst, entry.file)
    header = read_header(path)
    e = header.entries[name]
    size = (e.end - e.begin) // max(1, int(torch.tensor(e.shape).prod()))
    data = bytearray(path.read_bytes())
    data[header.data_start + e.begin + index * size] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fixture", ["tiny", "tiny-fp8", "cut8"])
def test_a_converted_checkpoint_is_equal_bit_for_bit(converted: dict[str, tuple[Path, Path]], fixture: str) -> None:
    hf, mc = converted[fixture]
    s = glmconv.verify(hf, mc)
    assert s["equal"] and s["mismatches"] == 0 and s["first_mismatch"] is None
    assert s["mcore_tensors"] == len(build_plan(glmconv.load_config(hf)).mcore_index)
    assert s["fp8_source"] == (fixture == "tiny-fp8")


def test_one_hf_value_changed_names_the_expert_on_both_sides(converted: dict[str, tuple[Path, Path]],
                                                             tmp_path: Path) -> None:
    hf, mc = converted["tiny"]
    m = _mapping(hf, R.MOE_EXPERTS_FC1)
    up3 = m.hf[len(m.hf) // 2 + 3]  # expert 3's up_proj (gates first, then ups)
    _nudge_hf(hf, tmp_path / "hf", up3.name, index=5)
    res = CliRunner().invoke(cli, ["verify", str(tmp_path / "hf"), str(mc), "--json"])
    assert res.exit_code == 1, res.output
    s = json.loads(res.output)
    assert s["mismatches"] == 1 and s["first_mismatch"] == s["worst_mismatch"]
    first = s["first_mismatch"]
    assert first["hf"] == [up3.name] and first["mcore"] == [m.mcore[0].name] and first["values"] == 1
    assert first["rows"][0] <= 3 < first["rows"][1] and first["max_abs_diff"] > 0


def test_one_fp8_code_changed_is_found_after_dequantisation(converted: dict[str, tuple[Path, Path]],
                                                            tmp_path: Path) -> None:
    hf, mc = converted["tiny-fp8"]
    m = _mapping(hf, R.DENSE_FC2)
    _nudge_hf(hf, tmp_path / "hf", m.hf[0].name, index=0)
    s = glmconv.verify(tmp_path / "hf", mc)
    assert not s["equal"] and s["first_mismatch"]["hf"] == [m.hf[0].name]
    assert s["first_mismatch"]["mcore"] == [m.mcore[0].name]


def test_one_megatron_value_changed_is_named_in_the_table(converted: dict[str, tuple[Path, Path]],
                                                          tmp_path: Path) -> None:
    hf, mc = converted["tiny"]
    m = _mapping(hf, R.DENSE_FC1)
    gate_rows = m.hf[0].shape[0]

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fc1 = tensors[m.mcore[0].name]
        fc1[gate_rows, 0] += 1.0  # the first value of the up half
        return tensors

    _rewrite(mc, tmp_path / "mc", edit)
    res = CliRunner().invoke(cli, ["verify", str(hf), str(tmp_path / "mc")], env={"COLUMNS": "400"})  # no folding
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert m.hf[1].name in text and m.mcore[0].name in text and m.hf[0].name not in text
    assert "verify: 1 mismatch:" in text


def test_stored_args_of_another_model_are_refused(converted: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    from glmconv.megatron_args import build_common_state

    hf, mc = converted["tiny"]
    shutil.copytree(mc, tmp_path / "mc")
    torch.save(build_common_state(glmconv.load_config(hf), num_experts=7), tmp_path / "mc" / "release" / "common.pt")
    res = CliRunner().invoke(cli, ["verify", str(hf), str(tmp_path / "mc")])
    assert res.exit_code == 2
    assert "the stored Megatron args say 7 routed experts (num_experts) but the config says 8" in res.output


def test_a_checkpoint_of_another_model_is_refused(converted: dict[str, tuple[Path, Path]]) -> None:
    res = CliRunner().invoke(cli, ["verify", str(converted["cut8"][0]), str(converted["tiny"][1])])
    assert res.exit_code == 2 and res.output.startswith("error: ")


def test_the_findings_are_the_same_whatever_the_workers_and_threads(converted: dict[str, tuple[Path, Path]],
                                                                   tmp_path: Path) -> None:
    hf, mc = converted["tiny-fp8"]
    shutil.copytree(hf, tmp_path / "hf")
    experts, dense, embed = (_mapping(hf, r) for r in (R.MOE_EXPERTS_FC1, R.DENSE_FC2, R.EMBED))
    for name, index in ((experts.hf[-1].name, 7), (dense.hf[0].name, 0), (embed.hf[0].name, 3)):
        _nudge_in_place(tmp_path / "hf", name, index)
    runs = {(w, t): glmconv.verify(tmp_path / "hf", mc, workers=w, read_threads=t) for w, t in
            ((1, 0), (1, 1), (1, 4), (2, 2))}
    for s in runs.values():
        for timing in ("elapsed_s", "phases", "workers", "workers_requested"):
            s.pop(timing)
    serial = runs[(1, 0)]
    assert [s for s in runs.values() if s != serial] == []
    assert serial["mismatches"] == 3 and serial["first_mismatch"]["hf"] == [embed.hf[0].name]
    assert [m["hf"] for m in serial["listed"]] == [[embed.hf[0].name], [dense.hf[0].name], [experts.hf[-1].name]]


def test_the_cli_takes_workers_read_threads_and_device(converted: dict[str, tuple[Path, Path]]) -> None:
    hf, mc = converted["tiny"]
    res = CliRunner().invoke(cli, ["verify", str(hf), str(mc), "--workers", "1", "--read-threads", "3", "--device",
                                   "cpu", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["equal"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without a GPU")
def test_device_cuda_without_a_gpu_is_one_error_line(converted: dict[str, tuple[Path, Path]]) -> None:
    hf, mc = converted["tiny-fp8"]
    res = CliRunner().invoke(cli, ["verify", str(hf), str(mc), "--device", "cuda"])
    assert res.exit_code == 2
    assert res.stderr == ("error: --device cuda: no CUDA device is visible (torch.cuda.is_available() is False); "
                          "use --device cpu or auto\n")


@pytest.mark.parametrize(("workers", "threads"), [(1, 0), (1, 2), (2, 2)])
def test_a_nan_code_in_an_fp8_weight_is_refused_whatever_the_workers_and_threads(
        converted: dict[str, tuple[Path, Path]], tmp_path: Path, workers: int, threads: int) -> None:
    """Issue 25's refusal at dequantisation holds on verify's read-ahead path: one error line naming the tensor."""
    from helpers.bad_input import edit_tensor

    hf, mc = converted["tiny-fp8"]
    shutil.copytree(hf, tmp_path / "hf")
    name = _mapping(hf, R.DENSE_FC2).hf[0].name

    def plant(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(torch.uint8)[1, 2] = 0x7F
        return t

    edit_tensor(tmp_path / "hf", name, plant)
    res = CliRunner().invoke(cli, ["verify", str(tmp_path / "hf"), str(mc), "--workers", str(workers),
                                   "--read-threads", str(threads)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith(
        f"error: {name} (") and "1 non-finite value (NaN/Inf), the first FP8 code 0x7F in block [0, 0] at index " \
        "[1, 2]; glmconv refuses NaN/Inf weights" in res.stderr, res.stderr

"""Sizes come from the bytes a checkpoint stores, whatever its dtypes: an F32 save is announced at F32 size, and
the estimated time and `--workers auto` read the same figure."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_helpers import raw_tensors, save_with_transformers

import glmconv

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def tiny_f32(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_with_transformers(tiny_ckpt, tmp_path_factory.mktemp("f32") / "hf", "float32")


def _stored_bytes(ckpt: Path) -> int:
    return sum(len(data) for _, _, data in raw_tensors(ckpt).values())


def test_an_f32_input_is_announced_at_its_stored_size(tiny_f32: Path, tmp_path: Path) -> None:
    plan = glmconv.convert(tiny_f32, tmp_path / "mc", dry_run=True)
    assert plan["bytes_in"] == _stored_bytes(tiny_f32)
    assert plan["workers"][0]["bytes_in"] == plan["bytes_in"]


def test_the_estimated_time_reads_the_stored_size(tiny_f32: Path, tmp_path: Path) -> None:
    plan = glmconv.convert(tiny_f32, tmp_path / "mc", dry_run=True)
    assert plan["estimate_s"] == round(_stored_bytes(tiny_f32) / plan["throughput_bytes_per_s"], 1)


def test_a_bf16_input_is_announced_at_its_stored_size(tiny_ckpt: Path, tmp_path: Path) -> None:
    assert glmconv.convert(tiny_ckpt, tmp_path / "mc", dry_run=True)["bytes_in"] == _stored_bytes(tiny_ckpt)

"""`export --like`: the shards are --like's own files (names, which tensor in which, their order, headers and
index), so an unchanged round trip gives every file of the source back byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from glmconv.io.file_names import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, SINGLE_NAME
from glmconv.io.safetensors.header import read_header
from glmconv.rules import names
from glmconv.runners import convert as convert_mod
from glmconv.runners import export as export_mod
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _convert(src: Path, out: Path) -> Path:
    convert_mod.convert(convert_mod.prepare(src, out), convert_mod.RunOptions(progress=False))
    return out


def _export(mc: Path, out: Path, like: Path, *, fp8: bool, workers: int = 1, **kw: Any) -> dict[str, Any]:
    job = export_mod.prepare(mc, out, like=like, fp8=fp8, **kw)
    return export_mod.export(job, export_mod.ExportOptions(workers=workers, progress=False))


def _files(d: Path) -> dict[str, bytes]:
    """Every file but glmconv's own manifest (the source's describes the fixture, the export's the export)."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != MANIFEST_NAME}


def _data_order(shard: Path) -> list[str]:
    return [e.name for e in sorted(read_header(shard).entries.values(), key=lambda e: e.begin)]


@pytest.fixture(scope="module")
def fp8_mc(tiny_fp8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _convert(tiny_fp8_ckpt, tmp_path_factory.mktemp("likefiles") / "mc")


@pytest.fixture(scope="module")
def bf16_mc(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _convert(tiny_ckpt, tmp_path_factory.mktemp("likefiles") / "mc")


def test_fp8_multi_shard_release_round_trips_file_for_file(tiny_fp8_ckpt: Path, fp8_mc: Path, tmp_path: Path) -> None:
    summary = _export(fp8_mc, tmp_path / "hf", tiny_fp8_ckpt, fp8=True)
    src = _files(tiny_fp8_ckpt)
    assert len([n for n in src if n.startswith("model-")]) == summary["shards"] == 4
    assert _files(tmp_path / "hf") == src  # shards, index, config, generation config: byte for byte
    assert (summary["shards_from"], summary["like_files_unfit"]) == ("--like", None)


def test_bf16_multi_shard_source_round_trips_file_for_file(tiny_ckpt: Path, bf16_mc: Path, tmp_path: Path) -> None:
    _export(bf16_mc, tmp_path / "hf", tiny_ckpt, fp8=False)
    assert _files(tmp_path / "hf") == _files(tiny_ckpt)


def test_two_workers_write_the_files_one_worker_writes(tiny_fp8_ckpt: Path, fp8_mc: Path, tmp_path: Path) -> None:
    _export(fp8_mc, tmp_path / "hf", tiny_fp8_ckpt, fp8=True, workers=2)
    assert _files(tmp_path / "hf") == _files(tiny_fp8_ckpt)


@pytest.fixture(scope="module")
def single_file(tiny_fp8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FP8 release as one `model.safetensors` (no index), as safetensors writes it."""
    out = tmp_path_factory.mktemp("likefiles") / "single"
    out.mkdir()
    tensors = {}
    for shard in sorted(tiny_fp8_ckpt.glob("model-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    save_file(tensors, str(out / SINGLE_NAME), metadata={"format": "pt"})
    for name in (CONFIG_NAME, "generation_config.json"):
        shutil.copyfile(tiny_fp8_ckpt / name, out / name)
    return out


def test_single_model_safetensors_round_trips_as_one_file(single_file: Path, tmp_path: Path) -> None:
    mc = _convert(single_file, tmp_path / "mc")
    summary = _export(mc, tmp_path / "hf", single_file, fp8=True)
    assert summary["shards"] == 1
    assert _files(tmp_path / "hf") == _files(single_file)
    assert not (tmp_path / "hf" / INDEX_NAME).exists()


def test_max_shard_size_cuts_by_size_even_with_like(tiny_fp8_ckpt: Path, fp8_mc: Path, tmp_path: Path) -> None:
    summary = _export(fp8_mc, tmp_path / "hf", tiny_fp8_ckpt, fp8=True, max_shard_bytes=10**9)
    assert (summary["shards"], summary["shards_from"], summary["max_shard_bytes"]) == (1, "max_shard_bytes", 10**9)
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]


def test_without_like_shards_are_cut_at_5_gb(fp8_mc: Path, tmp_path: Path) -> None:
    job = export_mod.prepare(fp8_mc, tmp_path / "hf", fp8=True)
    assert (job.max_shard_bytes, job.like_files) == (5 * 10**9, None)


def test_fp8_export_of_a_bf16_like_puts_each_scale_right_after_its_weight(tiny_ckpt: Path, bf16_mc: Path,
                                                                          tmp_path: Path) -> None:
    summary = _export(bf16_mc, tmp_path / "hf", tiny_ckpt, fp8=True)
    index = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())["weight_map"]
    source = json.loads((tiny_ckpt / INDEX_NAME).read_text())["weight_map"]
    scales = {n: names.scale_owner(n) for n in index if names.scale_owner(n)}
    assert summary["shards_from"] == "--like" and len(scales) == 95
    assert {n: index[n] for n in source} == source  # every source tensor in its source file
    for shard in sorted(set(index.values())):
        order = _data_order(tmp_path / "hf" / shard)
        assert all(order[order.index(s) - 1] == w for s, w in scales.items() if s in order)
        assert [n for n in order if n not in scales] == _data_order(tiny_ckpt / shard)


def _drop_one_tensor(src: Path, out: Path) -> str:
    """A copy of `src` whose last shard lacks its first tensor (index and header rewritten)."""
    shutil.copytree(src, out)
    last = sorted(out.glob("model-*.safetensors"))[-1]
    with safe_open(str(last), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    dropped = _data_order(last)[0]
    del tensors[dropped]
    save_file(tensors, str(last), metadata={"format": "pt"})
    index = json.loads((out / INDEX_NAME).read_text())
    del index["weight_map"][dropped]
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return dropped


def test_a_like_lacking_a_tensor_cuts_by_size_and_says_which(tiny_ckpt: Path, bf16_mc: Path, tmp_path: Path) -> None:
    dropped = _drop_one_tensor(tiny_ckpt, tmp_path / "like")
    res = CliRunner().invoke(cli, ["export", str(bf16_mc), str(tmp_path / "hf"), "--like", str(tmp_path / "like")])
    assert res.exit_code == 0, res.output
    assert f"note: shards cut at 5 GB, not as --like's files: {dropped} is in none of --like's files" in res.stdout
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]

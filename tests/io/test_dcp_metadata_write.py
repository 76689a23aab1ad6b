"""`.metadata` written from stand-ins of DCP's classes (`dcp_classes`), without importing DCP's package: real DCP
reads exactly what its own `FileSystemWriter.finish` wrote before, byte for byte."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.storage import WriteResult

from glmconv.io.file_names import DCP_METADATA_NAME, RELEASE
from glmconv.io.torch_dist import dcp_classes as ours
from glmconv.io.torch_dist import writer as writer_module
from glmconv.io.torch_dist.writer import Chunk, DcpWriter, empty_extra_state
from glmconv.runners import convert

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _real_class(cls: type) -> Any:
    module, name = ours.origin_of(cls) or ("", "")
    return getattr(importlib.import_module(module), name)


DATACLASSES = [c for c in ours.CLASSES.values() if dataclasses.is_dataclass(c)]


@pytest.mark.parametrize("cls", DATACLASSES, ids=lambda c: c.__name__)
def test_each_stand_in_has_dcps_fields_in_dcps_order(cls: type) -> None:
    assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in dataclasses.fields(_real_class(cls))]


def test_the_stand_in_enum_has_dcps_members() -> None:
    real = dcp_md._MEM_FORMAT_ENCODING
    assert {m.name: m.value for m in ours.MemFormatEncoding} == {m.name: m.value for m in real}


@pytest.mark.parametrize("cls", DATACLASSES, ids=lambda c: c.__name__)
def test_each_stand_in_pickles_its_defaults_as_dcps(cls: type) -> None:
    """Built from the same required values, a stand-in pickles to the bytes DCP's class pickles to."""
    required = {"offsets": torch.Size([0]), "sizes": torch.Size([2]), "size": torch.Size([2]), "chunks": [],
                "properties": None, "state_dict_metadata": {}, "fqn": "a", "relative_path": "__0_0.distcp",
                "offset": 3, "length": 4}
    args = {f.name: required[f.name] for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if cls is ours.MetadataIndex:
        args["offset"] = torch.Size([3])
    assert ours.dumps(cls(**args)) == pickle.dumps(_real_class(cls)(**args), protocol=pickle.DEFAULT_PROTOCOL)


def test_a_metadata_index_compares_and_hashes_without_its_hint() -> None:
    a, b = ours.MetadataIndex("w", torch.Size([2, 0]), index=1), ours.MetadataIndex("w", torch.Size([2, 0]))
    assert a == b and hash(a) == hash(b) and a != ours.MetadataIndex("w", torch.Size([0, 0]))
    assert ours.dumps(a) == pickle.dumps(dcp_md.MetadataIndex("w", [2, 0], index=1), protocol=pickle.DEFAULT_PROTOCOL)


def test_tensor_properties_pickle_as_dcps_for_every_memory_format_encoding() -> None:
    fmt = {ours.MemFormatEncoding.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
           ours.MemFormatEncoding.TORCH_CHANNELS_LAST: torch.channels_last,
           ours.MemFormatEncoding.TORCH_PRESERVE_FORMAT: torch.preserve_format}
    for enc, mem in fmt.items():
        mine = ours.TensorProperties(dtype=torch.float8_e4m3fn, requires_grad=True, memory_format=enc)
        real = dcp_md.TensorProperties(dtype=torch.float8_e4m3fn, requires_grad=True, memory_format=mem)
        assert ours.dumps(mine) == pickle.dumps(real, protocol=pickle.DEFAULT_PROTOCOL)


def test_storage_info_leaves_out_none_fields_as_dcps() -> None:
    for descriptors in (None, ["zstd"]):
        mine = ours.StorageInfo("__1_2.distcp", 10, 20, descriptors)
        real = _StorageInfo("__1_2.distcp", 10, 20, descriptors)
        assert ours.dumps(mine) == pickle.dumps(real, protocol=pickle.DEFAULT_PROTOCOL)


# ---- the writer: what DCP's FileSystemWriter.finish wrote before, from the same writes ----

def _old_write(ckpt_dir: Path, md: ours.Metadata, storage: dict[Any, Any], sync: bool, checkpoint_id: str) -> None:
    """The writer's `.metadata` as glmconv wrote it before: DCP's classes through `FileSystemWriter.finish`, whose
    `storage_meta` is the writer's (a relative checkpoint_id, a save_id derived from the metadata)."""
    def entry(e: Any) -> Any:
        if isinstance(e, ours.BytesStorageMetadata):
            return dcp_md.BytesStorageMetadata()
        return dcp_md.TensorStorageMetadata(
            properties=dcp_md.TensorProperties(dtype=e.properties.dtype), size=e.size,
            chunks=[dcp_md.ChunkStorageMetadata(offsets=c.offsets, sizes=c.sizes) for c in e.chunks])

    real = dcp.Metadata(state_dict_metadata={k: entry(v) for k, v in md.state_dict_metadata.items()})
    results = [WriteResult(index=dcp_md.MetadataIndex(k.fqn, k.offset), size_in_bytes=v.length,
                           storage_data=_StorageInfo(v.relative_path, v.offset, v.length)) for k, v in storage.items()]
    unsaved = dcp.Metadata(state_dict_metadata=real.state_dict_metadata, version="1.0.0",
                           storage_data={r.index: r.storage_data for r in results},
                           storage_meta=dcp_md.StorageMeta(checkpoint_id=checkpoint_id))
    unsaved_bytes = pickle.dumps(unsaved, protocol=pickle.DEFAULT_PROTOCOL)
    meta = dcp_md.StorageMeta(checkpoint_id=checkpoint_id, save_id=writer_module.content_save_id(unsaved_bytes))

    class Writer(dcp.FileSystemWriter):
        def storage_meta(self) -> dcp_md.StorageMeta:
            return meta

    Writer(str(ckpt_dir), sync_files=sync).finish(real, [results])


def _write(root: Path) -> Path:
    """A checkpoint holding every kind of entry: whole tensors, a tensor in row chunks over two groups, a scalar,
    an FP8 tensor and ShardedObjects."""
    g = torch.Generator().manual_seed(0)
    w = DcpWriter(root)
    w.write({"a.weight": torch.randn(4, 3, generator=g).bfloat16(), "scalar": torch.tensor(2.5)})
    big = torch.randn(6, 2, generator=g)
    w.write_chunks([Chunk("rows", big[:4], row=0, shape=(6, 2))])
    w.write_chunks([Chunk("rows", big[4:], row=4, shape=(6, 2)),
                    Chunk("fp8", torch.randn(2, 2, generator=g).to(torch.float8_e4m3fn))])
    w.write_objects({"a._extra_state/shard_0_1": empty_extra_state()})
    return w.finish({"iteration": 0})


def _read(ckpt: Path) -> Any:
    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    md.storage_meta.load_id = None  # set by the read itself
    return md


def test_the_metadata_is_byte_for_byte_what_dcps_finish_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    new = _write(tmp_path / "ck") / DCP_METADATA_NAME
    new_bytes, new_md = new.read_bytes(), _read(new.parent)
    shutil.rmtree(tmp_path / "ck")
    monkeypatch.setattr(writer_module, "_write_dcp_metadata", _old_write)
    old = _write(tmp_path / "ck") / DCP_METADATA_NAME
    assert new_md == _read(old.parent)
    assert new_bytes == old.read_bytes()
    assert new_md.storage_meta.checkpoint_id == RELEASE


def test_the_save_id_is_a_uuid_of_the_content(tmp_path: Path) -> None:
    """Written twice, anywhere: the same bytes; another checkpoint: another save_id."""
    a, b = _read(_write(tmp_path / "a")), _read(_write(tmp_path / "elsewhere" / "b"))
    assert (tmp_path / "a" / RELEASE / DCP_METADATA_NAME).read_bytes() == (
        tmp_path / "elsewhere" / "b" / RELEASE / DCP_METADATA_NAME).read_bytes()
    assert a.storage_meta.save_id == b.storage_meta.save_id
    assert uuid.UUID(a.storage_meta.save_id).version == 5
    w = DcpWriter(tmp_path / "c")
    w.write({"a.weight": torch.zeros(4, 3)})
    assert _read(w.finish({"iteration": 0})).storage_meta.save_id != a.storage_meta.save_id


def test_dcp_reads_the_writers_own_classes(tmp_path: Path) -> None:
    md = _read(_write(tmp_path / "ck"))
    assert type(md) is dcp.Metadata and md.version == "1.0.0" and md.planner_data is None
    assert md.storage_meta.checkpoint_id == RELEASE and md.storage_meta.modules == []  # not where it was written
    assert str(uuid.UUID(md.storage_meta.save_id)) == md.storage_meta.save_id
    assert {k: type(v).__name__ for k, v in md.state_dict_metadata.items()} == {
        "a._extra_state/shard_0_1": "BytesStorageMetadata", "a.weight": "TensorStorageMetadata",
        "common_state/shard_0_1": "BytesStorageMetadata", "fp8": "TensorStorageMetadata",
        "rows": "TensorStorageMetadata", "scalar": "TensorStorageMetadata"}
    rows = md.state_dict_metadata["rows"]
    assert rows.properties == dcp_md.TensorProperties(dtype=torch.float32) and rows.size == torch.Size([6, 2])
    assert rows.chunks == [dcp_md.ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 2]))
                           for r in range(6)]  # written as rows 0..3 and 4..5, stored a row each (per_row)
    assert md.state_dict_metadata["fp8"].properties.dtype == torch.float8_e4m3fn
    second = md.storage_data[dcp_md.MetadataIndex("rows", [4, 0])]
    assert (second.relative_path, second.offset, second.transform_descriptors) == ("__0_2.distcp", 0, None)
    assert {type(k) for k in md.storage_data} == {dcp_md.MetadataIndex}
    assert {type(v) for v in md.storage_data.values()} == {_StorageInfo}
    assert sorted(p.name for p in (tmp_path / "ck" / RELEASE).iterdir()) == [
        ".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "__0_3.distcp", "__0_4.distcp",
        "metadata.json"]


# ---- converted checkpoints: DCP's own pickle.dump of what it reads gives the file's bytes ----

@pytest.mark.parametrize("source, workers", [("tiny", 1), ("tiny_fp8", 1), ("tiny_fp8", 2)])
def test_a_converted_metadata_is_what_dcp_pickles(source: str, workers: int, tiny_ckpt: Path,
                                                   tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    src = {"tiny": tiny_ckpt, "tiny_fp8": tiny_fp8_ckpt}[source]
    out = tmp_path / "mc"
    convert.convert(convert.prepare(src, out), convert.RunOptions(progress=False, workers=workers))
    path = out / RELEASE / DCP_METADATA_NAME
    md = _read(out / RELEASE)
    assert pickle.dumps(md, protocol=pickle.DEFAULT_PROTOCOL) == path.read_bytes()
    assert md.version == "1.0.0"
    assert md.storage_meta.checkpoint_id == RELEASE  # not the staging directory publishing removed
    files = {v.relative_path for v in md.storage_data.values()}
    assert {f.split("_")[2] for f in files} == {str(r) for r in range(workers)}
    assert list(md.state_dict_metadata) == sorted(md.state_dict_metadata)

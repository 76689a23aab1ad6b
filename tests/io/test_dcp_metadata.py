"""torch_dist reading: tracker resolution, metadata.json, and a `.metadata` unpickled only through the allow-list.

Checkpoints are written by `write_torch_dist` (tests/helpers/checkpoints.py), a small torch_dist checkpoint from
the plan.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.checkpoints import COMMON_KEY, small_torch_dist

from glmconv.config import parse_config
from glmconv.errors import CheckpointError
from glmconv.io.dtypes import torch_dtype_code
from glmconv.io.file_names import DCP_METADATA_NAME
from glmconv.io.torch_dist.metadata import inspect_torch_dist, resolve_iter_dir
from glmconv.io.torch_dist.safe_unpickle import ALLOWED, safe_load


class _Recorder(pickle.Unpickler):
    def __init__(self, f: Any) -> None:
        super().__init__(f)
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.seen.add((module, name))
        return super().find_class(module, name)


def test_allow_list_covers_every_global_a_real_dcp_metadata_references(tmp_path):
    it = small_torch_dist(tmp_path / "ck") / "release"
    rec = _Recorder(open(it / DCP_METADATA_NAME, "rb"))
    rec.load()
    dtypes = {("torch", n) for n in ("bfloat16", "float32", "int64")}
    assert rec.seen - dtypes <= ALLOWED
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in rec.seen


def test_tensors_objects_and_common_state_are_listed(tmp_path):
    ck = inspect_torch_dist(small_torch_dist(tmp_path / "ck"))
    assert {n: (t.shape, t.dtype) for n, t in ck.tensors.items()} == {
        "a.weight": ((4, 3), "BF16"), "b": ((2,), "F32"), "i": ((3,), "I64")}
    assert ck.objects == [COMMON_KEY] and ck.common_state == COMMON_KEY
    assert ck.iter_dir == tmp_path / "ck" / "release" and ck.iteration == "release"


def test_numeric_tracker_points_to_padded_iteration_dir(tmp_path):
    root = small_torch_dist(tmp_path / "ck", iteration="42")
    assert resolve_iter_dir(root) == (tmp_path / "ck" / "iter_0000042", "42")


def test_iteration_dir_is_accepted_directly(tmp_path):
    ck = inspect_torch_dist(small_torch_dist(tmp_path / "ck") / "release")
    assert set(ck.tensors) == {"a.weight", "b", "i"}


def test_legacy_common_pt_is_noted(tmp_path):
    root = small_torch_dist(tmp_path / "ck", common=False)
    assert inspect_torch_dist(root).common_state is None
    (root / "release" / "common.pt").write_bytes(b"")
    assert inspect_torch_dist(root).common_state == "common.pt"


def test_bad_tracker_contents(tmp_path):
    root = small_torch_dist(tmp_path / "ck")
    (root / "latest_checkpointed_iteration.txt").write_text("banana")
    with pytest.raises(CheckpointError, match="expected an iteration number or 'release', got 'banana'"):
        inspect_torch_dist(root)


def test_tracker_pointing_to_missing_dir(tmp_path):
    root = small_torch_dist(tmp_path / "ck")
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointError, match="points to iter_0000007, which is missing"):
        inspect_torch_dist(root)


def test_not_a_torch_dist_dir(tmp_path):
    with pytest.raises(CheckpointError, match="not a torch_dist checkpoint"):
        inspect_torch_dist(tmp_path)


def test_wrong_sharded_backend(tmp_path):
    root = small_torch_dist(tmp_path / "ck")
    (root / "release" / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(CheckpointError, match="sharded_backend is 'zarr', expected 'torch_dist'"):
        inspect_torch_dist(root)


def test_missing_dcp_metadata(tmp_path):
    root = small_torch_dist(tmp_path / "ck")
    (root / "release" / DCP_METADATA_NAME).unlink()
    with pytest.raises(CheckpointError, match="release/.metadata: missing"):
        inspect_torch_dist(root)


def test_truncated_dcp_metadata(tmp_path):
    meta = small_torch_dist(tmp_path / "ck") / "release" / DCP_METADATA_NAME
    meta.write_bytes(meta.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"\.metadata: corrupt or truncated pickle"):
        inspect_torch_dist(tmp_path / "ck")


def test_missing_and_truncated_distcp_files(tmp_path):
    root = small_torch_dist(tmp_path / "ck")
    data = root / "release" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: truncated: metadata needs \d+ bytes, file has 100"):
        inspect_torch_dist(root)
    data.unlink()
    with pytest.raises(CheckpointError, match="__0_0.distcp: data file listed in .metadata is missing"):
        inspect_torch_dist(root)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_metadata_is_refused_without_running(tmp_path):
    root = small_torch_dist(tmp_path / "ck")
    marker = tmp_path / "pwned"
    (root / "release" / DCP_METADATA_NAME).write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: refusing to unpickle (posix|os)\.system"):
        inspect_torch_dist(root)
    assert not marker.exists()


def test_non_allow_listed_class_inside_real_metadata_is_refused(tmp_path):
    p = tmp_path / "m.pkl"
    p.write_bytes(pickle.dumps({"x": io.BytesIO(b"")}))
    with pytest.raises(CheckpointError, match="m.pkl: refusing to unpickle _io.BytesIO"):
        safe_load(p)


def test_torch_attribute_that_is_not_a_dtype_is_refused(tmp_path):
    p = tmp_path / "m.pkl"
    p.write_bytes(pickle.dumps(torch.load))
    with pytest.raises(CheckpointError, match="refusing to unpickle torch.serialization.load|refusing to unpickle "
                                              "torch.load"):
        safe_load(p)


def test_dtype_codes_match_the_plan():
    assert [torch_dtype_code(d) for d in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32)] == [
        "BF16", "F32", "F8_E4M3", "I32"]


def test_megatron_saved_plans_inside_metadata_are_allowed(tmp_path):
    """megatron-core's saver keeps `all_local_plans` (SavePlan/WriteItem/...) on the Metadata it pickles."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (
        BytesIOWriteData,
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    it = small_torch_dist(tmp_path / "ck") / "release"
    md = safe_load(it / DCP_METADATA_NAME)
    size = torch.Size([4, 3])
    tensor_item = WriteItem(MetadataIndex("a.weight", torch.Size([0, 0]), 0), WriteItemType.SHARD,
                            tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0, 0]), size),
                                                        TensorProperties(dtype=torch.bfloat16), size))
    bytes_item = WriteItem(MetadataIndex(COMMON_KEY), WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(10))
    md.all_local_plans = [SavePlan([tensor_item, bytes_item])]
    (it / DCP_METADATA_NAME).write_bytes(pickle.dumps(md))
    loaded = safe_load(it / DCP_METADATA_NAME)
    assert loaded.all_local_plans[0].items == [tensor_item, bytes_item]
    assert set(inspect_torch_dist(tmp_path / "ck").tensors) == {"a.weight", "b", "i"}


def test_checkpoint_written_by_glmconv_dcp_writer_reads_through_the_allow_list(tmp_path):
    from glmconv.io.torch_dist.writer import DcpWriter
    from glmconv.rules.names import sharded_object_key

    tensors = {"a.weight": torch.zeros(4, 3, dtype=torch.bfloat16), "b": torch.zeros(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        w = DcpWriter(tmp_path / "ck", sync_files=False)
        w.write(tensors)
        w.write_objects({sharded_object_key("x._extra_state"): None})
        w.finish({"checkpoint_version": 3.0, "iteration": 0})
    ck = inspect_torch_dist(tmp_path / "ck")
    assert {n: (t.shape, t.dtype) for n, t in ck.tensors.items()} == {"a.weight": ((4, 3), "BF16"), "b": ((2,), "F32")}
    assert sorted(ck.objects) == [COMMON_KEY, "x._extra_state/shard_0_1"] and ck.common_state == COMMON_KEY


# ---- read without torch: the same answers -------------------------------------------------------------

def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_common_state_reads_the_same_without_torch_as_with_it() -> None:
    from glmconv.fixtures import preset_config
    from glmconv.io.torch_dist.common_state import _data_pkl, _with_torch, _without_torch
    from glmconv.megatron_args import build_common_state

    data = _saved([build_common_state(parse_config(preset_config("tiny")), iteration=7)])
    (plain,), (strict,) = _without_torch(_data_pkl(data, "state")), _with_torch(data, "state")
    assert plain == strict and plain["iteration"] == 7 and vars(plain["args"]) == vars(strict["args"])


def test_a_common_state_holding_a_tensor_is_left_to_torch() -> None:
    from glmconv.io.torch_dist.common_state import _data_pkl, _without_torch, load_common_state

    data = _saved([{"iteration": 3, "rng": torch.arange(3)}])
    assert _without_torch(_data_pkl(data, "state")) is None
    assert load_common_state(data, source="state")["rng"].tolist() == [0, 1, 2]


def test_metadata_stand_ins_give_the_tensors_the_real_classes_give(tmp_path: Path) -> None:
    root = small_torch_dist(tmp_path / "ck")
    real = safe_load(root / "release" / DCP_METADATA_NAME)
    expected = {k: (tuple(md.size), torch_dtype_code(md.properties.dtype))
                for k, md in real.state_dict_metadata.items() if hasattr(md, "size")}
    assert {n: (t.shape, t.dtype) for n, t in inspect_torch_dist(root).tensors.items()} == expected


class _EnumsByName(pickle.Pickler):
    """Pickles every Enum member as Python 3.11.0-3.11.x's `pickle_by_enum_name` does: getattr(cls, name)."""

    def reducer_override(self, obj: Any) -> Any:
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj._name_)
        return NotImplemented


def _pickled_by_enum_name(obj: Any, protocol: int) -> bytes:
    buf = io.BytesIO()
    _EnumsByName(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def _metadata_with_plans(tmp_path: Path) -> Any:
    """A real `.metadata` carrying both enums DCP pickles: TensorProperties' memory format and WriteItemType."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import BytesIOWriteData, SavePlan, WriteItem, WriteItemType

    md = safe_load(small_torch_dist(tmp_path / "ck") / "release" / DCP_METADATA_NAME)
    md.all_local_plans = [SavePlan([WriteItem(MetadataIndex(COMMON_KEY), WriteItemType.BYTE_IO,
                                              bytes_io_data=BytesIOWriteData(10))])]
    return md


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_metadata_pickled_by_a_python_3_11_patch_release_loads(protocol: int, tmp_path: Path) -> None:
    """Issue 25: 3.11.2 pickles enum members through builtins.getattr; glmconv's own `.metadata` was refused."""
    md = _metadata_with_plans(tmp_path)
    path = tmp_path / "ck" / "release" / DCP_METADATA_NAME
    path.write_bytes(_pickled_by_enum_name(md, protocol))
    assert b"getattr" in path.read_bytes()
    loaded = safe_load(path)
    assert loaded.state_dict_metadata == md.state_dict_metadata
    assert loaded.all_local_plans == md.all_local_plans
    assert set(inspect_torch_dist(tmp_path / "ck").tensors) == {"a.weight", "b", "i"}  # read as stand-ins


def test_a_member_pickled_by_name_stands_in_as_the_member_pickled_by_value(tmp_path: Path) -> None:
    md = _metadata_with_plans(tmp_path)
    by_name, by_value = tmp_path / "by-name.pkl", tmp_path / "by-value.pkl"
    by_name.write_bytes(_pickled_by_enum_name(md, 4))
    by_value.write_bytes(pickle.dumps(md, protocol=4))

    def enums(p: Path) -> list[Any]:
        loaded = safe_load(p, stand_ins=True)
        return [loaded.all_local_plans[0].items[0].type.args[0],
                *(e.properties.memory_format.value for e in loaded.state_dict_metadata.values() if hasattr(e, "size"))]

    assert enums(by_name) == enums(by_value) == [3, 0, 0, 0]


def test_the_stand_ins_default_what_the_real_classes_default() -> None:
    import importlib

    from glmconv.io.torch_dist.safe_unpickle import DEFAULTS

    real = {n: getattr(importlib.import_module(m), n) for m, n in ALLOWED if m.startswith("torch.distributed")}
    for name, defaults in DEFAULTS.items():
        assert defaults == {k: getattr(real[name], k) for k in defaults}, name


def test_the_stand_in_enum_members_are_torchs() -> None:
    import importlib

    from glmconv.io.torch_dist.safe_unpickle import ENUM_MEMBERS

    for (module, name), members in ENUM_MEMBERS.items():
        assert members == {m.name: m.value for m in getattr(importlib.import_module(module), name)}


@pytest.mark.parametrize("stand_ins", [False, True])
@pytest.mark.parametrize("target, attr", [
    ("Metadata", "__init__"), ("TensorProperties", "create_from_tensor"), ("_MEM_FORMAT_ENCODING", "__class__"),
    ("_MEM_FORMAT_ENCODING", "_member_map_"), ("_MEM_FORMAT_ENCODING", 1)])


def test_getattr_reaches_nothing_but_an_allow_listed_enum_member(target: str, attr: Any, stand_ins: bool,
                                                                 tmp_path: Path) -> None:
    import torch.distributed.checkpoint.metadata as dcp_md

    class Reach:
        def __reduce__(self) -> Any:
            return getattr, (getattr(dcp_md, target), attr)

    p = tmp_path / "m.pkl"
    p.write_bytes(pickle.dumps({"x": Reach()}, protocol=4))
    with pytest.raises(CheckpointError, match=r"m\.pkl: refusing to unpickle builtins\.getattr of "
                                               rf"torch\.distributed\.checkpoint\.metadata\.{target}\."):
        safe_load(p, stand_ins=stand_ins)


@pytest.mark.parametrize("stand_ins", [False, True])
def test_getattr_of_a_module_function_is_refused_without_running(stand_ins: bool, tmp_path: Path) -> None:
    p = tmp_path / "m.pkl"
    p.write_bytes(b"\x80\x04cbuiltins\ngetattr\ncos\nsystem\n\x94")
    with pytest.raises(CheckpointError, match=r"refusing to unpickle (posix|os)\.system"):
        safe_load(p, stand_ins=stand_ins)

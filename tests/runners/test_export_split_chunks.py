"""Export of a checkpoint whose chunks split dim 1 (and dim 0, and dim 2), as a trainer's ranks write them.

Two gloo processes save a converted `tiny` checkpoint again with `torch.distributed.checkpoint`, every tensor
a DTensor sharded over both ranks along its last even dim (2-D weights: dim 1, stacked experts: dim 2,
vectors: dim 0), each rank writing its own `.distcp` file; the byte entries (common state, `_extra_state`s) and
the files beside the DCP directory are carried over unchanged. Export must give the HF source back bit for bit,
copying every chunk's bytes (one extent per row piece) without a single torch.load, and the torch.load path
must write the same files.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import mcore_helpers as mh

from glmconv.io.file_names import TRACKER_NAME
from glmconv.io.torch_dist.reader import DcpReader, read_bytes_entry, read_metadata
from glmconv.runners import convert as convert_mod
from glmconv.runners import export as export_mod

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
RELEASE = "release"


VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


def split_dim(name: str, shape: tuple[int, ...]) -> int | None:
    """The dim a rank pair splits: the vocabulary (dim 0) of the embeddings, else the last one of even size (2-D
    weights: dim 1, stacked experts: dim 2); None when none is even."""
    if name in VOCAB_PARALLEL:
        return 0
    return next((d for d in reversed(range(len(shape))) if shape[d] % 2 == 0), None)


def _save_split(rank: int, src: str, dst: str) -> None:
    """Both ranks: every tensor of `src` as a DTensor split over the pair, saved by DCP into `dst`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    state: dict[str, Any] = {}
    for name, t in mh.read_dcp(src).items():
        d = split_dim(name, tuple(t.shape))
        state[name] = distribute_tensor(t, mesh, [Shard(d) if d is not None else Replicate()])
    release = Path(src) / RELEASE
    for key, meta in read_metadata(release).state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):  # common state, _extra_state objects: as stored
            state[key] = io.BytesIO(read_bytes_entry(release, key))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(Path(dst) / RELEASE)), planner=_raw_bytes_planner())


def _raw_bytes_planner() -> Any:
    """DCP's planner, writing byte entries as given (as megatron's MCoreSavePlanner does), not pickled again."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class RawBytes(DefaultSavePlanner):
        def transform_object(self, write_item: Any, object: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
                return object
            return super().transform_object(write_item, object)

    return RawBytes()


def write_split(src: Path, dst: Path) -> Path:
    """A copy of the torch_dist checkpoint `src` whose tensors two gloo ranks wrote split (`_save_split`)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(RELEASE, TRACKER_NAME))
    mh.spawn(_save_split, str(src), str(dst))
    shutil.copy(src / RELEASE / "metadata.json", dst / RELEASE / "metadata.json")
    (dst / TRACKER_NAME).write_text(RELEASE)
    return dst


@pytest.fixture(scope="module")
def split_mc(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("split")
    convert_mod.convert(convert_mod.prepare(tiny_ckpt, tmp / "mc"), convert_mod.RunOptions(progress=False))
    return write_split(tmp / "mc", tmp / "split")


def _export(mc: Path, out: Path, **opts: Any) -> dict[str, Any]:
    job = export_mod.prepare(mc, out, max_shard_bytes=200_000)
    return export_mod.export(job, export_mod.ExportOptions(progress=False, **opts))


def test_the_ranks_wrote_chunks_split_along_dims_1_2_and_0(split_mc: Path) -> None:
    reader = DcpReader(split_mc)
    proj = next(n for n in reader.names() if n.endswith("self_attention.linear_proj.weight"))
    rows, cols = reader.shape(proj)
    assert sorted(reader.chunks(proj)) == [((0, 0), (rows, cols // 2)), ((0, cols // 2), (rows, cols // 2))]
    vocab, width = reader.shape(VOCAB_PARALLEL[0])
    assert sorted(reader.chunks(VOCAB_PARALLEL[0])) == [((0, 0), (vocab // 2, width)), ((vocab // 2, 0),
                                                                                         (vocab // 2, width))]
    splits = {(len(reader.shape(n)), split_dim(n, reader.shape(n))) for n in reader.names()
              if len(reader.chunks(n)) == 2}
    assert {(1, 0), (2, 0), (2, 1), (3, 2), (4, 3)} <= splits  # vectors, vocab, weights, experts, vision convs
    assert sorted(p.name for p in (split_mc / RELEASE).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_export_copies_dim1_chunks_without_torch_load_and_gives_the_source_bit_for_bit(
        split_mc: Path, tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []
    load = DcpReader._load
    monkeypatch.setattr(DcpReader, "_load", lambda self, name, chunk: loads.append(name) or load(self, name, chunk))
    summary = _export(split_mc, tmp_path / "hf")
    assert loads == []  # every byte went through the zero-copy path
    got, want = mh.read_safetensors(tmp_path / "hf"), mh.read_safetensors(tiny_ckpt)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        mh.assert_same(name, got[name], t)
    assert summary["bytes_in"] == sum(t.numel() * t.element_size() for t in want.values())


def test_the_torch_load_path_writes_the_same_files_from_dim1_chunks(split_mc: Path, tmp_path: Path) -> None:
    _export(split_mc, tmp_path / "fast")
    _export(split_mc, tmp_path / "slow", zero_copy=False)
    fast = {p.name: p.read_bytes() for p in sorted((tmp_path / "fast").glob("*.safetensors"))}
    slow = {p.name: p.read_bytes() for p in sorted((tmp_path / "slow").glob("*.safetensors"))}
    assert fast == slow and len(fast) >= 4

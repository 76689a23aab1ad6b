"""What no trainer loads (`glmconv_kept.`: the kpool compression, MTP and vision in the mcore layout) lives in a
`glmconv_kept/` sidecar beside the DCP, so that megatron-core's strictest load (`raise_all`) sees exactly what a
Megatron-Bridge trainer requests; glmconv reads both as one checkpoint. Checkpoints written before the sidecar
(kept tensors inside the DCP, no `_extra_state` for the Transformer Engine norms) still export, verify and relayout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mcore_helpers as mh
from helpers.hf_helpers import raw_tensors

from glmconv import api
from glmconv.io.torch_dist.metadata import inspect_torch_dist

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
KEPT = "glmconv_kept."


def _dcp_keys(folder: Path) -> set[str]:
    """The keys torch's own DCP reader finds in one directory's `.metadata`."""
    return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sidecar") / "mc"
    api.convert(tiny_ckpt, out, layout="mcore")
    return out


@pytest.fixture(scope="module")
def written_before(converted: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint as glmconv wrote it before the sidecar: one DCP, kept tensors in it, no TE norm objects."""
    return mh.rewrite_dcp(converted, tmp_path_factory.mktemp("before") / "mc", lambda ts: ts,
                          objects=lambda key: "norm" not in key, keep=("config.json", "glmconv.json", "hf_sidecars"))


def test_the_dcp_holds_no_kept_tensor_and_the_sidecar_only_kept_ones(converted: Path) -> None:
    main, side = _dcp_keys(converted / "release"), _dcp_keys(converted / "release" / "glmconv_kept")
    assert not any(k.startswith(KEPT) for k in main)
    assert side and all(k.startswith(KEPT) for k in side)
    assert "glmconv_kept.decoder.layers.3.self_attention.core_attention.indexer.index_kpool_compress_gate" in side


def test_glmconv_reads_the_dcp_and_its_sidecar_as_one_checkpoint(converted: Path) -> None:
    ck = inspect_torch_dist(converted)
    side = _dcp_keys(converted / "release" / "glmconv_kept")
    assert side <= set(ck.tensors) and set(ck.tensors) - side == {
        k for k in _dcp_keys(converted / "release") if "/" not in k}


def test_a_checkpoint_written_before_the_sidecar_exports_the_same_bytes(converted: Path, written_before: Path,
                                                                        tmp_path: Path) -> None:
    assert (written_before / "release" / "glmconv_kept").exists() is False
    api.export(converted, tmp_path / "new")
    api.export(written_before, tmp_path / "old")
    new, old = raw_tensors(tmp_path / "new"), raw_tensors(tmp_path / "old")
    assert sorted(old) == sorted(new) and [n for n in new if new[n] != old[n]] == []


def test_a_checkpoint_written_before_the_sidecar_verifies(tiny_ckpt: Path, written_before: Path) -> None:
    summary = api.verify(tiny_ckpt, written_before)
    assert summary["equal"] is True


def test_a_checkpoint_written_before_relayouts_into_a_sidecar_and_every_te_extra_state(written_before: Path,
                                                                                    converted: Path,
                                                                                    tmp_path: Path) -> None:
    api.relayout(written_before, tmp_path / "miles", to="miles")
    api.relayout(tmp_path / "miles", tmp_path / "back", to="mcore")
    got, want = mh.read_dcp(tmp_path / "back"), mh.read_dcp(converted)
    assert sorted(got) == sorted(want)
    assert [n for n in got if not torch.equal(got[n].view(-1).view(torch.uint8), want[n].view(-1).view(torch.uint8))
            ] == []
    objects = lambda root: sorted(inspect_torch_dist(root).objects)  # noqa: E731
    assert objects(tmp_path / "back") == objects(converted)


def test_audit_names_the_te_norm_extra_states_a_checkpoint_written_before_lacks(written_before: Path) -> None:
    report = api.audit_report(written_before)
    missing = sorted(f.tensor for f in report.findings if f.kind == "missing")
    assert missing and all("norm._extra_state/" in k for k in missing)
    assert "decoder.final_layernorm._extra_state/shard_0_1" in missing

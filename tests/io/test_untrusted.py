"""Untrusted checkpoints: a malicious pickle anywhere in a torch_dist checkpoint is refused and never runs.

A pickle whose `__reduce__` would run `os.system("touch MARKER")` or `open(MARKER, "w")` is planted as
(a) the DCP `.metadata`, (b) the bytes of the `common_state/shard_0_1` entry, (c) a legacy `common.pt`,
(d) the bytes of one tensor chunk in a `.distcp` file. Every command that reads the planted file (audit-names,
export, parity's train-side weight loading) fails with one `error:` line that names the file and says it
refused to unpickle (allow-listed unpickler or torch.load(weights_only=True)), and MARKER is never created.
Commands that do not read the planted file (audit-names never loads the common state) finish without running
it either.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers.checkpoints import repoint

from glmconv.errors import CheckpointError
from glmconv.io.file_names import COMMON_PT_NAME, COMMON_STATE_KEY, DCP_METADATA_NAME, RELEASE
from glmconv.io.torch_dist.safe_unpickle import safe_load
from glmconv.runners import convert as convert_mod
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
REFUSED = r"refusing to unpickle|weights.only"
EMBED = "embedding.word_embeddings.weight"  # read first by parity, early by export


class RunsShell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class OpensFile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.open, (str(self.marker), "w"))


PAYLOADS = {"os.system": RunsShell, "open": OpensFile}


@pytest.fixture(scope="module")
def mc_clean(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("untrusted") / "mc"
    convert_mod.convert(convert_mod.prepare(tiny_ckpt, out), convert_mod.RunOptions(progress=False))
    return out


def _torch_pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def plant(where: str, mc: Path, evil: Any) -> str:
    """Plant `evil` in a copy of a torch_dist checkpoint; returns the file name the error must name."""
    if where == "metadata":
        (mc / RELEASE / DCP_METADATA_NAME).write_bytes(pickle.dumps(evil))
        return DCP_METADATA_NAME
    if where == "common-state":
        repoint(mc, COMMON_STATE_KEY, _torch_pickle([evil]))
        return COMMON_STATE_KEY
    if where == "common.pt":
        (mc / RELEASE / COMMON_PT_NAME).write_bytes(_torch_pickle(evil))
        return COMMON_PT_NAME
    if where == "tensor-chunk":
        return repoint(mc, EMBED, _torch_pickle(evil))
    raise AssertionError(where)


def _error_line(args: list[str]) -> tuple[int, str]:
    res = CliRunner().invoke(cli, args)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exc_info
    assert "Traceback" not in res.output
    return res.exit_code, res.stderr


# (where, command) -> does the command read the planted file?
READS = {
    ("metadata", "audit-names"): True, ("metadata", "export"): True, ("metadata", "parity"): True,
    ("common-state", "audit-names"): False, ("common-state", "export"): True, ("common-state", "parity"): False,
    ("common.pt", "audit-names"): False, ("common.pt", "export"): True, ("common.pt", "parity"): False,
    ("tensor-chunk", "audit-names"): False, ("tensor-chunk", "export"): True, ("tensor-chunk", "parity"): True,
}


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("where", ["metadata", "common-state", "common.pt", "tensor-chunk"])
def test_malicious_pickle_is_refused_and_never_runs(where: str, payload: str, mc_clean: Path, tiny_ckpt: Path,
                                                    tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    mc = tmp_path / "mc"
    shutil.copytree(mc_clean, mc)
    named = plant(where, mc, PAYLOADS[payload](marker))
    commands = {"audit-names": ["audit-names", str(mc)],
                "export": ["export", str(mc), str(tmp_path / "out")],
                "parity": ["parity", str(tiny_ckpt), str(mc), "--tokens", "8", "--json"]}
    for command, args in commands.items():
        code, stderr = _error_line(args)
        if READS[(where, command)]:
            lines = stderr.strip().splitlines()
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (command, stderr)
            assert named in lines[0] and re.search(REFUSED, lines[0]), (command, lines[0])
        else:
            assert code in (0, 1) or "refusing" in stderr, (command, stderr)  # reads other files, never this one
        assert not marker.exists(), f"{command} ran the planted pickle"
    assert not (tmp_path / "out").exists()


def test_parity_weight_loading_refuses_a_poisoned_chunk_directly(mc_clean: Path, tmp_path: Path) -> None:
    """The train side's weight source (parity's loader) reads chunks with weights_only=True."""
    from glmconv.models.weights import MegatronWeights

    marker = tmp_path / "pwned"
    mc = tmp_path / "mc"
    shutil.copytree(mc_clean, mc)
    data_file = plant("tensor-chunk", mc, RunsShell(marker))
    weights = MegatronWeights(mc)
    with pytest.raises(CheckpointError, match=REFUSED) as err:
        weights.read(EMBED)
    assert data_file in str(err.value) and EMBED in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_malicious_metadata_nested_inside_real_metadata_is_refused(mc_clean: Path, tmp_path: Path) -> None:
    """The payload hidden in one field of an otherwise genuine DCP Metadata object."""
    marker = tmp_path / "pwned"
    mc = tmp_path / "mc"
    shutil.copytree(mc_clean, mc)
    meta = mc / RELEASE / DCP_METADATA_NAME
    md = safe_load(meta)
    md.planner_data = OpensFile(marker)
    meta.write_bytes(pickle.dumps(md))
    code, stderr = _error_line(["export", str(mc), str(tmp_path / "out")])
    assert code == 2 and re.search(rf"error: {re.escape(DCP_METADATA_NAME)}: refusing to unpickle (builtins|io)\.open$",
                                   stderr.strip()), stderr
    assert not marker.exists() and not (tmp_path / "out").exists()

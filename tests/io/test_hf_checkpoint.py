"""Safetensors headers and HF checkpoint inspection: every malformed input is one clear CheckpointError.

Checkpoints are written by `write_hf` (tests/helpers/checkpoints.py), the one helper that writes a small HF
checkpoint from the plan.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.checkpoints import plan_tensors, tiny_config, write_hf
from safetensors.torch import save_file

from glmconv.config import parse_config
from glmconv.errors import CheckpointError
from glmconv.io.file_names import INDEX_NAME
from glmconv.io.safetensors.checkpoint import inspect_hf_checkpoint
from glmconv.io.safetensors.header import read_header
from glmconv.plan import build_plan
from glmconv.rules.names import HF_FLAT_PREFIX, HF_TEXT_PREFIX


def _raw_safetensors(path: Path, header: dict[str, Any], data: bytes) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


# ---- safetensors headers ----------------------------------------------------------------------------

def test_header_is_read_without_tensor_data(tmp_path):
    save_file({"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(2)}, str(tmp_path / "x.safetensors"),
              metadata={"format": "pt"})
    h = read_header(tmp_path / "x.safetensors")
    assert {n: (e.dtype, e.shape) for n, e in h.entries.items()} == {"a": ("BF16", (3, 5)), "b": ("F32", (2,))}
    assert h.metadata == {"format": "pt"}


@pytest.mark.parametrize(("stored", "has_metadata"), [({"__metadata__": {}}, True), ({}, False)])
def test_a_header_says_whether_it_stores_metadata_even_an_empty_one(tmp_path, stored, has_metadata):
    header = {**stored, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    h = read_header(_raw_safetensors(tmp_path / "x.safetensors", header, bytes(8)))
    assert (h.metadata, h.has_metadata) == ({}, has_metadata)


def test_truncated_shard_names_file_and_byte_counts(tmp_path):
    p = tmp_path / "model-00002-of-00003.safetensors"
    save_file({"a": torch.zeros(10, 10)}, str(p))
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003.safetensors: truncated: header says 400 "
                                              r"bytes of data, file has 300"):
        read_header(p)


def test_file_shorter_than_length_prefix_is_truncated(tmp_path):
    p = tmp_path / "s.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="s.safetensors: truncated"):
        read_header(p)


def test_header_length_beyond_file_is_truncated(tmp_path):
    p = tmp_path / "s.safetensors"
    p.write_bytes(struct.pack("<Q", 5000) + b"{}")
    with pytest.raises(CheckpointError, match="header says 5000 bytes of header, file has 2"):
        read_header(p)


def test_absurd_header_length_is_refused(tmp_path):
    p = tmp_path / "s.safetensors"
    p.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(CheckpointError, match="exceeds 100 MB"):
        read_header(p)


def test_header_that_is_not_json_is_corrupt(tmp_path):
    p = tmp_path / "s.safetensors"
    p.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{x")
    with pytest.raises(CheckpointError, match="s.safetensors: corrupt header: not valid UTF-8 JSON"):
        read_header(p)


def test_header_json_array_is_corrupt(tmp_path):
    p = tmp_path / "s.safetensors"
    p.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(CheckpointError, match="expected a JSON object, got list"):
        read_header(p)


def test_entry_without_data_offsets_is_corrupt(tmp_path):
    p = _raw_safetensors(tmp_path / "s.safetensors", {"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4)
    with pytest.raises(CheckpointError, match="tensor w: expected an object with dtype, shape and data_offsets"):
        read_header(p)


def test_unknown_dtype_is_corrupt(tmp_path):
    p = _raw_safetensors(tmp_path / "s.safetensors", {"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}},
                         b"\0")
    with pytest.raises(CheckpointError, match="tensor w: unknown dtype 'Q4'"):
        read_header(p)


def test_byte_size_must_match_shape_times_dtype(tmp_path):
    p = _raw_safetensors(tmp_path / "s.safetensors",
                         {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, b"\0" * 20)
    with pytest.raises(CheckpointError, match=r"tensor w: F32\[2, 3\] needs 24 bytes, data_offsets span 20"):
        read_header(p)


def test_overlapping_tensors_are_corrupt(tmp_path):
    hdr = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    p = _raw_safetensors(tmp_path / "s.safetensors", hdr, b"\0" * 12)
    with pytest.raises(CheckpointError, match="tensor b at data offset 4 overlaps the previous tensor"):
        read_header(p)


def test_gap_between_tensors_is_corrupt(tmp_path):
    hdr = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}
    p = _raw_safetensors(tmp_path / "s.safetensors", hdr, b"\0" * 12)
    with pytest.raises(CheckpointError, match="tensor b at data offset 8 leaves a gap of 4 bytes"):
        read_header(p)


def test_trailing_bytes_after_last_tensor_are_corrupt(tmp_path):
    hdr = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    p = _raw_safetensors(tmp_path / "s.safetensors", hdr, b"\0" * 9)
    with pytest.raises(CheckpointError, match="header says 4 bytes of data, file has 9"):
        read_header(p)


def test_metadata_must_map_strings_to_strings(tmp_path):
    p = _raw_safetensors(tmp_path / "s.safetensors", {"__metadata__": {"format": 1}}, b"")
    with pytest.raises(CheckpointError, match="__metadata__ must map strings to strings"):
        read_header(p)


# ---- HF checkpoint directories ----------------------------------------------------------------------

def test_clean_checkpoint_lists_every_tensor_with_its_shard(tmp_path):
    ck = inspect_hf_checkpoint(write_hf(tmp_path / "ck"))
    plan = build_plan(parse_config(tiny_config()))
    assert {n: (t.shape, t.dtype) for n, t in ck.tensors.items()} == {
        n: (s.shape, s.dtype) for n, s in plan.hf_index.items()}
    assert {t.file for t in ck.tensors.values()} == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert ck.text_prefix == HF_TEXT_PREFIX and ck.index_file == INDEX_NAME and ck.problems == []
    assert ck.config.num_layers == 2 and not ck.quantized


def test_flat_prefix_is_detected(tmp_path):
    ck = inspect_hf_checkpoint(write_hf(tmp_path / "ck", tensors=plan_tensors(tiny_config(), prefix=HF_FLAT_PREFIX)))
    assert ck.text_prefix == HF_FLAT_PREFIX


def test_single_file_checkpoint_without_index(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    save_file({"lm_head.weight": torch.zeros(64, 32, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    ck = inspect_hf_checkpoint(tmp_path)
    assert ck.index_file is None and ck.tensors["lm_head.weight"].file == "model.safetensors"


def test_fp8_config_is_quantized(tmp_path):
    assert inspect_hf_checkpoint(write_hf(tmp_path / "ck", fp8=True)).quantized


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="nope: no such directory"):
        inspect_hf_checkpoint(tmp_path / "nope")


def test_empty_directory(tmp_path):
    with pytest.raises(CheckpointError, match="empty directory"):
        inspect_hf_checkpoint(tmp_path)


def test_missing_config_json(tmp_path):
    (write_hf(tmp_path / "ck") / "config.json").unlink()
    with pytest.raises(CheckpointError, match="ck: no config.json"):
        inspect_hf_checkpoint(tmp_path / "ck")


def test_no_index_and_no_single_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json and no model.safetensors"):
        inspect_hf_checkpoint(tmp_path)


def test_truncated_index_json_names_the_index(tmp_path):
    ck = write_hf(tmp_path / "ck")
    (ck / INDEX_NAME).write_text((ck / INDEX_NAME).read_text()[:100])
    with pytest.raises(CheckpointError, match=r"^model.safetensors.index.json: not valid JSON, truncated"):
        inspect_hf_checkpoint(ck)


def test_index_without_weight_map(tmp_path):
    ck = write_hf(tmp_path / "ck")
    (ck / INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="expected an object with a weight_map"):
        inspect_hf_checkpoint(ck)


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors", "sub/../../x.safetensors"])
def test_index_naming_a_file_outside_the_directory_is_refused(tmp_path, shard):
    ck = write_hf(tmp_path / "ck")
    index = json.loads((ck / INDEX_NAME).read_text())
    index["weight_map"]["lm_head.weight"] = shard
    (ck / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"shard '{shard}' is outside the checkpoint directory"):
        inspect_hf_checkpoint(ck)


def test_an_index_name_with_dot_dot_that_stays_inside_is_refused_as_such(tmp_path):
    ck = write_hf(tmp_path / "ck")
    index = json.loads((ck / INDEX_NAME).read_text())
    shard = index["weight_map"]["lm_head.weight"]
    index["weight_map"]["lm_head.weight"] = f"sub/../{shard}"
    (ck / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"shard 'sub/../{shard}' has a '..' component \\(it names a file "
                                              "inside, but glmconv takes no '..'\\)$"):
        inspect_hf_checkpoint(ck)


def test_symlinked_shard_escaping_the_directory_is_refused(tmp_path):
    ck = write_hf(tmp_path / "ck")
    shard = ck / "model-00001-of-00003.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(CheckpointError, match="model-00001-of-00003.safetensors' resolves to .*elsewhere.safetensors, "
                                              "outside the checkpoint directory"):
        inspect_hf_checkpoint(ck)


def test_symlink_inside_the_directory_is_fine(tmp_path):
    ck = write_hf(tmp_path / "ck")
    shard = ck / "model-00001-of-00003.safetensors"
    (ck / "blobs").mkdir()
    shard.rename(ck / "blobs" / "abc")
    shard.symlink_to(ck / "blobs" / "abc")
    assert len(inspect_hf_checkpoint(ck).tensors) == len(plan_tensors(tiny_config()))


def test_shard_listed_in_index_but_missing(tmp_path):
    ck = write_hf(tmp_path / "ck")
    (ck / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors: shard listed in "
                                              "model.safetensors.index.json is missing"):
        inspect_hf_checkpoint(ck)


def test_truncated_shard_in_checkpoint(tmp_path):
    ck = write_hf(tmp_path / "ck")
    p = ck / "model-00003-of-00003.safetensors"
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="model-00003-of-00003.safetensors: truncated: header says"):
        inspect_hf_checkpoint(ck)


def test_index_lists_tensor_its_shard_lacks(tmp_path):
    tensors = plan_tensors(tiny_config())
    wm = {n: "model-00001-of-00001.safetensors" for n in tensors}
    wm["model.language_model.ghost.weight"] = "model-00001-of-00001.safetensors"
    ck = write_hf(tmp_path / "ck", shards=[tensors], weight_map=wm)
    with pytest.raises(CheckpointError, match="tensor model.language_model.ghost.weight: expected in "
                                              "model-00001-of-00001.safetensors .*found absent from every shard"):
        inspect_hf_checkpoint(ck)
    problems = inspect_hf_checkpoint(ck, strict=False).problems
    assert [(p.kind, p.tensor) for p in problems] == [("index", "model.language_model.ghost.weight")]


def test_tensor_in_shard_but_not_in_index(tmp_path):
    tensors = plan_tensors(tiny_config())
    wm = {n: "model-00001-of-00001.safetensors" for n in tensors if n != "lm_head.weight"}
    ck = write_hf(tmp_path / "ck", shards=[tensors], weight_map=wm)
    problems = inspect_hf_checkpoint(ck, strict=False).problems
    assert [(p.kind, p.tensor, p.file) for p in problems] == [("index", "lm_head.weight",
                                                               "model-00001-of-00001.safetensors")]
    assert "not listed in model.safetensors.index.json" in problems[0].found


def test_same_tensor_in_two_shards_is_a_duplicate(tmp_path):
    tensors = plan_tensors(tiny_config())
    names = list(tensors)
    first = {n: tensors[n] for n in names[: len(names) // 2]}
    second = {n: tensors[n] for n in names[len(names) // 2:]} | {"lm_head.weight": tensors["lm_head.weight"]}
    ck = write_hf(tmp_path / "ck", shards=[first, second])
    with pytest.raises(CheckpointError, match="tensor lm_head.weight: expected stored once, found stored twice: "
                                              "in model-00001-of-00002.safetensors and model-00002-of-00002"):
        inspect_hf_checkpoint(ck)
    problems = inspect_hf_checkpoint(ck, strict=False).problems
    assert [(p.kind, p.tensor) for p in problems] == [("duplicate", "lm_head.weight")]

"""`glmconv export`: torch_dist -> HF round trips (bytes, index, FP8, logits), --like, workers, padding, refusals."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import mcore_helpers as mh
from helpers.hf_helpers import raw_tensors

from glmconv import defaults
from glmconv.errors import CheckpointError, GlmconvError
from glmconv.io.config_file import load_config
from glmconv.io.file_names import (
    COMMON_PT_NAME,
    CONFIG_NAME,
    DCP_METADATA_NAME,
    INDEX_NAME,
    RELEASE,
    TRACKER_NAME,
)
from glmconv.io.safetensors.writer import ShardWriter
from glmconv.io.torch_dist.common_state import read_common_state
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.io.torch_dist.writer import Chunk, DcpWriter
from glmconv.numerics.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from glmconv.plan import build_plan
from glmconv.rules import names
from glmconv.rules.ops import SplitVector
from glmconv.runners import convert as convert_mod
from glmconv.runners import export as export_mod

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SMALL_SHARDS = 300_000  # bytes: several shards even for the tiny fixture


# ---- helpers -----------------------------------------------------------------------------------------

def _convert(src: Path, out: Path) -> Path:
    job = convert_mod.prepare(src, out)
    convert_mod.convert(job, convert_mod.RunOptions(progress=False))
    return out


def _export(mc: Path, out: Path, *, workers: int = 1, force: bool = False, **kw: Any) -> dict[str, Any]:
    kw.setdefault("max_shard_bytes", SMALL_SHARDS)
    job = export_mod.prepare(mc, out, **kw)
    return export_mod.export(job, export_mod.ExportOptions(workers=workers, progress=False), force=force)


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _index(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / INDEX_NAME).read_text())


def _rewrite(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    """A copy of a torch_dist checkpoint with its tensors edited (written whole by glmconv's own writer)."""
    return mh.rewrite_dcp(src, dst, edit)


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


@pytest.fixture(scope="module")
def tiny_mc(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _convert(tiny_ckpt, tmp_path_factory.mktemp("export") / "tiny_mc")


@pytest.fixture(scope="module")
def tiny_export(tiny_mc: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("export") / "tiny_hf"
    return out, _export(tiny_mc, out)


# ---- round trips -------------------------------------------------------------------------------------

def test_tiny_round_trip_is_byte_identical(tiny_ckpt: Path, tiny_export: tuple[Path, dict[str, Any]]) -> None:
    out, summary = tiny_export
    src, got = raw_tensors(tiny_ckpt), raw_tensors(out)
    assert got.keys() == src.keys() and len(got) == 246
    assert [n for n in src if got[n] != src[n]] == []
    assert _index(out)["weight_map"].keys() == _index(tiny_ckpt)["weight_map"].keys()
    assert _index(out)["metadata"]["total_size"] == _index(tiny_ckpt)["metadata"]["total_size"] == 1_189_840
    assert summary["bytes_out"] == 1_189_840 and summary["bytes_in"] == 1_189_840 and summary["shards"] >= 4
    assert (summary["mtp"], summary["vision"], summary["fp8"], summary["vocab_padding_stripped"]) == (
        True, True, False, {})
    assert json.loads((out / CONFIG_NAME).read_text()) == json.loads((tiny_ckpt / CONFIG_NAME).read_text())
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("model-")) == [
        CONFIG_NAME, "generation_config.json", "glmconv.json", INDEX_NAME]  # the source's, kept by convert


def test_cut8_round_trip_is_byte_identical(cut8_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    summary = _export(_convert(cut8_ckpt, tmp_path / "mc"), out)
    src, got = raw_tensors(cut8_ckpt), raw_tensors(out)
    assert got.keys() == src.keys()
    assert [n for n in src if got[n] != src[n]] == []
    assert _index(out)["metadata"]["total_size"] == _index(cut8_ckpt)["metadata"]["total_size"] == summary["bytes_out"]
    assert set(_index(out)["weight_map"].values()) == {p.name for p in out.glob("model-*.safetensors")}


# ---- zero-copy: byte-pure mappings copied file to file --------------------------------------------------

def _export_with(mc: Path, out: Path, **opts: Any) -> dict[str, Any]:
    job = export_mod.prepare(mc, out, max_shard_bytes=SMALL_SHARDS)
    return export_mod.export(job, export_mod.ExportOptions(progress=False, **opts))


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_every_tiny_mapping_is_byte_pure_and_located(tiny_mc: Path) -> None:
    job = export_mod.prepare(tiny_mc, tiny_mc.parent / "unused")
    reader = DcpReader(tiny_mc)
    routed = [m for m in job.plan.mappings if export_mod.byte_route(m, reader, job.dtypes) is not None]
    assert len(routed) == len(job.plan.mappings) == 169
    assert sum(m.mcore_bytes for m in routed) == 1_189_840


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_fp8_ckpt"])
def test_zero_copy_and_torch_load_paths_write_identical_files(fixture: str, request: pytest.FixtureRequest,
                                                              tmp_path: Path) -> None:
    src = request.getfixturevalue(fixture)
    mc = _convert(src, tmp_path / "mc")
    fast = _export_with(mc, tmp_path / "fast", zero_copy=True)
    slow = _export_with(mc, tmp_path / "slow", zero_copy=False)
    assert _files(tmp_path / "fast") == _files(tmp_path / "slow")
    assert fast["bytes_out"] == slow["bytes_out"] and fast["shards"] == slow["shards"] >= 4
    if fixture == "tiny_ckpt":
        assert raw_tensors(tmp_path / "fast") == raw_tensors(src) and fast["bytes_in"] == slow["bytes_in"] == 1_189_840


def test_zero_copy_is_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(defaults.ZERO_COPY_ENV, raising=False)
    assert export_mod.ExportOptions().zero_copy is True
    monkeypatch.setenv(defaults.ZERO_COPY_ENV, "0")
    assert export_mod.ExportOptions().zero_copy is False


def test_an_item_the_reader_cannot_locate_is_read_through_torch_load(tiny_ckpt: Path, tiny_mc: Path,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    job = export_mod.prepare(tiny_mc, tmp_path / "unused")
    first = job.plan.mappings[0].mcore[0].name
    locate, read = DcpReader.raw_extent, DcpReader.read
    loaded: list[str] = []
    monkeypatch.setattr(DcpReader, "raw_extent",
                        lambda self, name, chunk: None if name == first else locate(self, name, chunk))
    monkeypatch.setattr(DcpReader, "read",
                        lambda self, name, rows=None, check=None: loaded.append(name) or read(self, name, rows, check))
    _export_with(tiny_mc, tmp_path / "hf")
    assert loaded == [first]
    assert raw_tensors(tmp_path / "hf") == raw_tensors(tiny_ckpt)


def test_the_finite_check_keeps_zero_copy_and_scans_every_copied_tensor(tiny_ckpt: Path, tiny_mc: Path,
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN/Inf is checked always (issue 25): bytes copied file to file are scanned, not read through torch.load."""
    import glmconv.io.finite as finite

    scan = finite.require_finite_extents
    scanned: list[str] = []
    monkeypatch.setattr(finite, "require_finite_extents",
                        lambda extents, dtype, shape, name, where: scanned.append(name) or scan(extents, dtype, shape,
                                                                                                 name, where))
    _export_with(tiny_mc, tmp_path / "hf", check_finite=True)
    assert raw_tensors(tmp_path / "hf") == raw_tensors(tiny_ckpt)
    assert scanned and len(scanned) == len(set(scanned))  # each copied HF tensor once


def test_a_mapping_written_all_in_fp8_is_read_without_the_nan_scan(tiny_fp8_ckpt: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Its encoding proves each value finite (a reused block by reproducing it, a re-quantised one by its own
    check), so the reader's pass over it (19 GB of BF16 at real-cut4) is left out; every other read is scanned."""
    import glmconv.io.torch_dist.reader as reader_mod
    from glmconv.plan import FP8

    mc = _convert(tiny_fp8_ckpt, tmp_path / "mc")
    scanned: list[str] = []
    check = reader_mod.require_finite
    monkeypatch.setattr(reader_mod, "require_finite", lambda t, name, *a: scanned.append(name) or check(t, name, *a))
    job = export_mod.prepare(mc, tmp_path / "hf", fp8=True, like=tiny_fp8_ckpt)
    export_mod.export(job, export_mod.ExportOptions(progress=False, zero_copy=False))
    read = [m for m in job.plan.mappings if m.key not in job.from_like]
    mixed = {t.name for m in read if any(job.dtypes.get(s.name, s.dtype) != FP8 for s in m.hf) for t in m.mcore}
    assert len(mixed) < len({t.name for m in read for t in m.mcore})  # some mappings all FP8, some not
    assert set(scanned) == mixed
    assert raw_tensors(tmp_path / "hf") == raw_tensors(tiny_fp8_ckpt)


def test_an_fp8_export_reads_each_header_and_the_metadata_once(tiny_fp8_ckpt: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-tensor work grows with the tensor count, not the bytes (issue 38: the benches' 5,448 tensors): --like's
    shard headers are parsed once a run, the source's .metadata unpickled once, however many steps use them."""
    import glmconv.io.safetensors.checkpoint as checkpoint_mod
    import glmconv.io.safetensors.header as header_mod
    import glmconv.io.safetensors.reader as reader_mod
    import glmconv.io.torch_dist.metadata_check as metadata_check_mod

    mc = _convert(tiny_fp8_ckpt, tmp_path / "mc")
    like = tiny_fp8_ckpt.resolve()
    headers: list[Path] = []
    unpickled: list[Path] = []
    read = header_mod.read_header
    for mod in (checkpoint_mod, reader_mod):  # export's readers of --like's headers
        monkeypatch.setattr(mod, "read_header", lambda p: headers.append(Path(p)) or read(p))
    load = metadata_check_mod.safe_load
    monkeypatch.setattr(metadata_check_mod, "safe_load", lambda p, **kw: unpickled.append(Path(p)) or load(p, **kw))
    job = export_mod.prepare(mc, tmp_path / "hf", fp8=True, like=tiny_fp8_ckpt)
    export_mod.export(job, export_mod.ExportOptions(progress=False))
    like_reads = [p.name for p in headers if p.resolve().parent == like]
    assert sorted(like_reads) == sorted(f.name for f in like.glob("*.safetensors"))
    assert [p.name for p in unpickled] == [".metadata"]
    assert raw_tensors(tmp_path / "hf") == raw_tensors(tiny_fp8_ckpt)


def test_plain_requantisation_keeps_codes_but_not_scales(tiny_fp8_ckpt: Path) -> None:
    """The measurement behind export's FP8 design: amax/448 of the dequantised bf16 recovers no scale.

    Every e4m3 code comes back (the block maximum maps to 448 again, every other value moves by < 2^-8
    relative, inside an e4m3 half-step), but amax(w)/448 = bf16(448*s0)/448 has lost s0's low mantissa
    bits in the bf16 cast, so all 101 block scales differ and 23% of the values dequantise differently.
    """
    src = _tensors(tiny_fp8_ckpt)
    codes = scales = values = diff_codes = diff_scales = diff_values = 0
    for name, q0 in src.items():
        if q0.dtype != torch.float8_e4m3fn:
            continue
        s0 = src[names.scale_name(name)]
        w = dequantize_fp8_blocks(q0, s0)  # what convert stores in Megatron (bf16)
        q1, s1 = quantize_fp8_blocks(w)
        codes, scales, values = codes + q0.numel(), scales + s0.numel(), values + w.numel()
        diff_codes += int((q1.view(torch.uint8) != q0.view(torch.uint8)).sum())
        diff_scales += int((s1 != s0).sum())
        diff_values += int((dequantize_fp8_blocks(q1, s1).view(torch.int16) != w.view(torch.int16)).sum())
    assert (codes, scales) == (247_808, 101)
    assert diff_codes == 0 and diff_scales == 101
    assert 0.15 < diff_values / values < 0.35


def test_fp8_round_trip_codes_equal_scales_differ_dequantised_equal(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    """`--fp8` gives the release's key set and the source's e4m3 codes; dequantised values are bit-identical.

    FP8 bytes: the codes match byte for byte, the `_scale_inv` bytes do not. The source scale s0 = amax0/448
    was computed from fp32 weights that the bf16 Megatron copy no longer has; export picks, per block, the fp32
    scale nearest amax/448 at which every code dequantises to exactly the stored bf16 value (an interval of
    fp32 scales does; s0 is one of them but is not recoverable).
    """
    out = tmp_path / "hf"
    summary = _export(_convert(tiny_fp8_ckpt, tmp_path / "mc"), out, fp8=True)
    src, got = _tensors(tiny_fp8_ckpt), _tensors(out)
    assert got.keys() == src.keys()
    fp8 = [n for n, t in src.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 95 and all(got[n].dtype == torch.float8_e4m3fn for n in fp8)
    assert [n for n in fp8 if not torch.equal(got[n].view(torch.uint8), src[n].view(torch.uint8))] == []
    scales = {names.scale_name(n) for n in fp8}
    assert [n for n in src if n not in scales and n not in fp8 and not torch.equal(got[n], src[n])] == []
    deq = [n for n in fp8 if not torch.equal(dequantize_fp8_blocks(got[n], got[names.scale_name(n)]).view(torch.int16),
                                             dequantize_fp8_blocks(src[n], src[names.scale_name(n)]).view(torch.int16))]
    assert deq == []
    assert sum(not torch.equal(got[s], src[s]) for s in scales) > 0  # the scale bytes are not the source's
    assert summary["fp8_requantized"]["blocks"] == 101 and summary["fp8_requantized"]["inexact_blocks"] == 0
    quant = json.loads((out / CONFIG_NAME).read_text())["quantization_config"]
    assert quant == json.loads((tiny_fp8_ckpt / CONFIG_NAME).read_text())["quantization_config"]


def test_exported_checkpoint_gives_the_source_logits(tiny_ckpt: Path, tiny_export: tuple[Path, dict[str, Any]]) -> None:
    from transformers import Glm5NextForConditionalGeneration

    ids = torch.arange(1, 27).unsqueeze(0)
    logits = []
    for ckpt in (tiny_ckpt, tiny_export[0]):
        model = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    assert logits[0].shape == (1, 26, 512) and logits[0].isfinite().all()
    assert torch.equal(logits[0], logits[1])


def _bf16_kept(plan: Any) -> set[str]:
    """The 2-D F32-kept tensors (hc fn, kpool ape): BF16 on disk in the release."""
    return {t.name for m in plan.mappings if m.rule.keep_f32 for t in m.hf if len(t.shape) == 2}


@pytest.fixture(scope="module")
def flat_source(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint under the flat `model.` prefix, hc fn / kpool ape in BF16, plus tokenizer files."""
    out = tmp_path_factory.mktemp("flat") / "src"
    bf16 = _bf16_kept(build_plan(load_config(tiny_ckpt)))
    with ShardWriter(out, SMALL_SHARDS) as writer:
        for name, t in _tensors(tiny_ckpt).items():
            writer.add(names.swap_text_prefix(name, names.HF_FLAT_PREFIX) or name,
                       t.to(torch.bfloat16) if name in bf16 else t)
    for f in (CONFIG_NAME, "generation_config.json"):
        shutil.copyfile(tiny_ckpt / f, out / f)
    (out / "tokenizer.json").write_text('{"model": "tiny"}\n')
    (out / "chat_template.jinja").write_text("{{ messages }}\n")
    return out


def test_like_restores_prefix_dtypes_and_sidecars(tiny_ckpt: Path, flat_source: Path, tmp_path: Path) -> None:
    mc = _convert(flat_source, tmp_path / "mc")
    plain = _export(mc, tmp_path / "plain")
    assert plain["text_prefix"] == names.HF_TEXT_PREFIX and plain["source_text_prefix"] == names.HF_FLAT_PREFIX
    src, got = _tensors(flat_source), _tensors(tmp_path / "plain")
    assert got.keys() == _tensors(tiny_ckpt).keys()
    bf16 = sorted(_bf16_kept(build_plan(load_config(tiny_ckpt))))
    assert len(bf16) == 10 and all(got[n].dtype == torch.bfloat16 for n in bf16)  # as convert recorded them
    assert all(torch.equal(got[n], src[names.swap_text_prefix(n, names.HF_FLAT_PREFIX)]) for n in bf16)
    assert (tmp_path / "plain" / "tokenizer.json").read_bytes() == (flat_source / "tokenizer.json").read_bytes()
    like = _export(mc, tmp_path / "like", like=flat_source)
    assert like["text_prefix"] == names.HF_FLAT_PREFIX
    assert raw_tensors(tmp_path / "like") == raw_tensors(flat_source)  # names, BF16 hc fn and bytes
    for f in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "like" / f).read_bytes() == (flat_source / f).read_bytes()
    config = [json.loads((d / CONFIG_NAME).read_text()) for d in (tmp_path / "like", flat_source)]
    assert config[0] == config[1]


def test_two_workers_write_distinct_shards_and_one_index(tiny_ckpt: Path, tiny_mc: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    summary = _export(tiny_mc, out, workers=2)
    assert summary["workers"] == 2
    assert raw_tensors(out) == raw_tensors(tiny_ckpt)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert set(_index(out)["weight_map"].values()) == set(shards)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


# ---- layouts the reader must accept --------------------------------------------------------------------

def test_vocab_padding_is_stripped_and_too_few_rows_refused(tiny_ckpt: Path, tiny_mc: Path, tmp_path: Path) -> None:
    plan = build_plan(load_config(tiny_mc))
    vocab = [m.mcore[0].name for m in plan.mappings if m.rule.shapes[0][0] == "vocab"]
    assert len(vocab) == 2

    def pad(rows: int) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        def edit(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            for n in vocab:
                junk = torch.randn(max(0, rows - 512), ts[n].shape[1]).to(ts[n].dtype)
                ts[n] = torch.cat([ts[n], junk])[:rows].clone()
            return ts
        return edit

    summary = _export(_rewrite(tiny_mc, tmp_path / "padded", pad(640)), tmp_path / "hf")
    assert summary["vocab_padding_stripped"] == {n: {"stored_rows": 640, "vocab_size": 512} for n in vocab}
    assert raw_tensors(tmp_path / "hf") == raw_tensors(tiny_ckpt)
    with pytest.raises(CheckpointError, match="511 vocabulary rows .* fewer than vocab_size 512") as err:
        export_mod.prepare(_rewrite(tiny_mc, tmp_path / "short", pad(511)), tmp_path / "hf2")
    assert vocab[0] in _one_line(err)


def test_iteration_directory_and_legacy_common_pt(tiny_ckpt: Path, tiny_mc: Path, tmp_path: Path) -> None:
    root = _rewrite(tiny_mc, tmp_path / "iter", lambda ts: ts)
    (root / RELEASE).rename(root / "iter_0000123")
    (root / TRACKER_NAME).write_text("123\n")
    state = read_common_state(root / "iter_0000123")
    torch.save({**state, "iteration": 123}, root / "iter_0000123" / COMMON_PT_NAME)
    config = (root / CONFIG_NAME).rename(tmp_path / "elsewhere.json")
    with pytest.raises(CheckpointError, match="has no config.json next to it .*, or pass --config CONFIG"):
        export_mod.prepare(root, tmp_path / "hf")
    summary = _export(root, tmp_path / "hf", config=config)
    assert summary["iteration"] == "123"
    assert raw_tensors(tmp_path / "hf") == raw_tensors(tiny_ckpt)


def test_reader_assembles_row_ranges_across_chunks(tmp_path: Path) -> None:
    full = torch.arange(10 * 3 * 4, dtype=torch.float32).view(10, 3, 4)
    writer = DcpWriter(tmp_path)
    writer.write_chunks([Chunk("x", full[0:3].clone(), 0, (10, 3, 4)), Chunk("x", full[3:5].clone(), 3, (10, 3, 4))])
    writer.write_chunks([Chunk("x", full[5:].clone(), 5, (10, 3, 4)), Chunk("s", torch.tensor(2.5))])
    writer.finish({"iteration": 0})
    reader = DcpReader(tmp_path)
    assert torch.equal(reader.read("x"), full) and torch.equal(reader.read("s"), torch.tensor(2.5))
    for rows in ((0, 10), (2, 7), (4, 5), (5, 10), (6, 6)):
        assert torch.equal(reader.read("x", rows), full[rows[0]:rows[1]])
    with pytest.raises(CheckpointError, match="rows 3..11 outside its 10 rows"):
        reader.read("x", (3, 11))


def test_reader_refuses_rows_no_chunk_covers(tmp_path: Path) -> None:
    full = torch.arange(10 * 2, dtype=torch.bfloat16).view(10, 2)
    writer = DcpWriter(tmp_path)
    writer.write_chunks([Chunk("x", full[r:r + 2].clone(), r, (10, 2)) for r in range(0, 10, 2)])
    ckpt = writer.finish({"iteration": 0})
    from glmconv.io.torch_dist.safe_unpickle import safe_load

    md = safe_load(ckpt / DCP_METADATA_NAME)
    md.state_dict_metadata["x"].chunks = [c for c in md.state_dict_metadata["x"].chunks if c.offsets[0] not in (4, 5)]
    (ckpt / DCP_METADATA_NAME).write_bytes(pickle.dumps(md))
    reader = DcpReader(tmp_path)
    assert torch.equal(reader.read("x", (0, 4)), full[:4]) and torch.equal(reader.read("x", (6, 10)), full[6:])
    with pytest.raises(CheckpointError, match=r"x: stored chunks cover 8 of the 12 elements of rows 3..9"):
        reader.read("x", (3, 9))


def test_reader_never_unpickles_objects_from_a_chunk(tmp_path: Path) -> None:
    """A chunk replaced by a pickled callable is refused by the weights-only unpickler, never run."""
    import dataclasses
    import os

    from glmconv.io.torch_dist.safe_unpickle import safe_load

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    writer = DcpWriter(tmp_path)
    writer.write({"x": torch.zeros(3)})
    ckpt = writer.finish({"iteration": 0})
    md = safe_load(ckpt / DCP_METADATA_NAME)
    (key, info), = [(k, v) for k, v in md.storage_data.items() if k.fqn == "x"]
    buf = io.BytesIO()
    torch.save(Evil(), buf)
    data = (ckpt / info.relative_path).read_bytes()
    (ckpt / info.relative_path).write_bytes(data[:info.offset] + buf.getvalue())
    md.storage_data = {key: dataclasses.replace(info, length=len(buf.getvalue()))}
    (ckpt / DCP_METADATA_NAME).write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"x: chunk is not a readable tensor \(refusing to unpickle "
                                              r"posix\.system: not on the allow-list, and glmconv never unpickles"):
        DcpReader(tmp_path).read("x")
    assert not (tmp_path / "pwned").exists()


# ---- refusals: one line, naming the file or tensor, nothing published -----------------------------------

def test_missing_tracker_target_and_directory(tiny_mc: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such directory") as err:
        export_mod.prepare(tmp_path / "nope", tmp_path / "out")
    assert str(tmp_path / "nope") in _one_line(err)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=f"not a torch_dist checkpoint \\(no {TRACKER_NAME}"):
        export_mod.prepare(tmp_path / "empty", tmp_path / "out")
    root = tmp_path / "moved"
    shutil.copytree(tiny_mc, root)
    (root / TRACKER_NAME).write_text("5")
    with pytest.raises(CheckpointError, match="points to iter_0000005, which is missing") as err:
        export_mod.prepare(root, tmp_path / "out")
    assert TRACKER_NAME in _one_line(err)


def test_missing_distcp_file_is_named(tiny_mc: Path, tmp_path: Path) -> None:
    root = tmp_path / "mc"
    shutil.copytree(tiny_mc, root)
    victim = sorted((root / RELEASE).glob("*.distcp"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}: data file listed in .* is missing") as err:
        export_mod.prepare(root, tmp_path / "out")
    _one_line(err)


def test_missing_alpha_is_named_with_the_scale_it_belongs_to(tiny_mc: Path, tmp_path: Path) -> None:
    plan = build_plan(load_config(tiny_mc))
    scale = [m for m in plan.mappings if isinstance(m.rule.transform, SplitVector) and m.layer == 1][-1]  # hc ffn
    alpha = scale.mcore[1].name  # alpha_post

    def drop(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        del ts[alpha]
        return ts

    with pytest.raises(CheckpointError) as err:
        export_mod.prepare(_rewrite(tiny_mc, tmp_path / "mc", drop), tmp_path / "out")
    assert _one_line(err).startswith(f"{alpha}: missing from ") and f"needed for {scale.hf[0].name}" in str(err.value)


def test_tensor_not_in_the_plan_is_named(tiny_mc: Path, tmp_path: Path) -> None:
    def add(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**ts, "decoder.layers.0.mystery.weight": torch.zeros(2, dtype=torch.bfloat16)}

    with pytest.raises(CheckpointError, match="decoder.layers.0.mystery.weight: in .* but not in the export plan") as e:
        export_mod.prepare(_rewrite(tiny_mc, tmp_path / "mc", add), tmp_path / "out")
    _one_line(e)


def test_a_gap_between_stored_chunks_is_refused_and_nothing_published(tiny_mc: Path, tmp_path: Path) -> None:
    root = tmp_path / "mc"
    shutil.copytree(tiny_mc, root)
    meta = root / RELEASE / DCP_METADATA_NAME
    from glmconv.io.torch_dist.safe_unpickle import safe_load

    md = safe_load(meta)
    name = next(n for n, e in md.state_dict_metadata.items() if getattr(e, "chunks", None) and len(e.size) == 3)
    md.state_dict_metadata[name].chunks.pop()
    meta.write_bytes(pickle.dumps(md))
    job = export_mod.prepare(root, tmp_path / "out")
    with pytest.raises(GlmconvError, match=f"{name}: stored chunks cover 0 of the .* elements of rows") as err:
        export_mod.export(job, export_mod.ExportOptions(progress=False))
    _one_line(err)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["mc"]


def test_existing_output_needs_force(tiny_ckpt: Path, tiny_mc: Path, tmp_path: Path) -> None:
    """--force replaces an OUT that glmconv published (a user directory is refused: tests/io/test_output_safety.py)."""
    out = tmp_path / "out"
    _export(tiny_mc, out)
    (out / "keep.txt").write_text("x")
    with pytest.raises(GlmconvError, match="already exists and is not empty; pass --force") as err:
        _export(tiny_mc, out)
    assert str(out) in _one_line(err) and (out / "keep.txt").exists()
    _export(tiny_mc, out, force=True)
    assert not (out / "keep.txt").exists() and raw_tensors(out) == raw_tensors(tiny_ckpt)


# ---- command line ------------------------------------------------------------------------------------

def test_cli_json_summary_and_one_line_errors(tiny_mc: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from glmconv_cli.main import cli

    runner = CliRunner()
    res = runner.invoke(cli, ["export", str(tiny_mc), str(tmp_path / "hf"), "--json", "--max-shard-size", "400KB"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["bytes_in"] == summary["bytes_out"] == 1_189_840 and summary["elapsed_s"] >= 0
    assert summary["shards"] == 3 and summary["published"] == str(tmp_path / "hf")
    res = runner.invoke(cli, ["export", str(tiny_mc), str(tmp_path / "hf")])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and res.stderr.startswith("error: ")
    res = runner.invoke(cli, ["export", str(tiny_mc), str(tmp_path / "hf2"), "--fp8", "--max-shard-size", "1GB"])
    assert res.exit_code == 0 and "fp8: 95 weights" in res.stdout

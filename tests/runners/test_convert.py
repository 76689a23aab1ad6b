"""`glmconv convert` end to end on the fixtures, single process (plus one --workers 2 run).

Every Megatron tensor written is read back with torch's own DCP loader and compared with what
`mcore_helpers.reference_mcore` computes from the HF files alone (safetensors + plain torch: the design
table re-spelled, FP8 dequantised block by block in a loop), never through glmconv's plan or transforms.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import mcore_helpers as mh

from glmconv.errors import GlmconvError
from glmconv.runners.convert import RunOptions, convert, prepare
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TRACKER = "latest_checkpointed_iteration.txt"
STAGING = ".glmconv-staging"


def run_convert(src: Path, out: Path, *, workers: int = 1, force: bool = False, **parts: bool) -> dict[str, Any]:
    job = prepare(src, out, **parts)
    return convert(job, RunOptions(workers=workers, progress=False), force=force)


def source_names(src: Path) -> list[str]:
    return list(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])


def source_bytes(src: Path) -> int:
    return sum(t.numel() * t.element_size() for t in mh.read_safetensors(src).values())


def checksums(d: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def sources(tiny_ckpt: Path, tiny_fp8_ckpt: Path, cut8_ckpt: Path) -> dict[str, Path]:
    return {"tiny": tiny_ckpt, "tiny-fp8": tiny_fp8_ckpt, "cut8": cut8_ckpt}


@pytest.fixture(scope="module")
def converted(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fixture converted once, in this process, with default options."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for name, src in sources.items():
        run_convert(src, root / name)
        out[name] = root / name
    return out


def assert_matches_reference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), (f"only written: {sorted(set(got) - set(want))[:5]}, "
                                         f"never written: {sorted(set(want) - set(got))[:5]}")
    for name, t in want.items():
        mh.assert_same(name, got[name], t)


# ---- values ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["tiny", "cut8"])
def test_bf16_source_lands_bit_for_bit_through_the_mapping(fixture: str, sources: dict[str, Path],
                                                           converted: dict[str, Path]) -> None:
    """Renames, gate++up, q,k,v conv concat, stacked experts, split alphas: exactly the source bytes."""
    want = mh.reference_mcore(sources[fixture])
    got = mh.read_dcp(converted[fixture])
    assert_matches_reference(got, want)
    n_layers = json.loads((sources[fixture] / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert any(n.startswith("mtp.layers.0.") for n in got) and any(n.startswith("vision_model.") for n in got)
    assert sum(n.startswith(f"decoder.layers.{n_layers - 1}.") for n in got) > 10


def test_fp8_source_is_dequantised_per_128_block_then_bf16(sources: dict[str, Path],
                                                            converted: dict[str, Path]) -> None:
    raw = mh.read_safetensors(sources["tiny-fp8"])
    fp8 = {n: t for n, t in raw.items() if t.dtype == torch.float8_e4m3fn}
    scales = [raw[n + "_scale_inv"].shape for n in fp8]
    assert len(fp8) >= 40 and any(s[0] > 1 for s in scales) and any(s[1] > 1 for s in scales)
    assert any(t.shape[0] % 128 and t.shape[1] % 128 for t in fp8.values())  # cropped edge blocks in both dims
    got = mh.read_dcp(converted["tiny-fp8"])
    assert_matches_reference(got, mh.reference_mcore(sources["tiny-fp8"]))
    down = "decoder.layers.0.mlp.linear_fc2.weight"  # an FP8 tensor: the dequantised value, not the raw bytes
    assert got[down].dtype == torch.bfloat16
    assert not torch.equal(got[down], raw["model.language_model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16))


def test_two_workers_write_the_same_tensors_as_one(sources: dict[str, Path], converted: dict[str, Path],
                                                   tmp_path: Path) -> None:
    summary = run_convert(sources["cut8"], tmp_path / "w2", workers=2)
    assert [w["rank"] for w in summary["workers"]] == [0, 1]
    files = {p.name.split("_")[2] for p in (tmp_path / "w2" / "release").glob("__*_*.distcp")}
    assert files == {"0", "1"}, "both ranks wrote data files"
    one, two = mh.read_dcp(converted["cut8"]), mh.read_dcp(tmp_path / "w2")
    assert sorted(one) == sorted(two)
    for name, t in one.items():
        mh.assert_same(name, two[name], t)


def test_byte_moves_are_copied_by_the_kernel_and_equal_the_computed_path(
        sources: dict[str, Path], converted: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Renames, dim-0 concats, splits and stacked experts of a BF16 source never pass through memory."""
    import os

    import glmconv.runners.convert as conv

    copied: list[int] = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: copied.append(real(*a)) or copied[-1])
    run_convert(sources["cut8"], tmp_path / "fast")
    assert sum(copied) >= 0.95 * source_bytes(sources["cut8"])  # all but the few F32-kept tensors stored BF16
    monkeypatch.setattr(conv, "byte_layout", lambda m, source: None)
    run_convert(sources["cut8"], tmp_path / "computed")
    fast, computed = mh.read_dcp(tmp_path / "fast"), mh.read_dcp(tmp_path / "computed")
    assert sorted(fast) == sorted(computed)
    for name, t in computed.items():
        mh.assert_same(name, fast[name], t)


# ---- the output directory -----------------------------------------------------------------------------

def test_tracker_says_release_and_sidecars_sit_in_the_root(sources: dict[str, Path],
                                                           converted: dict[str, Path]) -> None:
    out = converted["tiny"]
    assert (out / TRACKER).read_text() == "release"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "glmconv.json", "hf_sidecars", TRACKER, "release"]
    assert sorted(p.name for p in (out / "hf_sidecars").iterdir()) == ["generation_config.json"]
    assert json.loads((out / "release" / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1}
    src_cfg = json.loads((sources["tiny"] / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    for key in ("num_hidden_layers", "hidden_size", "n_routed_experts", "layer_types", "mlp_layer_types"):
        assert text[key] == src_cfg["text_config"][key], key
    manifest = json.loads((out / "glmconv.json").read_text())
    assert manifest["source"] == str(sources["tiny"].resolve())
    got = (manifest["mtp"], manifest["vision"], manifest["fp8_source"], manifest["left_out"])
    assert got == (True, True, False, {})
    assert manifest["hf_tensors"] == len(source_names(sources["tiny"]))
    assert manifest["mcore_tensors"] == len(mh.read_dcp(out))
    assert not list(out.parent.glob("*" + STAGING))


def test_existing_output_is_refused_without_force(sources: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GlmconvError, match="already exists and is not empty, and glmconv did not publish it .*: "
                       "choose another OUT, or empty it$"):
        run_convert(sources["tiny"], out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_force_replaces_existing_output_whole(sources: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_convert(sources["cut8"], out)
    (out / "stale.txt").write_text("from before")
    run_convert(sources["tiny"], out, force=True)
    assert not (out / "stale.txt").exists() and (out / TRACKER).read_text() == "release"
    assert_matches_reference(mh.read_dcp(out), mh.reference_mcore(sources["tiny"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("part, prefix, option", [("mtp", "mtp.", "--no-mtp"),
                                                  ("vision", "vision_model.", "--no-vision")])


def test_left_out_part_is_absent_and_the_summary_says_so(part: str, prefix: str, option: str,
                                                         sources: dict[str, Path], tmp_path: Path) -> None:
    src, out = sources["cut8"], tmp_path / "out"
    n_layers = json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"]
    hf_part = [n for n in source_names(src) if (n.startswith("model.visual.") if part == "vision" else
                                                 n.startswith(f"model.language_model.layers.{n_layers}."))]
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), option])
    assert result.exit_code == 0, result.output
    assert f"left out by request: {part} ({len(hf_part):,} HF tensors)" in result.output
    got = mh.read_dcp(out)
    assert not [n for n in got if n.startswith(prefix)]
    assert_matches_reference(got, mh.reference_mcore(src, mtp=part != "mtp", vision=part != "vision"))
    manifest = json.loads((out / "glmconv.json").read_text())
    assert manifest["left_out"] == {part: len(hf_part)} and manifest[part] is False
    audit = CliRunner().invoke(cli, ["audit-names", str(out)])  # the output against its own (reduced) plan
    assert audit.exit_code == 0, audit.output
    both = CliRunner().invoke(cli, ["audit-names", str(src), "--against", str(out), option, "--json"])
    assert both.exit_code == 0, both.output  # the flag describes the output; the part is left out of the comparison
    unflagged = json.loads(CliRunner().invoke(cli, ["audit-names", str(src), "--against", str(out), "--json"]).output)
    assert {(f["kind"], f["side"]) for f in unflagged["findings"]} == {("missing", "against")}
    assert len(unflagged["findings"]) == len(mh.reference_mcore(src)) - len(got)  # each left-out tensor, by name


def test_dry_run_json_reports_each_worker_and_writes_nothing(sources: dict[str, Path], tmp_path: Path) -> None:
    src, out = sources["cut8"], tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), "--dry-run", "--json", "--workers", "2",
                                      "--group-size", "1MB"])
    assert result.exit_code == 0, result.output
    s = json.loads(result.output)
    want = mh.reference_mcore(src)
    assert s["hf_tensors"] == len(source_names(src)) and s["bytes_in"] == source_bytes(src)
    assert s["mcore_tensors"] == len(want)
    assert s["bytes_out"] == sum(t.numel() * t.element_size() for t in want.values())
    assert [w["rank"] for w in s["workers"]] == [0, 1]
    assert sum(w["bytes_in"] for w in s["workers"]) == s["bytes_in"]
    assert all(w["mappings"] > 0 and w["bytes_in"] > 0 for w in s["workers"])
    assert all(0 <= w["peak_bytes_estimate"] < 10**6 + 2 * s["bytes_in"] for w in s["workers"])  # 0: bytes only move
    assert list(tmp_path.iterdir()) == []


def test_dry_run_peak_counts_only_what_is_computed_in_memory(sources: dict[str, Path], tmp_path: Path) -> None:
    """A BF16 source is copied file to file (only F32-kept tensors stored BF16 are cast); FP8 is dequantised."""
    def workers(fixture: str) -> list[dict[str, int]]:
        res = CliRunner().invoke(cli, ["convert", str(sources[fixture]), str(tmp_path / fixture), "--dry-run",
                                       "--json", "--group-size", "1MB"])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)["workers"]

    (bf16,), (fp8,) = workers("cut8"), workers("tiny-fp8")
    assert bf16["peak_bytes_estimate"] < 0.3 * bf16["bytes_in"]  # the F32-kept set is ~20% of bytes at cut8 dims
    assert fp8["peak_bytes_estimate"] > 0.5 * fp8["bytes_in"]  # dequantised BF16 is held, one group at a time


def test_audit_names_against_the_output_is_clean(sources: dict[str, Path], converted: dict[str, Path]) -> None:
    for name in ("tiny", "tiny-fp8", "cut8"):
        result = CliRunner().invoke(cli, ["audit-names", str(sources[name]), "--against", str(converted[name])])
        assert result.exit_code == 0, f"{name}: {result.output}"


# ---- refusals -----------------------------------------------------------------------------------------

def drop_tensor(src: Path, dst: Path, name: str) -> None:
    """A copy of `src` with `name` removed from its shard and from the index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = dst / index["weight_map"].pop(name)
    with safe_open(str(shard), framework="pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != name}
        meta = f.metadata()
    save_file(kept, str(shard), metadata=meta)
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("fixture, dropped", [
    ("tiny", "model.language_model.layers.3.mlp.experts.5.up_proj.weight"),
    ("tiny-fp8", "model.language_model.layers.3.self_attn.q_b_proj.weight_scale_inv"),
])


def test_source_with_a_dropped_tensor_is_refused_before_anything_is_written(
        fixture: str, dropped: str, sources: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "src"
    drop_tensor(sources[fixture], src, dropped)
    before = checksums(src)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out)])
    assert result.exit_code != 0
    assert dropped in result.output and "Traceback" not in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "no OUT, no staging directory"
    assert checksums(src) == before


@pytest.mark.parametrize("fixture", ["tiny", "tiny-fp8"])
@pytest.mark.parametrize("zero_copy", [True, False], ids=["copied-by-the-kernel", "read-into-memory"])
def test_a_source_shard_truncated_mid_convert_is_named_not_the_output(fixture: str, zero_copy: bool,
                                                                      sources: dict[str, Path], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25: the shard shrinks after the audit (another process rewrites it): the error names the input."""
    from glmconv.io.byte_copy import FileCopier
    from glmconv.runners import convert as convert_mod

    src = tmp_path / "src"
    shutil.copytree(sources[fixture], src)
    job = convert_mod.prepare(src, tmp_path / "out")
    shard = sorted(src.glob("model-*.safetensors"))[0]
    opened = FileCopier._open

    def shrinking(self: FileCopier, path: Path) -> int:
        if Path(path).resolve() == shard.resolve():
            os.truncate(shard, min(shard.stat().st_size, 4096))
        return opened(self, path)

    monkeypatch.setattr(FileCopier, "_open", shrinking)
    if not zero_copy:
        monkeypatch.setattr(convert_mod, "byte_layout", lambda m, source: None)
    # the copy or the NaN scan finds the short file, or a reader thread re-reads the header it cut: the input is named
    with pytest.raises(GlmconvError, match=rf"^(.*/)?{re.escape(shard.name)}: (ends before byte \d+|corrupt header)"):
        convert_mod.convert(job, convert_mod.RunOptions(progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]

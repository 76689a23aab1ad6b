"""Checkpoints written by transformers' own `save_pretrained` convert, export and round-trip.

A BF16 save keeps `q/k/v_conv1d` in F32 (transformers keeps modules matching "conv1d" in fp32) and drops the MTP
layer; an F32 save stores everything F32; a small model is one `model.safetensors` without an index unless
`max_shard_size` splits it. `--dtype keep` gives Megatron what was stored, so each round trip is bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.hf_helpers import save_with_transformers
from safetensors import safe_open

from glmconv.io.file_names import INDEX_NAME, MANIFEST_NAME, SINGLE_NAME
from glmconv.io.torch_dist.metadata import inspect_torch_dist
from glmconv.runners import convert as convert_mod
from glmconv.runners import export as export_mod

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CONV = "model.language_model.layers.0.self_attn.q_conv1d.weight"
Q_PROJ = "model.language_model.layers.0.self_attn.q_proj.weight"
HC_FN = "model.language_model.layers.0.hc_attn_fn"
MC_CONV, MC_Q = "decoder.layers.0.self_attention.kda.conv1d.weight", "decoder.layers.0.self_attention.kda.q_proj.weight"


def _convert(src: Path, out: Path, dtype: str = "keep") -> dict[str, Any]:
    job = convert_mod.prepare(src, out, dtype=dtype)
    return convert_mod.convert(job, convert_mod.RunOptions(progress=False))


def _export(mc: Path, out: Path, **kw: Any) -> dict[str, Any]:
    job = export_mod.prepare(mc, out, max_shard_bytes=300_000, **kw)
    return export_mod.export(job, export_mod.ExportOptions(progress=False))


def _raw(ckpt: Path) -> dict[str, tuple[str, bytes]]:
    """Every tensor's safetensors dtype and raw bytes, read with safetensors itself."""
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = (f.get_slice(name).get_dtype(), t.contiguous().view(-1).view(dtype=_u8()).numpy().tobytes())
    return out


def _tensor(ckpt: Path, name: str) -> Any:
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(name)


def _u8() -> Any:
    import torch

    return torch.uint8


def _mcore_dtypes(mc: Path) -> dict[str, str]:
    return {n: t.dtype for n, t in inspect_torch_dist(mc).tensors.items()}


@pytest.fixture(scope="module")
def saved(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("transformers")
    return {"bf16": save_with_transformers(tiny_ckpt, root / "bf16", "bfloat16"),
            "fp32": save_with_transformers(tiny_ckpt, root / "fp32", "float32"),
            "sharded": save_with_transformers(tiny_ckpt, root / "sharded", "bfloat16", max_shard_size="200KB")}


@pytest.fixture(scope="module")
def bf16_mc(saved: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("mc") / "bf16"
    return out, _convert(saved["bf16"], out)


def test_a_bf16_save_is_one_file_with_f32_conv1d_and_no_mtp(saved: dict[str, Path]) -> None:
    raw = _raw(saved["bf16"])
    assert sorted(p.name for p in saved["bf16"].iterdir()) == ["config.json", "generation_config.json", SINGLE_NAME]
    assert (raw[CONV][0], raw[Q_PROJ][0], raw[HC_FN][0], len(raw)) == ("F32", "BF16", "BF16", 197)


def test_a_bf16_save_converts_with_conv1d_kept_f32_in_megatron(bf16_mc: tuple[Path, dict[str, Any]]) -> None:
    mc, summary = bf16_mc
    assert (_mcore_dtypes(mc)[MC_CONV], _mcore_dtypes(mc)[MC_Q]) == ("F32", "BF16")
    assert (summary["dtype"], summary["narrowed_f32_to_bf16"], summary["mtp"], summary["vision"]) == (
        "keep", 0, False, True)
    assert summary["widened_bf16_to_f32"] == 9  # hc_attn_fn and hc_ffn_fn of 4 layers, 1 kpool ape: F32 state


def test_a_bf16_save_round_trips_bit_exact_without_like(saved: dict[str, Path], bf16_mc: tuple[Path, dict[str, Any]],
                                                       tmp_path: Path) -> None:
    summary = _export(bf16_mc[0], tmp_path / "hf")
    assert _raw(tmp_path / "hf") == _raw(saved["bf16"])
    assert (summary["dtypes_from"], summary["sidecars_from"], summary["sidecars"]) == (
        "converted checkpoint", "converted checkpoint", ["generation_config.json"])
    assert (tmp_path / "hf" / "generation_config.json").read_bytes() == (
        saved["bf16"] / "generation_config.json").read_bytes()


def test_an_fp32_save_converts_to_f32_megatron_and_round_trips_bit_exact(saved: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    summary = _convert(saved["fp32"], tmp_path / "mc")
    assert set(_mcore_dtypes(tmp_path / "mc").values()) == {"F32"} and summary["narrowed_f32_to_bf16"] == 0
    _export(tmp_path / "mc", tmp_path / "hf")
    assert _raw(tmp_path / "hf") == _raw(saved["fp32"])


def test_dtype_bf16_rounds_an_fp32_save_says_how_many_and_export_writes_f32_again(saved: dict[str, Path],
                                                                                   tmp_path: Path) -> None:
    import torch

    summary = _convert(saved["fp32"], tmp_path / "mc", dtype="bf16")
    assert (summary["dtype"], summary["narrowed_f32_to_bf16"]) == ("bf16", 164)
    assert (_mcore_dtypes(tmp_path / "mc")[MC_CONV], _mcore_dtypes(tmp_path / "mc")[MC_Q]) == ("BF16", "BF16")
    _export(tmp_path / "mc", tmp_path / "hf")
    q, src = _tensor(tmp_path / "hf", Q_PROJ), _tensor(saved["fp32"], Q_PROJ)
    assert q.dtype == torch.float32 and torch.equal(q, src.bfloat16().float())  # the rounded values, widened


def test_dtype_fp32_widens_a_bf16_save_and_export_writes_bf16_again(saved: dict[str, Path], tmp_path: Path) -> None:
    summary = _convert(saved["bf16"], tmp_path / "mc", dtype="fp32")
    assert set(_mcore_dtypes(tmp_path / "mc").values()) == {"F32"} and summary["narrowed_f32_to_bf16"] == 0
    _export(tmp_path / "mc", tmp_path / "hf")
    assert _raw(tmp_path / "hf") == _raw(saved["bf16"])


def test_a_sharded_save_converts_and_round_trips_bit_exact(saved: dict[str, Path], tmp_path: Path) -> None:
    index = json.loads((saved["sharded"] / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) == 5
    _convert(saved["sharded"], tmp_path / "mc")
    _export(tmp_path / "mc", tmp_path / "hf")
    assert _raw(tmp_path / "hf") == _raw(saved["sharded"]) == _raw(saved["bf16"])


def test_the_source_dtype_record_is_compact(bf16_mc: tuple[Path, dict[str, Any]]) -> None:
    record = json.loads((bf16_mc[0] / MANIFEST_NAME).read_text())["hf_dtypes"]
    assert record["exceptions"] == {}
    assert record["defaults"]["{layer}self_attention.kda.conv1d.weight"] == "F32"
    assert record["defaults"]["{layer}self_attention_hyper_connection.mapping_proj.weight"] == "BF16"
    assert len((bf16_mc[0] / MANIFEST_NAME).read_bytes()) < 8192

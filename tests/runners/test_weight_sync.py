"""The weight-sync API (`glmconv.hf_weights`): Megatron parameters in any order -> export's HF tensors, bit for bit;
unknown names, duplicates, wrong shapes and incomplete groups are refused with one line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import glmconv
from glmconv.io.safetensors.checkpoint import inspect_hf_checkpoint
from glmconv.io.safetensors.header import read_header
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.plan import build_plan
from glmconv.rules import roles as R
from glmconv.rules.ops import SplitVector
from glmconv.weight_sync import WeightSync

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _raw(ckpt: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor's dtype, shape and data bytes, straight from the shard files."""
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        header, data = read_header(shard), shard.read_bytes()
        for e in header.entries.values():
            out[e.name] = (e.dtype, tuple(e.shape), data[header.data_start + e.begin:header.data_start + e.end])
    return out


def _as_raw(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    from glmconv.io.dtypes import torch_dtype_code

    return {n: (torch_dtype_code(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for n, t in tensors.items()}


def _shuffled_params(mc: Path, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    reader = DcpReader(mc)
    params = [(n, reader.read(n)) for n in reader.names()]
    random.Random(seed).shuffle(params)
    return params


def _collect(stream: object) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in stream:  # type: ignore[attr-defined]
        assert name not in out, f"{name} yielded twice"
        out[name] = tensor.clone()
    return out


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tiny_fp8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sync")
    glmconv.convert(tiny_ckpt, root / "mc")
    glmconv.convert(tiny_fp8_ckpt, root / "mc-fp8")
    return {"bf16": root / "mc", "fp8": root / "mc-fp8"}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_shuffled_parameters_give_exports_tensors_bit_for_bit(converted: dict[str, Path], tmp_path: Path,
                                                              fp8: bool) -> None:
    mc = converted["fp8" if fp8 else "bf16"]
    glmconv.export(mc, tmp_path / "hf", fp8=fp8)
    exported = _raw(tmp_path / "hf")
    dtypes = {n: t.dtype for n, t in inspect_hf_checkpoint(tmp_path / "hf").tensors.items()}  # the engine's
    got = _collect(glmconv.hf_weights(_shuffled_params(mc, seed=7), mc / "config.json", fp8=fp8, dtypes=dtypes))
    assert _as_raw(got) == exported


def test_a_torch_dist_directory_streams_exports_tensors(converted: dict[str, Path], tmp_path: Path) -> None:
    glmconv.export(converted["bf16"], tmp_path / "hf")
    assert _as_raw(_collect(glmconv.hf_weights(converted["bf16"]))) == _raw(tmp_path / "hf")


def test_hc_scale_waits_for_its_three_alphas_in_any_order(converted: dict[str, Path]) -> None:
    plan = build_plan(glmconv.load_config(converted["bf16"]))
    m = next(m for m in plan.mappings if isinstance(m.rule.transform, SplitVector))
    sync, alphas = WeightSync(plan), [torch.tensor([float(i + 1)]) for i in range(3)]
    assert list(sync.push(m.mcore[2].name, alphas[2])) == []
    assert list(sync.push(m.mcore[0].name, alphas[0])) == []
    ((name, scale),) = list(sync.push(m.mcore[1].name, alphas[1]))
    assert name == m.hf[0].name and scale.tolist() == [1.0, 2.0, 3.0]
    sync.close()


def test_an_incomplete_group_is_named_at_the_end(converted: dict[str, Path]) -> None:
    plan = build_plan(glmconv.load_config(converted["bf16"]))
    m = next(m for m in plan.mappings if isinstance(m.rule.transform, SplitVector))
    params = [(m.mcore[0].name, torch.ones(1)), (m.mcore[2].name, torch.ones(1))]
    with pytest.raises(glmconv.GlmconvError) as exc:
        list(glmconv.hf_weights(params, plan.config))
    assert str(exc.value) == (f"{m.mcore[1].name}: never pushed, so {m.hf[0].name} is incomplete "
                              f"(pushed: {m.mcore[0].name}, {m.mcore[2].name})")


def test_unknown_duplicate_and_misshapen_parameters_are_refused(converted: dict[str, Path]) -> None:
    cfg = glmconv.load_config(converted["bf16"])
    vocab = {m.mcore[0].name for m in build_plan(cfg).mappings if m.rule.role in (R.EMBED, R.LM_HEAD)}
    name, tensor = next(p for p in _shuffled_params(converted["bf16"]) if p[1].dim() == 2 and p[0] not in vocab)
    rows, cols = tensor.shape
    cases = {
        "decoder.layers.0.mystery.weight: not a Megatron parameter of this model (no rule maps it)":
            [("decoder.layers.0.mystery.weight", tensor)],
        f"{name}: pushed twice": [(name, tensor), (name, tensor)],
        f"{name}: {[rows + 1, cols]} in the pushed parameters, the plan says {[rows, cols]}":
            [(name, torch.zeros(rows + 1, cols, dtype=tensor.dtype))],
        f"{name}: expected a floating-point tensor, got Tensor of torch.int64":
            [(name, torch.zeros(tensor.shape, dtype=torch.int64))],
    }
    for message, bad in cases.items():
        with pytest.raises(glmconv.GlmconvError) as exc:
            list(glmconv.hf_weights(bad, cfg))
        assert str(exc.value) == message


def test_a_padded_vocabulary_loses_its_extra_rows_and_extra_state_is_skipped(converted: dict[str, Path]) -> None:
    plan = build_plan(glmconv.load_config(converted["bf16"]))
    m = plan.mappings[0]
    assert m.rule.role == R.EMBED
    rows, hidden = m.mcore[0].shape
    padded = torch.randn(rows + 64, hidden).to(torch.bfloat16)
    out = dict(glmconv.hf_weights([(m.mcore[0].name, padded), ("output_layer._extra_state", torch.zeros(3))],
                                  plan.config))
    assert list(out) == [m.hf[0].name] and torch.equal(out[m.hf[0].name], padded[:rows])


def test_parameters_named_in_the_mcore_layout_give_the_same_hf_tensors(converted: dict[str, Path], tiny_ckpt: Path,
                                                                       tmp_path: Path) -> None:
    glmconv.convert(tiny_ckpt, tmp_path / "mc", layout="mcore")
    glmconv.export(converted["bf16"], tmp_path / "hf")
    dtypes = {n: t.dtype for n, t in inspect_hf_checkpoint(tmp_path / "hf").tensors.items()}
    params = _shuffled_params(tmp_path / "mc", seed=3)
    assert any(n.startswith("glmconv_kept.") for n, _ in params)
    got = _collect(glmconv.hf_weights(params, tmp_path / "mc" / "config.json", dtypes=dtypes, layout="mcore"))
    assert _as_raw(got) == _raw(tmp_path / "hf")
    with pytest.raises(glmconv.GlmconvError, match="not a Megatron parameter of this model"):
        _collect(glmconv.hf_weights(params, tmp_path / "mc" / "config.json", dtypes=dtypes))  # read as miles

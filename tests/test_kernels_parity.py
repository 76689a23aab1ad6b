"""The kernel hooks of the model and of parity, on the CPU: `--kernels auto` means the references off CUDA,
and a train side that runs kernels gets per-sub-block kernel error rows (here with a reference twin: 0)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from glmconv.errors import GlmconvError
from glmconv.kernels import op_set


def _model(hf: Path, kernels: str = "auto"):  # type: ignore[no-untyped-def]
    from glmconv.io.config_file import load_config
    from glmconv.models.conventions import Conventions
    from glmconv.models.model import GlmModel
    from glmconv.models.weights import HfWeights

    return GlmModel(load_config(hf), HfWeights(hf), Conventions.serve(), kernels=kernels)


def test_auto_is_the_reference_off_cuda(tiny_ckpt: Path) -> None:
    m = _model(tiny_ckpt)
    assert m.ops.name == "reference" and m.kernel_twin() is None
    assert op_set("reference", torch.device("cuda"), 19).name == "reference"
    with pytest.raises(GlmconvError, match="--kernels"):
        op_set("fast", torch.device("cpu"), 19)


@torch.no_grad()
def test_kernel_error_rows_in_capture_and_report(tiny_ckpt: Path) -> None:
    from rich.console import Console

    from glmconv.compare import ParityOptions
    from glmconv.compare.capture import capture
    from glmconv.compare.inputs import random_batch
    from glmconv.compare.report import build_report, print_table, to_markdown

    serve, train, twin = _model(tiny_ckpt), _model(tiny_ckpt), _model(tiny_ckpt, "reference")
    train.record_out = twin.record_out = True
    batch = random_batch(512, 64, 2, 0)
    cap = capture(serve, train, batch, "propagated", twin=twin)
    attn = [r for r in cap.layers if r["sub_block"] == "attention"]
    assert all(r["kernel_rel_err"] == 0.0 and r["kernel_out_rel_err"] == 0.0 for r in attn)
    assert [r["kernel_topk_overlap"] for r in attn if "topk_overlap" in r] == [1.0]
    assert not any("kernel_rel_err" in r for r in cap.layers if r["sub_block"] == "mlp")
    opts = ParityOptions(hf_dir=tiny_ckpt, mcore_dir=tiny_ckpt, tokens=64, sequences=2)
    report = build_report(cap, opts, batch, {"serve": {}, "train": {}})
    assert report["kernels"] == "kernels"
    buf = io.StringIO()
    print_table(report, Console(file=buf, width=200))
    assert "kernel err" in buf.getvalue() and "largest kernel error" in buf.getvalue()
    assert "kernel err |" in to_markdown(report)


@torch.no_grad()
def test_one_forward_code_with_a_kernel_op_set(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's kernel path on the CPU: the triton indexer (interpreted here, int32 ids padded to the
    attention kernel's width) feeding the DSA layers, the twin on the references, and parity's kernel rows.
    (fla's and tilelang's kernels need a GPU: tests/gpu.)"""
    pytest.importorskip("triton")
    import os
    from functools import partial

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton runs on the CPU only under TRITON_INTERPRET=1 (set by tests/conftest.py)")
    import glmconv.models.model as model_mod
    from glmconv.compare.capture import capture
    from glmconv.compare.inputs import random_batch
    from glmconv.kernels import OpSet, reference_ops
    from glmconv.kernels.kpool import kpool_topk

    ref = reference_ops()
    fake = OpSet("kernels", ref.kda_layer, partial(kpool_topk, width=64, dtype=torch.int32), ref.sparse_mla)
    monkeypatch.setattr(model_mod, "op_set", lambda kernels, device, width: fake if kernels == "auto" else ref)
    serve, train = _model(tiny_ckpt, "reference"), _model(tiny_ckpt, "auto")
    twin = train.kernel_twin()
    assert train.ops is fake and twin is not None and twin.ops is ref
    batch = random_batch(512, 96, 2, 0)
    cap = capture(serve, train, batch, "isolated", twin=twin)
    dsa = [r for r in cap.layers if r.get("attn_type") == "dsa" and r["sub_block"] == "attention"]
    # 4 index heads: a pool whose 4 relu terms are all 0 scores exactly 0, so exact ties at the top-k boundary
    # are common here and torch.topk breaks them its own way on each side (measured overlap 0.996)
    assert dsa and all(r["kernel_topk_overlap"] > 0.98 for r in dsa)
    assert all(r["kernel_rel_err"] < 5e-2 for r in cap.layers if "kernel_rel_err" in r)
    kda = [r for r in cap.layers if r.get("attn_type") == "kda" and r["sub_block"] == "attention"]
    assert kda and all(r["kernel_rel_err"] == 0.0 for r in kda)  # the same reference KDA on both sides

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
    from glmconv.config import load_config
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

    from glmconv.parity import ParityOptions
    from glmconv.parity.capture import capture
    from glmconv.parity.inputs import random_batch
    from glmconv.parity.report import build_report, print_table, to_markdown

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

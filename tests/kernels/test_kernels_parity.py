"""The kernel hooks of the model and of parity, on the CPU: `--kernels auto` means the references off CUDA,
and a train side that runs a kernel path gets each kernel call checked against its reference (emulated: 0)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from glmconv.errors import GlmconvError
from glmconv.kernels import op_set
from glmconv.models.conventions import Conventions, Sides


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
def test_kernel_check_rows_in_capture_and_report(tiny_ckpt: Path) -> None:
    from rich.console import Console

    from glmconv.compare import ParityOptions, kernel_path
    from glmconv.compare.capture import capture
    from glmconv.compare.inputs import random_batch
    from glmconv.compare.report import build_report, print_table, to_markdown

    serve, train = _model(tiny_ckpt), _model(tiny_ckpt, "emulated")
    twin = kernel_path(train)
    batch = random_batch(512, 64, 2, 0)
    cap = capture(serve, train, batch, "propagated", twin=twin)
    attn = [r for r in cap.layers if r.sub_block == "attention"]
    checks = [list(r.kernels or ()) for r in attn]
    assert [[c.op for c in row] for row in checks] == [["short_conv", "kda_core"]] * 3 + [["indexer", "sparse_mla"]]
    assert all(c.rel_err == 0.0 and c.bias == 0.0 for row in checks for c in row if c.op != "indexer")
    assert [c.mismatch for row in checks for c in row if c.op == "indexer"] == [0.0]
    assert all(r.kernel_rel_err == 0.0 and r.kernels_within for r in attn)
    assert not any(r.kernels is not None for r in cap.layers if r.sub_block == "mlp")
    opts = ParityOptions(hf_dir=tiny_ckpt, mcore_dir=tiny_ckpt, tokens=64, sequences=2)
    report = build_report(cap, opts, batch, Sides(Conventions.serve(), Conventions.serve()))
    assert report["kernels"] == "kernels"
    buf = io.StringIO()
    print_table(report, Console(file=buf, width=200))
    assert "kernel" in buf.getvalue() and "every call within its bound" in buf.getvalue()
    assert "| kernel |" in to_markdown(report)


@torch.no_grad()
def test_one_forward_code_with_a_kernel_op_set(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's kernel path on the CPU: the triton indexer (interpreted here, int32 ids padded to the
    attention kernel's width) feeding the DSA layers, checked against the reference indexer on the same input.
    (fla's and tilelang's kernels need a GPU: tests/gpu.)"""
    pytest.importorskip("triton")
    import os
    from dataclasses import replace
    from functools import partial

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton runs on the CPU only under TRITON_INTERPRET=1 (set by tests/conftest.py)")
    import glmconv.models.model as model_mod
    from glmconv.compare import kernel_path
    from glmconv.compare.capture import capture
    from glmconv.compare.inputs import random_batch
    from glmconv.kernels import emulated_ops, reference_ops
    from glmconv.kernels.kpool import kpool_topk

    ref = reference_ops()
    fake = replace(emulated_ops(), indexer=partial(kpool_topk, width=64, dtype=torch.int32))
    monkeypatch.setattr(model_mod, "op_set", lambda kernels, device, width: fake if kernels == "auto" else ref)
    serve, train = _model(tiny_ckpt, "reference"), _model(tiny_ckpt, "auto")
    twin = kernel_path(train)
    assert train.ops is fake and twin is not None and twin.ops is ref
    batch = random_batch(512, 96, 2, 0)
    cap = capture(serve, train, batch, "isolated", twin=twin)
    dsa = [r for r in cap.layers if r.attn_type == "dsa" and r.sub_block == "attention"]
    # 4 index heads: a pool whose 4 relu terms are all 0 scores exactly 0, so exact ties at the top-k boundary are
    # common here and torch.topk breaks them its own way on each side: the set overlap shows them, the tie-aware
    # mismatch does not count them
    checks = [c for r in dsa for c in r.kernels or () if c.op == "indexer"]
    assert checks and all((c.overlap or 0) > 0.98 and c.mismatch == 0.0 and c.within for c in checks)
    assert all(r.kernels_within for r in cap.layers if r.kernels is not None)


def test_the_kernel_path_imports_its_packages_without_a_warning() -> None:
    """`--kernels auto` on CUDA imports fla, tilelang's SparseMLA and megatron-core up front; their import-time
    warnings (megatron-core: no Transformer Engine, no Apex) stay off the user's terminal (the H100 run of
    2026-12-06 printed ten lines of them). A fresh interpreter: the imports are the first."""
    import os
    import subprocess
    import sys

    code = "from glmconv.kernels import kernel_ops; print(kernel_ops(64).name)"
    got = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True,
                         env={**os.environ, "GLMCONV_FLA": "1"}, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == "kernels"
    assert got.stderr == ""

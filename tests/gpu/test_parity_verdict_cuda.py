"""The calibrated verdict on CUDA with the kernels on the train side: an aligned pair passes in both dtypes and
modes with its fp32 reference twins equal bit for bit (the reference path is deterministic there too) and every
real kernel within its bound, and every planted defect of the catalog is named, the kernel-path ones (planted in
the real kernels' calls) with cause `kernel`. Skips cleanly without CUDA. The fixture is the default (realistic) tiny:
at --init unit the proj-RMS eps form and the SwiGLU clamp change nothing, so two catalog entries would be invisible
(the unit fixtures of test_parity_cuda.py avoid CPU-vs-CUDA tie breaks, which never arise here: both sides and
their twins run on the one device). GLMCONV_GPU_FIXTURES=DIR hands in DIR/hf-tiny-realistic and its conversion
DIR/mc-tiny-realistic pre-made (the generator needs transformers' Glm5Next classes)."""

from __future__ import annotations

from pathlib import Path

import gpu_pairs
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return gpu_pairs.tiny_pair(tmp_path_factory, "tiny-realistic", init="realistic")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["isolated", "propagated"])
def test_aligned_pair_with_kernels_passes_and_the_catalog_is_named(tiny_pair: tuple[Path, Path], dtype: str,
                                                                   mode: str) -> None:
    from glmconv.compare import ParityOptions, run_parity

    hf, mc = tiny_pair
    r = run_parity(ParityOptions(hf_dir=hf, mcore_dir=mc, tokens=128, sequences=2, device="cuda", dtype=dtype,
                                 mode=mode, train_conventions="serve", self_test=True, progress=False))
    assert r["kernels"] == "kernels" and r["noise_measured"]
    assert r["first_divergence"] is None, r["first_divergence"]
    assert all(rec["ref_rel_err"] == 0.0 and rec["weights"] == "equal" for rec in r["layers"])
    checks = [c for rec in r["layers"] if rec["sub_block"] == "attention" for c in rec["kernels"]]
    assert {c["op"] for c in checks} == {"short_conv", "kda_core", "indexer", "sparse_mla"}
    assert [c for c in checks if not c["within"]] == []  # the real kernels within their bounds at tiny dims too
    assert [row["defect"] for row in r["self_test"] if not row["named"]] == []
    kernel_rows = [row for row in r["self_test"] if row["kind"] == "kernel"]
    assert len(kernel_rows) >= 6 and r["self_test_skipped"] == []
    assert all(row["first_divergence"]["cause"] == "kernel" for row in kernel_rows)

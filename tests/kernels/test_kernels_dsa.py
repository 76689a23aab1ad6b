"""The tilelang SparseMLA path: compile-checked for sm_90 on a CPU machine (nvcc only, no GPU), and the
padding rules of glmconv.kernels.dsa."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from glmconv.kernels import dsa

COMPILE = """
import os
os.environ["TILELANG_DEFAULT_TARGET"] = '{"kind": "cuda", "arch": "sm_90"}'
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_fwd as f
k = f._get_sparse_mla_fwd_kernel(64, 512, 64, 2112, 1, 1 / 16, 64, 2, 256)
src = k.get_kernel_source()
assert "__global__" in src, src[:200]
print("compiled", len(src))
"""


def test_padding_rules() -> None:
    assert dsa.index_width(2051) == 2112 and dsa.index_width(64) == 64 and dsa.index_width(19) == 64
    assert [dsa.padded_heads(h) for h in (1, 4, 16, 17, 64, 128)] == [16, 16, 16, 32, 64, 128]
    ids = torch.tensor([[3, -1, 0], [1, 2, -1]])
    k = dsa.kernel_indices(ids)
    assert k.dtype == torch.int32 and k.shape == (2, 64) and k.is_contiguous()
    assert k[:, :3].tolist() == ids.tolist() and bool((k[:, 3:] == -1).all())
    assert dsa.kernel_indices(k) is k  # already in the kernel's form: no copy


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA compiler, no GPU)")
def test_sparse_mla_compiles_for_sm90_at_glm53_shapes() -> None:
    """GLM-5.3's shapes (64 heads, 512 + 64, top-k 2112, sm_scale 1/16), compiled in a child process so the
    tilelang target does not leak into other tests."""
    pytest.importorskip("tilelang")
    env = {**os.environ, "TILELANG_DEFAULT_TARGET": '{"kind": "cuda", "arch": "sm_90"}'}
    r = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-2000:]

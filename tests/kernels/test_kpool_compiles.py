"""The triton kpool kernels compile for sm_90 on a host without a GPU (triton's own front end and ptxas, no device):
the interpreter the CPU tests run them under skips the code generator, which rejects what a GPU run would (a
non-constexpr global such as `typing.Any` in an annotation failed the real-cut4 run on an H100). Each compile runs in
a fresh process without TRITON_INTERPRET: the interpreter, once used, patches triton.language for the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

KERNELS = {  # kernel: (its signature as the wrappers call it, its constexprs at real-cut4's indexer)
    "_pool_kernel": ({"ik": "*bf16", "gate": "*bf16", "ape": "*bf16", "pool_tok": "*i32", "keys": "*fp32",
                      "n_pools": "i32"}, {"D": 128, "KP": 4, "BLOCK_P": 16, "BLOCK_D": 128}),
    "_score_kernel": ({"iq": "*bf16", "keys": "*fp32", "head_w": "*fp32", "lo": "*i32", "hi": "*i32",
                       "scores": "*fp32", "T": "i32", "n_pools": "i32", "scale": "fp32"},
                      {"H": 32, "D": 128, "BLOCK_Q": 32, "BLOCK_P": 64, "BLOCK_D": 128, "PRECISION": "tf32x3"}),
    "_expand_kernel": ({"chosen": "*i64", "pool_tok": "*i32", "lo": "*i32", "hi": "*i32", "krow": "*i32",
                        "tail": "*i32", "out": "*i32", "K": "i32", "width": "i32"},
                       {"KP": 4, "TAIL": True, "BLOCK_K": 512, "BLOCK_C": 4}),
}
COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from glmconv.kernels import kpool
name, args, constexprs = json.loads(sys.argv[1])
signature = {**args, **{k: "constexpr" for k in constexprs}}
compiled = triton.compile(ASTSource(getattr(kpool, name), signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32))
print(compiled.asm["cubin"][:4].hex())
"""


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_to_a_cubin_for_sm90(name: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps([name, *KERNELS[name]])], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == b"\x7fELF".hex()

"""fla on a machine with no GPU: hidden, so that transformers' own Glm5Next runs its torch KDA there.

transformers binds fla's KDA kernels whenever `import fla` succeeds, and those are triton kernels: without a
GPU driver the first forward fails with `RuntimeError: 0 active drivers ([]). There should only be one.`
`install()` puts a finder first on `sys.meta_path` that refuses `import fla` exactly when triton has no active
driver, so transformers falls back to its torch code; where a GPU is, fla imports as usual. The project's
environment installs it at interpreter startup (`make env` writes `glmconv-fla-guard.pth` into the venv's
site-packages); elsewhere call `glmconv.fla_guard.install()` before importing transformers' model.

`GLMCONV_FLA=1` imports fla regardless (its pure-torch references, e.g. `fla.ops.kda.naive`, run on a CPU);
`GLMCONV_FLA=0` hides it everywhere.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

ENV = "GLMCONV_FLA"
PTH_NAME = "glmconv-fla-guard.pth"
# This module alone, not the glmconv package (36 ms of imports at every interpreter start); `import
# glmconv.fla_guard` later finds it in sys.modules. A moved or removed glmconv leaves the line doing nothing.
PTH_LINE = ("import importlib.util as u, sys; p = u.find_spec('glmconv'); s = p and p.submodule_search_locations "
            "and u.spec_from_file_location('glmconv.fla_guard', p.submodule_search_locations[0] + '/fla_guard.py'); "
            "m = s and u.module_from_spec(s); s and (sys.modules.setdefault('glmconv.fla_guard', m), "
            "s.loader.exec_module(m), m.install())\n")


def gpu_driver() -> bool:
    """Whether triton (which every fla kernel runs on) has an active driver, i.e. a GPU it can launch on."""
    try:
        from triton.backends import backends
    except ImportError:  # no triton: no fla kernel can run
        return False
    return any(b.driver.is_active() for b in backends.values())


def fla_hidden() -> bool:
    """Whether `import fla` is refused here: GLMCONV_FLA=0, or no GPU driver and GLMCONV_FLA is not 1."""
    setting = os.environ.get(ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "0"
    return not gpu_driver()


class _FlaFinder(importlib.abc.MetaPathFinder):
    """Refuses the top-level `fla` import where fla's kernels cannot run (every `fla.*` import goes through it)."""

    glmconv_fla_guard = True  # recognised across copies of this module (a venv's lib64 link runs the .pth twice)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname == "fla" and fla_hidden():
            raise ModuleNotFoundError(f"fla is hidden: no GPU driver for its triton kernels here (set {ENV}=1 to "
                                      "import it anyway; glmconv/fla_guard.py)", name="fla")
        return None


def installed() -> bool:
    """Whether the finder is on `sys.meta_path`."""
    return any(getattr(f, "glmconv_fla_guard", False) for f in sys.meta_path)


def install() -> None:
    """Put the finder first on `sys.meta_path` (once); cheap: nothing is imported until something imports fla."""
    if not installed():
        sys.meta_path.insert(0, _FlaFinder())


@contextmanager
def without_loaded_fla() -> Iterator[None]:
    """With the finder installed, also hide an fla already imported (GLMCONV_FLA=1 earlier), then restore it:
    for importing transformers' model, which binds fla's kernels once, at its own import."""
    install()
    if not fla_hidden():
        yield
        return
    saved = {k: sys.modules.pop(k) for k in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]}
    try:
        yield
    finally:
        sys.modules.update(saved)


def write_pth() -> str:
    """Write `glmconv-fla-guard.pth` into this interpreter's site-packages, so every start installs the finder."""

    path = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    path.write_text(PTH_LINE)
    return str(path)


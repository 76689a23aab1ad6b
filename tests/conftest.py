"""Session-wide random checkpoints, built once per test session (per xdist worker) and shared by all tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.report_schema import every_report_follows_the_schema as every_report_follows_the_schema  # autouse
from hypothesis import settings

# Hypothesis profiles (see tests/helpers/fuzzing.py): `ci` by default, so a run never depends on the clock or on a
# local example database; `make fuzz` passes --hypothesis-profile=fuzz for many fresh random examples.
settings.register_profile("ci", derandomize=True, deadline=None, database=None, max_examples=100, print_blob=True)
settings.register_profile("fuzz", derandomize=False, deadline=None, max_examples=2000, print_blob=True)
settings.load_profile("ci")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--write-goldens", action="store_true",
                     help="rewrite fixtures/golden/* from the tests' outputs instead of comparing "
                          "(tests/helpers/goldens.py)")


@pytest.fixture()
def golden(pytestconfig: pytest.Config) -> Callable[[str, str], None]:
    """Compare a rendering with its file in fixtures/golden/ (or rewrite it under --write-goldens)."""
    from helpers.goldens import check

    return lambda name, text: check(name, text, write=bool(pytestconfig.getoption("--write-goldens")))


def pytest_configure(config: pytest.Config) -> None:
    """Without CUDA, transformers' Glm5Next must use its torch KDA (fla's kernels are GPU-only): import it once
    with fla hidden (glmconv/fla_guard.py). Triton's own kernels (glmconv's kpool indexer) then run under its
    interpreter, which must be on before triton loads."""
    import os

    import torch

    from glmconv.defaults import WORKER_MIN_BYTES_ENV
    from glmconv.fixtures.generate import import_transformers_glm5_next

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault(WORKER_MIN_BYTES_ENV, "0")  # the tests' --workers N run N processes on tiny checkpoints
    import_transformers_glm5_next()


def _make(factory: pytest.TempPathFactory, name: str, preset: str, fp8: bool, init: str = "realistic") -> Path:
    from glmconv.fixtures import make_fixture  # torch + transformers: only when a test asks for a checkpoint

    return make_fixture(factory.mktemp("ckpt") / name, preset, fp8=fp8, seed=0, init=init)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset (4 layers + MTP at 4 + vision), BF16/F32, seed 0, the default (realistic) init."""
    return _make(tmp_path_factory, "tiny", "tiny", fp8=False)


@pytest.fixture(scope="session")
def tiny_fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset with the release's FP8 set, seed 0: the same underlying weights as `tiny_ckpt`."""
    return _make(tmp_path_factory, "tiny-fp8", "tiny", fp8=True)


@pytest.fixture(scope="session")
def cut8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `cut8` preset (the real 8-layer schedule, MTP at 8, vision) at toy sizes, BF16/F32, seed 0, realistic."""
    return _make(tmp_path_factory, "cut8", "cut8", fp8=False)


@pytest.fixture(scope="session")
def tiny_unit_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny` with --init unit (residual streams at RMS ~1): for tests that plant one divergence by hand and
    need every other eps and clamp far away."""
    return _make(tmp_path_factory, "tiny-unit", "tiny", fp8=False, init="unit")


@pytest.fixture(scope="module")
def mc_ckpt(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny` converted to torch_dist, once per test module (the bad-input tests break copies of it)."""
    from glmconv.runners import convert as convert_mod

    out = tmp_path_factory.mktemp("bad-input") / "mc"
    convert_mod.convert(convert_mod.prepare(tiny_ckpt, out), convert_mod.RunOptions(progress=False))
    return out


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path | None]]:
    """`mount_tmpfs("size=200k")` mounts a tmpfs under tmp_path; None where mounting is not allowed."""
    mounted: list[Path] = []

    def mount(options: str) -> Path | None:
        d = tmp_path / f"mnt{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)], capture_output=True)
        if r.returncode != 0:
            return None
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)

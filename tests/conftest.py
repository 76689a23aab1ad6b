"""Session-wide random checkpoints, built once per test session (per xdist worker) and shared by all tests."""

from __future__ import annotations

from pathlib import Path

import pytest


def _make(factory: pytest.TempPathFactory, name: str, preset: str, fp8: bool) -> Path:
    from glmconv.fixtures import make_fixture  # torch + transformers: only when a test asks for a checkpoint

    return make_fixture(factory.mktemp("ckpt") / name, preset, fp8=fp8, seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset (4 layers + MTP at 4 + vision), BF16/F32, seed 0."""
    return _make(tmp_path_factory, "tiny", "tiny", fp8=False)


@pytest.fixture(scope="session")
def tiny_fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset with the release's FP8 set, seed 0: the same underlying weights as `tiny_ckpt`."""
    return _make(tmp_path_factory, "tiny-fp8", "tiny", fp8=True)


@pytest.fixture(scope="session")
def cut8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `cut8` preset (the real 8-layer schedule, MTP at 8, vision) at toy sizes, BF16/F32, seed 0."""
    return _make(tmp_path_factory, "cut8", "cut8", fp8=False)

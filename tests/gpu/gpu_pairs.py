"""The tiny HF checkpoint and its conversion for the GPU tests: handed in pre-made (GLMCONV_GPU_FIXTURES=DIR holds
DIR/hf-NAME and DIR/mc-NAME; the generator needs transformers' Glm5Next classes, which the GPU machine lacks) or
made here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def tiny_pair(factory: pytest.TempPathFactory, name: str, init: str) -> tuple[Path, Path]:
    given = os.environ.get("GLMCONV_GPU_FIXTURES")
    if given:
        hf, mc = Path(given) / f"hf-{name}", Path(given) / f"mc-{name}"
        if not (hf / "config.json").is_file() or not mc.is_dir():  # a recipe that carried the wrong set: say so
            pytest.fail(f"GLMCONV_GPU_FIXTURES={given} lacks hf-{name} or mc-{name}: make them with `glmconv fixture "
                        f"make {hf} --preset tiny --init {init}` and `glmconv convert {hf} {mc}`", pytrace=False)
        return hf, mc
    from glmconv.fixtures.generate import make_fixture
    from glmconv.runners.convert import RunOptions, convert, prepare

    d = factory.mktemp("gpu")
    make_fixture(d / "hf", "tiny", seed=0, init=init)
    convert(prepare(d / "hf", d / "mc"), RunOptions(progress=False))
    return d / "hf", d / "mc"

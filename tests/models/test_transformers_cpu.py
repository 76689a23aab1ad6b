"""transformers' own Glm5Next (the serve reference) runs on a CPU in the project's environment, fla installed.

fla's kernels need a GPU driver; glmconv/fla_guard.py (installed at interpreter start by `make env`'s .pth) hides
fla where triton has none, so transformers falls back to its torch KDA instead of failing with
`0 active drivers`. The forward runs in a fresh interpreter with no glmconv import, as a user's script would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glmconv import fla_guard

FORWARD = """
import json, sys, torch
from transformers import AutoModelForImageTextToText
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], dtype=torch.float32)
with torch.no_grad():
    logits = model(input_ids=torch.arange(1, 17).unsqueeze(0)).logits
print(json.dumps({"shape": list(logits.shape), "finite": bool(torch.isfinite(logits).all()),
                  "class": type(model).__name__, "fla": "fla" in sys.modules}))
"""


def _user_env(**extra: str) -> dict[str, str]:
    """The environment a user's shell gives: none of the test session's fla or triton settings."""
    env = {k: v for k, v in os.environ.items() if k not in (fla_guard.ENV, "TRITON_INTERPRET")}
    return {**env, **extra}


def _python(code: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd="/",
                          timeout=300)


@pytest.mark.skipif(fla_guard.gpu_driver(), reason="a GPU is here: fla's kernels run, nothing is hidden")
def test_transformers_glm5_next_forward_runs_on_cpu_in_the_project_environment(tiny_ckpt: Path) -> None:
    got = _python(FORWARD, str(tiny_ckpt), env=_user_env())
    assert got.returncode == 0, got.stderr[-2000:]
    result = json.loads(got.stdout.strip().splitlines()[-1])
    vocab = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]["vocab_size"]
    assert result == {"shape": [1, 16, vocab], "finite": True, "class": "Glm5NextForConditionalGeneration",
                      "fla": False}
    assert "`chunk_kda` is falling back to its reference PyTorch implementation" in got.stderr


@pytest.mark.skipif(fla_guard.gpu_driver(), reason="a GPU is here: fla imports")
def test_import_fla_without_a_gpu_names_the_guard_and_the_setting() -> None:
    got = _python("import fla", env=_user_env())
    assert got.returncode == 1
    assert got.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: fla is hidden: no GPU driver for its triton kernels here (set GLMCONV_FLA=1 to "
        "import it anyway; glmconv/fla_guard.py)")


def test_glmconv_fla_1_imports_fla_without_a_gpu() -> None:
    got = _python("import fla.ops.kda.naive; print('imported')", env=_user_env(GLMCONV_FLA="1"))
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == "imported"


def test_glmconv_fla_0_hides_fla_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fla_guard.ENV, "0")
    assert fla_guard.fla_hidden()


def test_the_guard_is_installed_once_at_interpreter_start() -> None:
    code = "import sys; print(sum(bool(getattr(f, 'glmconv_fla_guard', False)) for f in sys.meta_path))"
    got = _python(code, env=_user_env())
    assert got.stdout.strip() == "1", got.stderr

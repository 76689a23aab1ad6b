"""Golden outputs: the expected text of deterministic renderings, kept in fixtures/golden/ (never inline).

A test calls the `golden` fixture (conftest.py) with a file name and the text it produced. Regenerate after a
deliberate change: `.venv/bin/python -m pytest -q tests --write-goldens` (or the one test), then review the diff.
"""

from __future__ import annotations

import difflib

import pytest

from glmconv.io.output import replace_file
from helpers.repo_files import GOLDEN

REGENERATE = ".venv/bin/python -m pytest -q tests --write-goldens"
DIFF_CHARS = 6000  # enough of the diff to see what moved


def check(name: str, text: str, *, write: bool) -> None:
    """Fail with a unified diff when `text` is not fixtures/golden/`name`; with `write`, replace the file instead."""
    path = GOLDEN / name
    if write:
        replace_file(path, text.encode())  # a link at `path` is replaced, never followed
        return
    if not path.exists():
        pytest.fail(f"no golden fixtures/golden/{name}: run {REGENERATE}", pytrace=False)
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), f"golden/{name}", "now"))
        pytest.fail(f"the output differs from fixtures/golden/{name} (if meant: {REGENERATE}):\n"
                    f"{diff[:DIFF_CHARS]}", pytrace=False)


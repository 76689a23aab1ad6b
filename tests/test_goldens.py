"""tests/goldens.py: a golden comparison fails with a diff naming the file, and --write-goldens rewrites it."""

from __future__ import annotations

from pathlib import Path

import goldens
import pytest


@pytest.fixture()
def golden_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(goldens, "GOLDEN", tmp_path)
    (tmp_path / "out.txt").write_text("a\nb\n")
    return tmp_path


def test_a_changed_output_fails_with_a_unified_diff(golden_dir: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match=r"differs from fixtures/golden/out.txt[\s\S]*-b\n\+c"):
        goldens.check("out.txt", "a\nc\n", write=False)


def test_a_missing_golden_fails_saying_how_to_make_it(golden_dir: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="no golden fixtures/golden/new.txt: run .* --write-goldens"):
        goldens.check("new.txt", "x\n", write=False)


def test_write_replaces_the_golden_and_then_it_matches(golden_dir: Path) -> None:
    goldens.check("out.txt", "a\nc\n", write=True)
    assert (golden_dir / "out.txt").read_text() == "a\nc\n"
    goldens.check("out.txt", "a\nc\n", write=False)

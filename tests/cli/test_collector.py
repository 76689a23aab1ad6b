"""The CLI's process keeps its long-lived objects out of the collector's passes; a library caller's heap is its own."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import gc, sys
from glmconv import collector, phases
print(gc.get_freeze_count())
collector.settle()
print(gc.get_freeze_count())
if sys.argv[1] == "cli":
    collector.cli_process()
    print(gc.get_freeze_count())
    phases.import_torch()
    print(gc.get_freeze_count())
"""


def _freeze_counts(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300,
                          check=True)
    return [int(line) for line in done.stdout.split()]


def test_a_library_callers_objects_are_never_frozen() -> None:
    assert _freeze_counts("library") == [0, 0]


def test_the_cli_process_freezes_its_imports_and_then_torchs() -> None:
    before, settled, cli, with_torch = _freeze_counts("cli")
    assert (before, settled) == (0, 0)
    assert cli > 1000  # glmconv's and the interpreter's own objects
    assert with_torch > cli + 50_000  # torch's modules: about 200,000 objects

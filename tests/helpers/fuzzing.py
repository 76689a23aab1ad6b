"""Hypothesis settings shared by the fuzz tests: example counts scale with the selected profile.

tests/conftest.py registers two profiles. `ci` (the default, and what `make test` runs) is derandomized: the
same tree always draws the same examples, so it always passes or always fails. `fuzz` (`make fuzz`) draws
fresh random examples, 20 times as many. A test asks for `fuzz(n)`: n examples under `ci`.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings

CI_EXAMPLES = 100  # max_examples of the `ci` profile: the unit the fuzz profile is measured in


def examples(n: int) -> int:
    """`n` examples under `ci`, n * 20 under `fuzz` (the profile's max_examples / CI_EXAMPLES)."""
    return max(1, n * settings.default.max_examples // CI_EXAMPLES)


def fuzz(n: int, **kw: Any) -> settings:
    """Settings for a fuzz test of `n` examples (under `ci`); the profile decides derandomize and database."""
    kw.setdefault("suppress_health_check", [HealthCheck.too_slow])
    return settings(max_examples=examples(n), deadline=None, **kw)

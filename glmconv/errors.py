"""The one exception type users see: its message is the single line the CLI prints."""

from __future__ import annotations

from glmconv.text import printable


class GlmconvError(Exception):
    """A user-caused problem (bad input, bad flags, bad checkpoint); the CLI prints it and exits 2.

    The message is made printable here, once, so a name read from a file (a newline, an ANSI escape) can
    never split or recolour the line, whichever code raised it and whoever prints it.
    """

    exit_code = 2

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(printable(str(message)), *args)


class ConfigError(GlmconvError):
    """The config.json is not a GLM-5.3-Flash config or is inconsistent."""


class CheckpointError(GlmconvError):
    """A checkpoint file or directory is missing, malformed or does not match its config."""


class FixtureError(GlmconvError):
    """A fixture cannot be made (unknown preset, output in the way, upstream model disagrees with the plan)."""

"""The one exception type users see: its message is the single line the CLI prints."""


class GlmconvError(Exception):
    """A user-caused problem (bad input, bad flags, bad checkpoint); the CLI prints it and exits 2."""

    exit_code = 2


class ConfigError(GlmconvError):
    """The config.json is not a GLM-5.3-Flash config or is inconsistent."""


class CheckpointError(GlmconvError):
    """A checkpoint file or directory is missing, malformed or does not match its config."""

"""Reading a config.json: the file side of `glmconv.config`, which only parses and validates dicts."""

from __future__ import annotations

from pathlib import Path

from glmconv.config import MAX_CONFIG_BYTES, GlmConfig, parse_config
from glmconv.errors import ConfigError
from glmconv.io.file_names import CONFIG_NAME
from glmconv.io.jsonfile import load_json_file


def load_config(path: str | Path) -> GlmConfig:
    """Read a config.json (file, or a checkpoint directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_NAME
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    raw = load_json_file(p, error=ConfigError, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None

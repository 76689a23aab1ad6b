"""Reading a config.json: the file side of `glmconv.config`, which only parses and validates dicts."""

from __future__ import annotations

from pathlib import Path

from glmconv import arguments as A
from glmconv.config import MAX_CONFIG_BYTES, GlmConfig, parse_config
from glmconv.errors import ConfigError
from glmconv.io.checkpoint_files import holding_hint
from glmconv.io.file_names import CONFIG_NAME
from glmconv.io.jsonfile import load_json_file


@A.keywords_checked
def load_config(path: str | Path) -> GlmConfig:
    """Read a config.json (file, or a checkpoint directory holding one).

    A file that is no config at all (a shard, the index, a .distcp, `.metadata`: not JSON, or JSON without a
    `model_type`) is named as such, with the checkpoint directory holding it; a file called config.json is read
    as one, and what is wrong in it said."""
    A.path("path", path)
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_NAME
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        raw = load_json_file(p, error=ConfigError, max_bytes=MAX_CONFIG_BYTES)
    except ConfigError as exc:
        if p.name == CONFIG_NAME:
            raise
        why = str(exc).removeprefix(f"{p}: ")
        raise _not_a_config(p, "not JSON" if why.startswith("not valid JSON") else why) from None
    if p.name != CONFIG_NAME and not (isinstance(raw, dict) and ("model_type" in raw or "text_config" in raw)):
        raise _not_a_config(p, "no model_type")
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None


def _not_a_config(p: Path, why: str) -> ConfigError:
    """`p`, a file that is no config.json, given where one (or a directory holding one) goes."""
    return ConfigError(f"{p}: not a config.json ({why}); expected a config.json or a checkpoint directory"
                       f"{holding_hint(p)}")

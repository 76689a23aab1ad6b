"""`glmconv megatron-args`: the Megatron-LM model arguments that match a GLM-5.3-Flash config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from glmconv.checkpoint_layout import trained_layout
from glmconv.defaults import ARGS_FORMAT_CHOICES, DEFAULT_ARGS_FORMAT, DEFAULT_LAYOUT, LAYOUT_CHOICES
from glmconv.errors import GlmconvError
from glmconv.io.config_file import load_config
from glmconv.megatron_args import command_line, model_args
from glmconv.text import printable, show
from glmconv_cli.output import echo, echo_json


@click.command("megatron-args")
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--layers", type=int, default=None, help="Only the first N decoder layers (a training cut, e.g. 8).")
@click.option("--format", "fmt", type=click.Choice(ARGS_FORMAT_CHOICES), default=DEFAULT_ARGS_FORMAT, show_default=True,
              help="lines: one '--flag value' per line, unquoted, for a launcher (`$(glmconv megatron-args C)` "
                   "word-splits into the argv); shell: quoted, each line but the last ending in ' \\' (paste into a "
                   "script); json: {flag: value} (true for a bare switch).")


@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("--layout", type=click.Choice(LAYOUT_CHOICES), default=None,
              help="The Megatron layout trained: mcore (megatron-core's native modules) has no MTP module, so no "
              "--mtp-num-layers. Default: CONFIG's own when it is a torch_dist checkpoint (a --layout it "
              f"contradicts is refused), else {DEFAULT_LAYOUT}.")


def megatron_args(config: Path, layers: int | None, fmt: str, as_json: bool, layout: str | None) -> None:
    """Print the Megatron-LM model flags for CONFIG (a config.json or a checkpoint directory holding one).

    KDA, DSA and mHC layer layouts are the training plugin's own settings and are not printed.
    """

    given = click.get_current_context().get_parameter_source("fmt") != click.core.ParameterSource.DEFAULT
    if as_json and given and fmt != "json":
        raise GlmconvError(f"--json is --format json: drop one of --json and --format {fmt}")
    cfg = load_config(config)
    layout = trained_layout(config, cfg, layout)  # a torch_dist checkpoint's own layout (mcore: no MTP module)
    if layers is not None:
        cfg = cfg.cut(layers)
    args = model_args(cfg, layout)
    if as_json or fmt == "json":
        echo_json(args, indent=2)
        return
    lines = command_line(args) if fmt == "shell" else launcher_lines(args)
    for i, line in enumerate(lines):
        echo(printable(line) + (" \\" if fmt == "shell" and i < len(lines) - 1 else ""))


def launcher_lines(args: dict[str, Any]) -> list[str]:
    """One `--flag value` per line, unquoted (a bare `--flag` for a switch): split on whitespace, they are the
    argv words. A value that whitespace would split, or an empty one, is refused: --format shell or json keep it."""
    out = []
    for flag, value in args.items():
        if value is True:
            out.append(flag)
            continue
        text = str(value)
        if not text or text != "".join(text.split()):
            raise GlmconvError(f"{flag} {show(text, quote=True)}: a value with whitespace cannot be one word of "
                               "--format lines; --format shell or --format json keep it whole")
        out.append(f"{flag} {text}")
    return out

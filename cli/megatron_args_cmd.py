"""`glmconv megatron-args`: the Megatron-LM model arguments that match a GLM-5.3-Flash config."""

from __future__ import annotations

from pathlib import Path

import click

from glmconv.defaults import DEFAULT_LAYOUT, LAYOUT_CHOICES
from glmconv.io.config_file import load_config
from glmconv.megatron_args import command_line, model_args
from glmconv.text import printable
from glmconv_cli.output import echo, echo_json


@click.command("megatron-args")
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--layers", type=int, default=None, help="Only the first N decoder layers (a training cut, e.g. 8).")
@click.option("--json", "as_json", is_flag=True, help="Print {flag: value} as JSON (true for a bare switch).")
@click.option("--layout", type=click.Choice(LAYOUT_CHOICES), default=DEFAULT_LAYOUT, show_default=True,
              help="The Megatron layout trained: mcore (megatron-core's native modules) has no MTP module, so no "
              "--mtp-num-layers.")


def megatron_args(config: Path, layers: int | None, as_json: bool, layout: str) -> None:
    """Print the Megatron-LM model flags for CONFIG (a config.json or a checkpoint directory holding one).

    KDA, DSA and mHC layer layouts are the training plugin's own settings and are not printed.
    """

    cfg = load_config(config)
    if layers is not None:
        cfg = cfg.cut(layers)
    args = model_args(cfg, layout)
    if as_json:
        echo_json(args, indent=2)
        return
    lines = command_line(args)
    for i, line in enumerate(lines):
        echo(printable(line) + (" \\" if i < len(lines) - 1 else ""))

"""Help that teaches: every default shown, --train-convention's keys and values listed from the code."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from repo_files import ROOT

from glmconv.models.conventions import CHOICES
from glmconv_cli.main import cli


def _commands(group: click.Group, parent: click.Context) -> list[tuple[click.Command, click.Context]]:
    out = []
    for name, cmd in group.commands.items():
        ctx = click.Context(cmd, parent=parent, info_name=name)
        out += _commands(cmd, ctx) if isinstance(cmd, click.Group) else [(cmd, ctx)]
    return out


COMMANDS = _commands(cli, click.Context(cli, info_name="glmconv", **cli.context_settings))


@pytest.mark.parametrize(("cmd", "ctx"), COMMANDS, ids=[c.name for c, _ in COMMANDS])
def test_every_option_with_a_default_shows_it(cmd: click.Command, ctx: click.Context) -> None:
    for opt in cmd.params:
        if not isinstance(opt, click.Option) or opt.is_flag or opt.default is None or opt.multiple:
            continue
        record = opt.get_help_record(ctx)
        assert record is not None and f"[default: {opt.default}" in record[1], (cmd.name, opt.name, record)


def test_train_convention_help_lists_every_key_and_value() -> None:
    res = CliRunner(env={"COLUMNS": "500"}).invoke(cli, ["parity", "--help"])
    assert res.exit_code == 0
    help_text = " ".join(res.output.split())
    for key, values in CHOICES.items():
        assert f"{key}={'|'.join(values)}" in help_text, key


def test_readme_documents_shell_completion() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "_GLMCONV_COMPLETE=bash_source glmconv" in readme

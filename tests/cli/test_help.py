"""Help that teaches: every default shown, --train-convention's keys and values listed from the code."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner
from helpers.repo_files import ROOT

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


@pytest.mark.parametrize(("cmd", "ctx"), COMMANDS, ids=[c.name for c, _ in COMMANDS])
def test_every_option_is_described(cmd: click.Command, ctx: click.Context) -> None:
    undescribed = [p.name for p in cmd.params if isinstance(p, click.Option) and not p.hidden and not p.help]
    assert undescribed == [], cmd.name


@pytest.mark.parametrize(("cmd", "ctx"), COMMANDS, ids=[c.name for c, _ in COMMANDS])
def test_help_fits_80_columns_with_no_number_broken_across_lines(cmd: click.Command, ctx: click.Context) -> None:
    path = [ctx.info_name]
    while ctx.parent is not None and ctx.parent.info_name != "glmconv":
        ctx = ctx.parent
        path.insert(0, ctx.info_name)
    res = CliRunner(env={"COLUMNS": "80"}).invoke(cli, [*path, "--help"])
    assert res.exit_code == 0
    assert max(len(line) for line in res.output.splitlines()) <= 80
    assert not re.search(r"\d{10}", res.output)  # click's raw 20-digit range bounds broke across lines


@pytest.mark.parametrize("command", ["convert", "export"])
def test_convert_and_export_help_list_exit_codes(command: str) -> None:
    res = CliRunner(env={"COLUMNS": "500"}).invoke(cli, [command, "--help"])
    text = " ".join(res.output.split())
    assert "Exit codes: 0 " in text and ", 2 bad input" in text and ", 3 internal error" in text


def test_audit_fp8_help_says_what_the_default_is_in_words() -> None:
    res = CliRunner(env={"COLUMNS": "500"}).invoke(cli, ["audit-names", "--help"])
    text = " ".join(res.output.split())
    assert ("--fp8 / --no-fp8 Expect the FP8 release layout, or a BF16 one. Default: whatever SRC holds; with --emit "
            "(nothing to look at), BF16.") in text
    assert "emit: off" not in text


def _groups(group: click.Group, path: list[str]) -> list[tuple[click.Group, list[str]]]:
    out = [(group, path)]
    for name, cmd in group.commands.items():
        out += _groups(cmd, [*path, name]) if isinstance(cmd, click.Group) else []
    return out


GROUPS = _groups(cli, [])


@pytest.mark.parametrize(("group", "path"), GROUPS, ids=[" ".join(["glmconv", *p]) for _, p in GROUPS])
def test_a_group_without_its_subcommand_prints_its_help_whole(group: click.Group, path: list[str]) -> None:
    """`glmconv fixture` printed its help as one `error:` line with literal `\\n`s; every group now prints the help
    `glmconv` alone prints: many lines on stderr, exit 2 (no subcommand was run)."""
    res = CliRunner(env={"COLUMNS": "80"}).invoke(cli, path, prog_name="glmconv")
    assert res.exit_code == 2 and res.stdout == ""
    assert "\\n" not in res.stderr and not res.stderr.startswith("error:")
    lines = res.stderr.splitlines()
    assert lines[0] == " ".join(["Usage: glmconv", *path, "[OPTIONS] COMMAND [ARGS]..."])
    assert "Commands:" in lines and all(any(line.startswith(f"  {name} ") for line in lines)
                                        for name in group.commands)
    assert res.stderr == CliRunner(env={"COLUMNS": "80"}).invoke(cli, [*path, "--help"], prog_name="glmconv").stdout

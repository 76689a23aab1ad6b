"""`glmconv audit-names`: the per-tensor mapping audited against the plan, one side or both ways."""

from __future__ import annotations

import sys
from itertools import groupby
from typing import TYPE_CHECKING

import click
from rich.table import Table
from rich.text import Text

from glmconv import api, defaults
from glmconv.defaults import LAYOUT_CHOICES
from glmconv.runners.audit import KINDS, AuditReport, Finding, expected_tensors
from glmconv.stdout import stream
from glmconv.text import console as text_console
from glmconv.text import count, printable
from glmconv_cli.output import echo_json

if TYPE_CHECKING:
    pass

ROWS_PER_KIND = 20


@click.command("audit-names")
@click.argument("src", type=click.Path(path_type=str))
@click.option("--against", "against", type=click.Path(path_type=str), default=None,
              help="Second checkpoint (HF or torch_dist) or config to check through the mapping, both ways.")


@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--config", "config", type=click.Path(path_type=str), default=None,
              help="config.json for torch_dist checkpoints (default: the config.json next to them).")


@click.option("--fp8/--no-fp8", default=None,
              help="Expect the FP8 release layout, or a BF16 one. Default: whatever SRC holds; with --emit "
                   "(nothing to look at), BF16.")


@click.option("--mtp/--no-mtp", default=None,
              help="Expect the MTP layer, or none. Default: whatever SRC holds; with --emit, the MTP layer. With "
                   "--against it describes DST: SRC is audited as it is and the part left out is not compared.")


@click.option("--vision/--no-vision", default=None,
              help="Expect the vision tower, or none. Default: whatever SRC holds; with --emit, the tower. With "
                   "--against, as --mtp.")


@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Cut the config to N layers; a deeper checkpoint is audited on its first N (no MTP).")


@click.option("--accept-flat-prefix", is_flag=True, help="Accept text tensors under the flat `model.` prefix.")
@click.option("--layout", type=click.Choice(LAYOUT_CHOICES), default=None,
              help="Megatron layout of torch_dist sides and of --emit mcore (default: what their names say; "
              "emit: miles).")


@click.option("--emit", type=click.Choice(defaults.EMIT_CHOICES), default=None,
              help="Print the full expected tensor list (name, shape, dtype) for SRC's config and exit.")


def audit_names(src: str, against: str | None, as_json: bool, config: str | None, fp8: bool | None,
                mtp: bool | None, vision: bool | None, layers: int | None, accept_flat_prefix: bool,
                layout: str | None, emit: str | None) -> None:
    """Audit SRC (config.json, HF dir or torch_dist dir) against the plan, and against DST with --against.

    Exit 0 when every tensor matches, 1 when there are findings, 2 on unreadable input.
    """
    if emit is not None:
        _emit(src, emit, as_json, fp8=bool(fp8), mtp=mtp is not False, vision=vision is not False, layers=layers,
              config=config, layout=layout)
        return
    report = api.audit_report(src, against, fp8=fp8, mtp=mtp, vision=vision, layers=layers,
                       accept_flat_prefix=accept_flat_prefix, config=config, layout=layout)
    if as_json:
        echo_json(report.as_json(), indent=1)
    else:
        _print_report(report)
    sys.exit(0 if report.ok else 1)


def _emit(src: str, side: str, as_json: bool, **kw: object) -> None:
    specs = expected_tensors(src, side, **kw)  # type: ignore[arg-type]  # click passes the typed options
    if as_json:
        echo_json([s.as_json() for s in specs])
        return
    out = stream()
    out.write("".join(f"{printable(s.name)} {list(s.shape)} {s.dtype}\n".replace(", ", ",") for s in specs))
    out.flush()


def _print_report(report: AuditReport) -> None:
    console = text_console(highlight=False)
    for line in _layout_lines(report):
        console.print(line, markup=False)
    if report.findings:
        console.print(_table(report))
    style = "bold green" if report.ok else "bold red"
    console.print(f"[{style}]{report.summary()}[/]", markup=True)


def _layout_lines(report: AuditReport) -> list[str]:
    """Each torch_dist side's Megatron layout, and how many of its tensors that layout keeps without a home."""
    out = []
    for side, plan in report.plans.items():
        if plan["kind"] == "mcore":
            kept = f", {count(plan['homeless'], 'tensor')} kept under glmconv_kept." if plan["homeless"] else ""
            out.append(f"{side}: torch_dist in the {plan['layout']} layout{kept}")
    return out


def _table(report: AuditReport) -> object:
    sides = report.against is not None
    title = f"audit-names {report.src}" + (f" --against {report.against}" if sides else "")
    table = Table(title=Text(printable(title)))  # a Text, not a str: `[` in a path is not markup
    for col in ("kind", *(("side",) if sides else ()), "tensor", "file", "expected", "found"):
        table.add_column(col, overflow="fold")
    order = {k: i for i, k in enumerate(KINDS)}
    ordered = sorted(report.findings, key=lambda f: order.get(f.kind, len(KINDS)))
    for kind, group in groupby(ordered, key=lambda f: f.kind):
        rows = list(group)
        for f in rows[:ROWS_PER_KIND]:
            table.add_row(*_cells(f, sides))
        if len(rows) > ROWS_PER_KIND:
            table.add_row(kind, *([""] if sides else []), f"... and {len(rows) - ROWS_PER_KIND:,} more "
                          f"({len(rows):,} {kind} in all; --json lists every one)", "", "", "")
    return table


def _cells(f: Finding, sides: bool) -> list[Text]:
    """Plain text (`[bold]` in a name is not markup), escaped (a newline or ANSI escape in a name is shown)."""

    cells = (f.kind, *([f.side] if sides else []), f.tensor, f.file, f.expected, f.found)
    return [Text(printable(c)) for c in cells]

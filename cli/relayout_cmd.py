"""`glmconv relayout`: Megatron torch_dist in one layout -> torch_dist in the other (miles <-> mcore)."""

from __future__ import annotations

from pathlib import Path

import click

from glmconv import api
from glmconv import defaults as D
from glmconv.defaults import LAYOUT_CHOICES
from glmconv.text import count, printable
from glmconv_cli.convert_cmd import plan_lines
from glmconv_cli.output import echo
from glmconv_cli.report import begin, reported
from glmconv_cli.sizes import SIZE


@click.command("relayout")
@click.argument("mcore_dir", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--to", "to", type=click.Choice(LAYOUT_CHOICES), default=None,
              help="The layout to write: miles (the miles glm5_next plugin) or mcore (megatron-core's native modules, "
              "as Megatron-Bridge builds them); required. The layout MCORE_DIR already has is refused (cp -r copies "
              "it).")


@click.option("--dry-run", is_flag=True, help="Print the plan (tensors, bytes, estimated time, free space at OUT_DIR); "
              "write nothing.")


@click.option("--no-space-check", "no_space_check", is_flag=True,
              help="Do not refuse an output larger than the free space at OUT_DIR (checked before writing).")


@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout.")
@click.option("--force", is_flag=True, help="Replace an existing OUT_DIR that glmconv published (only once the new "
              "one is verified); any other non-empty directory is refused.")


@click.option("--like", "like", type=click.Path(path_type=Path), default=None,
              help="The HF checkpoint training started from: gives the tensors MCORE_DIR's trainer has no parameter "
              "for (the kpool compression of a Megatron-Bridge checkpoint), unchanged.")


@click.option("--group-size", type=SIZE, default=D.GROUP_SIZE_TEXT, show_default=True,
              help="Bytes per data file (bounds memory where tensors must be read and rebuilt).")


def relayout(mcore_dir: Path, out_dir: Path, to: str | None, dry_run: bool, no_space_check: bool, as_json: bool,
             force: bool, like: Path | None, group_size: int) -> None:
    """Rewrite a torch_dist checkpoint in the other Megatron layout: the same tensors bit for bit, bytes that
    only move copied file to file; export of the result equals export of MCORE_DIR."""
    if to is None:
        raise click.UsageError(f"Missing option '--to' (choose {' or '.join(LAYOUT_CHOICES)}).")
    begin("relayout", f"reading and checking {mcore_dir}", as_json)

    summary = api.relayout(mcore_dir, out_dir, to=to, force=force, group_bytes=group_size, dry_run=dry_run,
                           progress=not as_json, space_check=not no_space_check, like=like)
    if reported(summary, as_json):
        return
    s = summary
    verb = "would rewrite" if dry_run else "rewrote"
    echo(f"{verb} {count(s['mcore_tensors_in'], 'Megatron tensor')} ({s['from']}, {s['bytes_in'] / 1e9:.3f} GB) "
         f"-> {count(s['mcore_tensors'], 'Megatron tensor')} ({s['to']}, {s['bytes_out'] / 1e9:.3f} GB)"
         f"{' into ' + printable(s['published']) if 'published' in s else ''}")
    if not dry_run:
        echo(f"copied file to file: {count(s['copied_mappings'], 'mapping')} "
             f"({s['bytes_copied'] / 1e9:.3f} GB); read and rebuilt: {count(s['computed_mappings'], 'mapping')}")
    if s["training_state_dropped"]:
        echo(f"not carried: {count(s['training_state_dropped'], 'optimizer tensor')}")
    if dry_run:
        for line in plan_lines(s):
            echo(line)

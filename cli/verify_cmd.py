"""`glmconv verify`: every tensor of an HF checkpoint against its Megatron counterpart, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from glmconv import api
from glmconv.mistakes import runtime_note
from glmconv.progress import PLAN, say
from glmconv.text import console as text_console
from glmconv.text import count, printable
from glmconv_cli.output import echo_json
from glmconv_cli.report import ends_quickly, warn
from glmconv_cli.workers import device_option, read_threads_option, workers_option

ROWS = 20  # mismatches in the table (--json lists up to glmconv.runners.verify.LISTED)


@click.command("verify")
@click.argument("hf_dir", type=click.Path(path_type=Path))
@click.argument("mcore_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout.")
@workers_option()
@read_threads_option("reading, dequantising and comparing ahead", "; every choice finds the same mismatches")
@device_option("compared")
def verify(hf_dir: Path, mcore_dir: Path, as_json: bool, workers: int | str, read_threads: int, device: str) -> None:
    """Compare every tensor of HF_DIR with its mapped counterpart in MCORE_DIR, streaming, bit for bit.

    FP8 weights are dequantised by the reference formula first. Exit 0 when every tensor is equal, 1 when any
    differs (the first and the worst are named), 2 on bad input (including stored args of another model).
    """
    say("verify", PLAN, f"reading and checking {hf_dir} and {mcore_dir}", enabled=not as_json)
    ends_quickly()

    summary = api.verify(hf_dir, mcore_dir, progress=not as_json, workers=workers, read_threads=read_threads,
                         device=device)
    if not api.lead_process():  # torchrun: rank 0 alone prints, once
        return
    warn(summary)
    note = runtime_note(summary["config_keys_ignored"])
    if note:
        click.echo(printable(f"note: {note}"), err=True)
    if as_json:
        echo_json(summary, indent=2)
    else:
        _print(summary)
    sys.exit(0 if summary["equal"] else 1)


def _print(s: dict[str, Any]) -> None:
    console = text_console(highlight=False)
    if not s["equal"]:
        console.print(_table(s))
    done = (f"{count(s['mcore_tensors'], 'Megatron tensor')} ({s['bytes'] / 1e9:.3f} GB) against "
            f"{count(s['hf_tensors'], 'HF tensor')} in {s['elapsed_s']:.1f}s")
    if s["equal"]:
        rounded = s["rounded_f32_to_bf16"]
        how = (f"equal after rounding {count(rounded, 'HF tensor')} stored F32 to the BF16 that MCORE_DIR holds "
               "(convert --dtype bf16), every other value bit for bit" if rounded else "equal bit for bit")
        console.print(f"[bold green]verify: {how}: {done}[/]", markup=True)
    else:
        worst = s["worst_mismatch"]
        console.print(f"[bold red]verify: {count(s['mismatches'], 'mismatch', 'mismatches')}: {done}; worst max abs "
                      f"diff {worst['max_abs_diff']:.6g} at {', '.join(worst['hf'] or worst['mcore'])}[/]", markup=True)
    if s["rounded_f32_to_bf16"] and not s["equal"]:
        console.print(f"{count(s['rounded_f32_to_bf16'], 'HF tensor')} stored F32 compared after rounding to the BF16 "
                      "that MCORE_DIR holds (convert --dtype bf16)", markup=False)
    for part in s["left_out"]:
        console.print(f"{part}: not in the torch_dist checkpoint, not compared", markup=False)


def _table(s: dict[str, Any]) -> object:
    table = Table(title=Text(printable(f"verify {s['hf']} {s['mcore']}")))
    for col in ("HF tensor", "Megatron tensor", "values differing"):
        table.add_column(col, overflow="fold")  # a name folds, counts wrap between words
    table.add_column("max abs diff", no_wrap=True)  # a number is never cut: the other columns give way
    for m in s["listed"][:ROWS]:
        rows = f" experts {m['rows'][0]}..{m['rows'][1] - 1}" if m["rows"] else ""
        table.add_row(Text(printable(", ".join(m["hf"]))), Text(printable(", ".join(m["mcore"]) + rows)),
                      f"{m['values']:,} of {m['of']:,}", f"{m['max_abs_diff']:.6g}")
    if s["mismatches"] > ROWS:
        table.add_row(f"... and {s['mismatches'] - ROWS:,} more (--json lists up to {len(s['listed'])})", "", "", "")
    return table

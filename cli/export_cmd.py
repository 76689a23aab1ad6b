"""`glmconv export`: Megatron torch_dist -> HF safetensors in the release's naming."""

from __future__ import annotations

from pathlib import Path

import click

from glmconv import api
from glmconv.defaults import LAYOUT_CHOICES
from glmconv.text import count, printable, show
from glmconv_cli.convert_cmd import plan_lines
from glmconv_cli.output import echo
from glmconv_cli.report import begin, exit_codes, reported
from glmconv_cli.sizes import SIZE
from glmconv_cli.workers import device_option, read_threads_option, workers_option


@click.command("export")
@click.argument("mcore_dir", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--like", "like", type=click.Path(path_type=Path), default=None,
              help="HF checkpoint to imitate: its text prefix, per-tensor dtypes, config, tokenizer files and shard "
              "files.")


@click.option("--config", "config", type=click.Path(path_type=Path), default=None,
              help="config.json of the model (default: the one convert left in MCORE_DIR).")


@click.option("--max-shard-size", type=SIZE, default=None,
              help="Largest safetensors shard [default: with --like, its own files (names, tensors, order), where "
              "they hold every tensor; else 5GB].")


@click.option("--fp8", is_flag=True, help="Re-quantise the release's FP8 set (e4m3, 128x128 block scales).")
@workers_option()
@device_option("checked against --like's blocks", "re-quantised (--fp8)")
@read_threads_option("reading, transforming and FP8-encoding ahead of its writer", "; every choice writes the same "
                     "shards")


@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout.")
@click.option("--force", is_flag=True, help="Replace an existing OUT_DIR that glmconv published (only once the new "
              "one is verified); any other non-empty directory is refused.")


@click.option("--check-finite", is_flag=True,
              help="Always on (kept for old scripts): NaN/Inf in any Megatron tensor is refused.")


@click.option("--dry-run", is_flag=True, help="Print the plan (tensors, bytes, estimated time, free space at OUT_DIR); "
              "write nothing.")


@click.option("--no-space-check", "no_space_check", is_flag=True,
              help="Do not refuse an output larger than the free space at OUT_DIR (checked before writing).")


@click.option("--layout", type=click.Choice(LAYOUT_CHOICES), default=None,
              help="Megatron layout of MCORE_DIR (default: the one glmconv.json records, else the one its names are "
              "spelled in; a contradiction is refused).")


@exit_codes("exported")
def export(mcore_dir: Path, out_dir: Path, like: Path | None, config: Path | None, max_shard_size: int | None,
           fp8: bool, workers: int | str, device: str, read_threads: int, as_json: bool, force: bool,
           check_finite: bool, dry_run: bool, no_space_check: bool, layout: str | None) -> None:
    """Export a Megatron-core torch_dist checkpoint to HF safetensors shards with an index."""
    begin("export", f"reading and checking {mcore_dir}", as_json)

    summary = api.export(mcore_dir, out_dir, like=like, config=config, fp8=fp8, max_shard_bytes=max_shard_size,
                         workers=workers, force=force, check_finite=check_finite, dry_run=dry_run,
                         progress=not as_json, space_check=not no_space_check, layout=layout,
                         read_threads=read_threads, device=device)
    if reported(summary, as_json):
        return
    if dry_run:
        _print_dry_run(summary)
        return
    _print(summary)


def _print_dry_run(s: dict) -> None:
    echo(f"would export {count(s['mcore_tensors'], 'Megatron tensor')} ({s['bytes_in'] / 1e9:.3f} GB) -> "
         f"{count(s['hf_tensors'], 'HF tensor')} ({s['bytes_out'] / 1e9:.3f} GB){' as FP8' if s['fp8'] else ''}")
    for line in plan_lines(s):
        echo(line)


def _print(s: dict) -> None:
    echo(f"exported {count(s['mcore_tensors'], 'Megatron tensor')} ({s['bytes_in'] / 1e9:.3f} GB read) -> "
         f"{count(s['hf_tensors'], 'HF tensor')} in {count(s['shards'], 'shard')} "
         f"({s['bytes_out'] / 1e9:.3f} GB) into "
         f"{printable(s['published'])} in {s['elapsed_s']:.1f}s")
    for name, pad in s["vocab_padding_stripped"].items():
        echo(f"vocab padding stripped: {name} {pad['stored_rows']:,} -> {count(pad['vocab_size'], 'row')}")
    if s["fp8_requantized"]:
        f = s["fp8_requantized"]
        kept = f["blocks"] - f["requantized_blocks"]
        reused = f", {count(kept, 'block')} kept as --like stores them" if s["like"] else ""
        echo(f"fp8: {count(f['tensors'], 'weight')}, {count(f['blocks'], 'block')}: "
             f"{count(f['requantized_blocks'], 'block')} re-quantised (in "
             f"{count(f['requantized_tensors'], 'weight')}){reused}; "
             f"{count(f['scale_adjusted_blocks'], 'scale')} moved off amax/448 to reproduce the bf16 values, "
             f"{count(f['inexact_blocks'], 'block')} inexact")
    if s["like_files_unfit"]:
        echo(f"note: shards cut at {s['max_shard_bytes'] / 1e9:g} GB, not as --like's files: "
             f"{s['like_files_unfit']}")
    for part in ("mtp", "vision"):
        if not s[part]:
            echo(f"{part}: not in the torch_dist checkpoint, not exported")
    if s.get("source_fp8") and not s["fp8"]:
        echo("note: the source HF checkpoint was FP8; this export is BF16 (pass --fp8 to re-quantise)")
    src_prefix = s.get("source_text_prefix")
    if src_prefix and src_prefix != s["text_prefix"]:
        echo(f"note: the source HF checkpoint used the text prefix {show(src_prefix, quote=True)}; "
             f"this export uses {s['text_prefix']!r} (pass --like SOURCE to restore it)")

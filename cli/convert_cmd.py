"""`glmconv convert`: HF -> Megatron torch_dist."""

from __future__ import annotations

from pathlib import Path

import click

from glmconv import api
from glmconv import defaults as D
from glmconv.defaults import DEFAULT_LAYOUT, DTYPE_CHOICES, KEEP, LAYOUT_CHOICES
from glmconv.text import count, printable
from glmconv_cli.output import echo
from glmconv_cli.report import begin, exit_codes, reported
from glmconv_cli.sizes import SIZE
from glmconv_cli.workers import device_option, read_threads_option, workers_option


@click.command("convert")
@click.argument("hf_dir", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--dry-run", is_flag=True, help="Print the plan (tensors, bytes, peak memory per worker, estimated time, "
              "free space at OUT_DIR); write nothing.")


@click.option("--no-space-check", "no_space_check", is_flag=True,
              help="Do not refuse an output larger than the free space at OUT_DIR (checked before writing).")


@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout.")
@workers_option()
@device_option("cast to BF16")
@read_threads_option("reading and dequantising ahead of its writer")
@click.option("--force", is_flag=True, help="Replace an existing OUT_DIR that glmconv published (only once the new "
              "one is verified); any other non-empty directory is refused.")


@click.option("--mtp/--no-mtp", default=True, show_default=True, help="Carry the MTP layer (mtp.layers.0.*).")
@click.option("--vision/--no-vision", default=True, show_default=True, help="Carry the vision tower (vision_model.*).")
@click.option("--group-size", type=SIZE, default=D.GROUP_SIZE_TEXT, show_default=True,
              help="Bytes per data file (bounds memory per worker).")


@click.option("--check-finite", is_flag=True,
              help="Always on (kept for old scripts): NaN/Inf in any source tensor is refused, naming the first one.")


@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=KEEP, show_default=True,
              help="What Megatron gets: keep = what the source stores (bit-exact round trip); bf16 rounds F32 "
              "weights (counted in the summary); fp32 widens. F32 state (A_log, hc, biases) stays F32.")


@click.option("--layout", type=click.Choice(LAYOUT_CHOICES), default=DEFAULT_LAYOUT, show_default=True,
              help="Whose Megatron names to write: miles (the miles glm5_next plugin) or mcore (megatron-core's native "
              "modules, as Megatron-Bridge builds them). What mcore has no parameter for (kpool compression, MTP, "
              "vision) is kept under glmconv_kept. and said so.")


@exit_codes("converted")
def convert(hf_dir: Path, out_dir: Path, dry_run: bool, no_space_check: bool, as_json: bool, workers: int | str,
            device: str, read_threads: int, force: bool, mtp: bool, vision: bool, group_size: int,
            check_finite: bool, dtype: str, layout: str) -> None:
    """Convert an HF checkpoint (BF16, F32 or the FP8 release) into a Megatron-core torch_dist checkpoint."""
    begin("convert", f"reading and auditing {hf_dir}", as_json)

    summary = api.convert(hf_dir, out_dir, workers=workers, force=force, mtp=mtp, vision=vision,
                          group_bytes=group_size, check_finite=check_finite, dry_run=dry_run, progress=not as_json,
                          space_check=not no_space_check, dtype=dtype, device=device, read_threads=read_threads,
                          layout=layout)
    if not reported(summary, as_json):
        _print(summary, dry_run)


def _print(s: dict, dry_run: bool) -> None:
    verb = "would convert" if dry_run else "converted"
    echo(f"{verb} {count(s['hf_tensors'], 'HF tensor')} ({s['bytes_in'] / 1e9:.3f} GB) -> "
         f"{count(s['mcore_tensors'], 'Megatron tensor')} ({s['bytes_out'] / 1e9:.3f} GB)"
         f"{' into ' + printable(s['published']) if 'published' in s else ''}")
    for part, n in s["left_out"].items():
        echo(f"left out by request: {part} ({count(n, 'HF tensor')})")
    if s["narrowed_f32_to_bf16"]:
        echo(f"--dtype {s['dtype']}: {count(s['narrowed_f32_to_bf16'], 'HF tensor')} stored F32 rounded to BF16")
    if dry_run:
        for w in s["workers"]:
            echo(f"  worker {w['rank']}: {count(w['mappings'], 'mapping')}, {w['bytes_in'] / 1e9:.3f} GB in, "
                 f"peak memory <= {w['peak_bytes_estimate'] / 1e9:.3f} GB")
        for line in plan_lines(s):
            echo(line)


def plan_lines(s: dict) -> list[str]:
    """A dry run's estimated time and free space (convert and export)."""
    fit = {True: "fits", False: "does NOT fit (--no-space-check given)", None: "not checked"}[s["fits"]]
    free = ("free space unknown (the filesystem reports no size)" if s["space_free_bytes"] is None
            else f"{s['space_free_bytes'] / 1e9:.3f} GB free")
    return [f"estimated time: ~{s['estimate_s']:.1f} s at an assumed {s['throughput_bytes_per_s'] / 1e9:.2f} GB/s "
            f"of input ({s['throughput_basis']})",
            f"space: needs {s['space_needed_bytes'] / 1e9:.3f} GB, {free} at {printable(s['space_checked_at'])}: "
            f"{fit}"]

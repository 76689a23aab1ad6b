"""`glmconv fixture make`: write a random GLM-5.3-Flash checkpoint in the release's layout (toy, bench-sized or
real-dimension)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from glmconv.defaults import DEFAULT_INIT, INIT_CHOICES
from glmconv.fixtures.generate import FixtureInfo, write_fixture
from glmconv.fixtures.inits import INIT_HELP
from glmconv.fixtures.presets import PRESETS, REAL_CUTS
from glmconv.fixtures.real import RealCutInfo, write_real_cut
from glmconv.text import count, printable
from glmconv_cli.output import echo, echo_json
from glmconv_cli.sizes import SEED, SEED_HELP, SIZE

if TYPE_CHECKING:
    pass


@click.group()
def fixture() -> None:
    """Small random checkpoints for tests and demos."""


@fixture.command("make")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", type=click.Choice(PRESETS), default="tiny", show_default=True,
              help="tiny: 4 layers; cut8: the real 8-layer schedule, both at toy sizes; bench: --size on disk; "
              "real-cut4: the release's config.json cut to layers 0-3 (KDA x3 dense, DSA + MoE) at the real dims, "
              "no MTP, no vision (19.1 GB BF16, 11.3 GB with --fp8).")


@click.option("--layers", type=int, default=None,
              help="real-cut presets only: the release's first N decoder layers (default 4).")


@click.option("--size", type=SIZE, default=None,
              help="bench only: bytes on disk, e.g. 2GB (default 1GB); dims scale to it.")


@click.option("--shard-size", type=SIZE, default=None, help="Maximum bytes per shard (default: a third of the total; "
              "bench: a quarter, at most 2GB).")


@click.option("--fp8", is_flag=True, help="Store the release's FP8 set as e4m3 with 128x128 block scales.")
@click.option("--seed", type=SEED, default=0, show_default=True,
              help=f"Seed of every value ({SEED_HELP}): the same seed gives byte-identical files.")


@click.option("--init", type=click.Choice(INIT_CHOICES), default=DEFAULT_INIT, show_default=True, help=INIT_HELP)
@click.option("--force", is_flag=True, help="Replace OUT if it exists and is not empty.")
@click.option("--no-space-check", "no_space_check", is_flag=True,
              help="real-cut presets: do not refuse an output larger than the free space at OUT (checked first).")


@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of one line.")
def make(out: Path, preset: str, layers: int | None, size: int | None, shard_size: int | None, fp8: bool, seed: int,
         init: str, force: bool, no_space_check: bool, as_json: bool) -> None:
    """Write a random PRESET checkpoint to OUT (shards, index, config.json, generation_config.json).

    Real-cut presets show progress on stderr (not with --json) and draw on every core.
    """
    if size is not None and preset != "bench":
        raise click.BadParameter("only the bench preset takes a size", param_hint="--size")
    if layers is not None and preset not in REAL_CUTS:
        raise click.BadParameter(f"only the real-cut presets ({', '.join(REAL_CUTS)}) take a layer count",
                                 param_hint="--layers")
    info: RealCutInfo | FixtureInfo
    if preset in REAL_CUTS:
        info = write_real_cut(out, preset, layers=layers, fp8=fp8, seed=seed, force=force, shard_bytes=shard_size,
                              init=init, progress=not as_json, space_check=not no_space_check)
        what = f"{preset} {count(info.layers, 'layer')}"
    else:
        info = write_fixture(out, preset, fp8=fp8, seed=seed, force=force, size=size, shard_bytes=shard_size,
                             init=init)
        what = preset
    if as_json:
        echo_json(info.as_json())
        return
    kind = "fp8" if fp8 else "bf16"
    echo(f"{printable(str(info.path))}: {what} {kind} seed {seed}, {count(info.tensors, 'tensor')}, "
         f"{count(info.bytes, 'byte')} in {count(info.shards, 'shard')}")

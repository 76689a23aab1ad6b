"""`glmconv fixture make`: write a random GLM-5.3-Flash checkpoint in the release's layout (toy or bench-sized)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from glmconv.fixtures.inits import DEFAULT_INIT, INIT_HELP, INITS
from glmconv.fixtures.presets import PRESETS
from glmconv.text import count, printable
from glmconv_cli.sizes import SEED, SIZE


@click.group()
def fixture() -> None:
    """Small random checkpoints for tests and demos."""


@fixture.command("make")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", type=click.Choice(PRESETS), default="tiny", show_default=True,
              help="tiny: 4 layers; cut8: the real 8-layer schedule, both at toy sizes; bench: --size on disk.")
@click.option("--size", type=SIZE, default=None,
              help="bench only: bytes on disk, e.g. 2GB (default 1GB); dims scale to it.")
@click.option("--shard-size", type=SIZE, default=None, help="Maximum bytes per shard (default: a third of the total; "
              "bench: a quarter, at most 2GB).")
@click.option("--fp8", is_flag=True, help="Store the release's FP8 set as e4m3 with 128x128 block scales.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Same seed, byte-identical files.")
@click.option("--init", type=click.Choice(INITS), default=DEFAULT_INIT, show_default=True, help=INIT_HELP)
@click.option("--force", is_flag=True, help="Replace OUT if it exists and is not empty.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of one line.")
def make(out: Path, preset: str, size: int | None, shard_size: int | None, fp8: bool, seed: int, init: str,
         force: bool, as_json: bool) -> None:
    """Write a random PRESET checkpoint to OUT (shards, index, config.json, generation_config.json)."""
    from glmconv.fixtures.generate import write_fixture

    if size is not None and preset != "bench":
        raise click.BadParameter("only the bench preset takes a size", param_hint="--size")
    info = write_fixture(out, preset, fp8=fp8, seed=seed, force=force, size=size, shard_bytes=shard_size,
                         init=init)
    if as_json:
        click.echo(json.dumps(info.as_json()))
        return
    kind = "fp8" if fp8 else "bf16"
    click.echo(f"{printable(str(info.path))}: {preset} {kind} seed {seed}, {count(info.tensors, 'tensor')}, "
               f"{count(info.bytes, 'byte')} in {count(info.shards, 'shard')}")

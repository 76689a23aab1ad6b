"""`glmconv bench kernels`: each GPU kernel's time against its torch reference's on the same inputs."""

from __future__ import annotations

import click
from rich.table import Table

from glmconv.errors import GlmconvError
from glmconv.kernels.bench import Row, run
from glmconv.text import console
from glmconv_cli.output import echo_json


@click.group("bench")
def bench() -> None:
    """Benchmarks (need a CUDA device)."""


@bench.command("kernels")
@click.option("--tokens", type=int, default=8192, show_default=True,
              help="Tokens of the single-sequence kpool and KDA runs (DSA runs half, at least 64).")


@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def kernels(tokens: int, as_json: bool) -> None:
    """kpool indexer (one sequence and packed 4097/2048/1023/130/2), KDA and DSA SparseMLA at the real dims."""
    import torch

    if tokens < 64:
        raise GlmconvError(f"--tokens {tokens}: at least 64")
    if not torch.cuda.is_available():
        raise GlmconvError("glmconv bench kernels needs a CUDA device (the kernels are GPU-only)")

    rows = run(tokens=tokens, dsa_tokens=max(64, tokens // 2))  # tilelang's compile logs: stderr (glmconv/stdout.py)
    if as_json:
        echo_json([r.as_dict() for r in rows], indent=2)
        return

    console().print(table(rows, torch.cuda.get_device_name()))


def table(rows: list[Row], device: str) -> Table:
    """The rows as a table whose numbers are never cut: the text columns wrap to make room."""
    t = Table(title=f"glmconv bench kernels ({device})")
    for col in ("op", "shape", "kernel ms", "reference ms", "speedup", "reference", "check"):
        number = col.endswith(("ms", "speedup"))
        t.add_column(col, justify="right" if number else "left", no_wrap=number,
                     overflow="ellipsis" if number else "fold")
    for r in rows:
        t.add_row(r.op, r.shape, f"{r.kernel_ms:.3f}", f"{r.reference_ms:.3f}", f"{r.speedup:.2f}x", r.reference,
                  r.check)
    return t

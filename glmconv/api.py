"""The functions a Python user calls; the command line is a thin layer over exactly these.

Each takes paths and plain options and returns the summary the CLI prints with `--json`; a user-caused problem
raises `GlmconvError` (one line, naming the file or tensor), an argument of the wrong type, a value out of range
or an unknown keyword included: every argument is checked by glmconv.arguments, as the CLI checks it, and named
by its keyword (`glmconv.convert(): group_bytes='1GB': expected a number of bytes, an int ...`). Heavy imports
(torch) happen inside the calls, so `import glmconv` stays cheap; so do the parity stack's (the models, the
kernels' wrappers, the report): only `parity` and `hf_weights` load them, and a convert's start never pays for them,
nor for another command's runner (each call imports its own).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv import arguments as A
from glmconv import defaults as D
from glmconv.arguments import keywords_checked
from glmconv.config import GlmConfig
from glmconv.defaults import DEVICE_CHOICES, DTYPE_CHOICES, LAYOUT_CHOICES
from glmconv.errors import GlmconvError
from glmconv.io.output import ReportClaim, claim_report_dir
from glmconv.mistakes import check_pair, check_same_model
from glmconv.runners import audit as audit_runner
from glmconv.runners.audit import AuditReport
from glmconv.runners.ranks import torchrun_env
from glmconv.runners.workers import worker_count

if TYPE_CHECKING:
    import torch


def _flags(**flags: object) -> None:
    """Each yes/no option is a bool."""
    for name, value in flags.items():
        A.flag(name, value)


def lead_process() -> bool:
    """Whether this process reports the result: False on a torchrun rank other than 0 (every rank returns the
    same summary; only rank 0 prints it, so `torchrun ... --json` yields one JSON document)."""

    env = torchrun_env()
    return env is None or env[0] == 0


@keywords_checked
def convert(hf_dir: str | Path, out_dir: str | Path, *, workers: int | str = D.DEFAULT_WORKERS, force: bool = False,
            mtp: bool = True, vision: bool = True, group_bytes: int = D.DEFAULT_GROUP_BYTES, check_finite: bool = False,
            dry_run: bool = False, progress: bool = False, space_check: bool = True,
            dtype: str = D.DEFAULT_DTYPE, device: str = D.DEFAULT_DEVICE, read_threads: int = D.DEFAULT_THREADS,
            layout: str = D.DEFAULT_LAYOUT) -> dict[str, Any]:
    """HF checkpoint (BF16 or the FP8 release) -> Megatron torch_dist in `out_dir`, verified, published atomically.

    `layout`: `miles` (the miles plugin's names) or `mcore` (megatron-core's native modules, as Megatron-Bridge
    names them); what the layout has no parameter for is kept under `glmconv_kept.`, counted in `homeless`.

    `dtype` `keep` gives Megatron what the source stores (bit-exact round trip), `bf16` rounds F32 weights to
    BF16 (counted in the summary's `narrowed_f32_to_bf16`), `fp32` widens; F32 state (A_log, hc, biases) stays F32.

    `dry_run` returns the plan (tensors, bytes, peak memory per worker, estimated time, free space at `out_dir`)
    and writes nothing. With `space_check` a run (dry or real) whose output cannot fit on `out_dir`'s
    filesystem is refused before anything is written (glmconv/space.py).

    `workers`: processes on this machine, or `auto` (glmconv/runners/workers.py); `device`: where FP8 weights
    are dequantised, `cpu`, `cuda` or `auto` (glmconv/numerics/dequant.py; the same bits everywhere); `read_threads`:
    threads reading and dequantising ahead of each worker's writer (0: one step at a time).
    """
    A.path("hf_dir", hf_dir), A.path("out_dir", out_dir)
    workers, read_threads = A.workers(workers, "workers"), A.read_threads(read_threads, "read_threads")
    A.size("group_bytes", group_bytes), A.choice("dtype", dtype, DTYPE_CHOICES)
    A.choice("device", device, DEVICE_CHOICES), A.choice("layout", layout, LAYOUT_CHOICES)
    _flags(force=force, mtp=mtp, vision=vision, check_finite=check_finite, dry_run=dry_run, progress=progress,
           space_check=space_check)
    from glmconv.runners import convert as convert_runner  # its command's modules alone (architecture.md)

    job = convert_runner.prepare(hf_dir, out_dir, mtp=mtp, vision=vision, dtype=dtype, layout=layout)
    n = worker_count(workers)
    opts = convert_runner.RunOptions(workers=n, group_bytes=group_bytes, progress=progress, check_finite=True,
                                     space_check=space_check, device=device, threads=read_threads)
    return convert_runner.dry_run_summary(job, opts) if dry_run else convert_runner.convert(job, opts, force=force)


@keywords_checked
def export(mcore_dir: str | Path, out_dir: str | Path, *, like: str | Path | None = None,
           config: str | Path | None = None, fp8: bool = False, max_shard_bytes: int | None = None,
           workers: int | str = D.DEFAULT_WORKERS, force: bool = False, check_finite: bool = False,
           dry_run: bool = False, progress: bool = False, space_check: bool = True, layout: str | None = None,
           read_threads: int = D.DEFAULT_THREADS, device: str = D.DEFAULT_DEVICE) -> dict[str, Any]:
    """Megatron torch_dist -> HF safetensors in the release's naming (`like`: an HF checkpoint to imitate).

    `workers`: processes on this machine, or `auto` (glmconv/runners/workers.py, FP8 encoding counted as convert
    counts dequantisation); `read_threads`: threads reading, transforming and FP8-encoding ahead of each worker's
    writer (0: one step at a time); `device`: where FP8 weights are encoded, `cpu`, `cuda` or `auto` (the same bytes
    everywhere: glmconv/numerics/fp8_encode.py). Every choice writes the same shards.

    `layout`: the Megatron layout of `mcore_dir` (`miles` or `mcore`); None reads the one glmconv.json records,
    else the one its names are spelled in. Tensors kept under `glmconv_kept.` are exported like the others.

    Shards: at most `max_shard_bytes` each when given; else `like`'s own files (names, which tensor in which,
    their order and headers: an unchanged round trip is byte-identical) where they hold every tensor; else 5 GB.

    `dry_run` returns the plan (tensors, bytes, estimated time, free space at `out_dir`) and writes nothing. With
    `space_check` a run (dry or real) whose output cannot fit on `out_dir`'s filesystem is refused before
    anything is written (glmconv/space.py).
    """
    A.path("mcore_dir", mcore_dir), A.path("out_dir", out_dir)
    A.optional(A.path, "like", like), A.optional(A.path, "config", config)
    workers, read_threads = A.workers(workers, "workers"), A.read_threads(read_threads, "read_threads")
    A.optional(A.size, "max_shard_bytes", max_shard_bytes), A.optional(A.choice, "layout", layout, LAYOUT_CHOICES)
    A.choice("device", device, DEVICE_CHOICES)
    _flags(fp8=fp8, force=force, check_finite=check_finite, dry_run=dry_run, progress=progress,
           space_check=space_check)
    from glmconv.runners import export as export_runner  # its command's modules alone (architecture.md)

    job = export_runner.prepare(mcore_dir, out_dir, like=like, config=config, fp8=fp8, max_shard_bytes=max_shard_bytes,
                                layout=layout)
    n = worker_count(workers)
    opts = export_runner.ExportOptions(workers=n, progress=progress, check_finite=True, space_check=space_check,
                                       threads=read_threads, device=device)
    return export_runner.dry_run_summary(job, opts) if dry_run else export_runner.export(job, opts, force=force)


@keywords_checked
def relayout(mcore_dir: str | Path, out_dir: str | Path, *, to: str, force: bool = False,
             group_bytes: int = D.DEFAULT_GROUP_BYTES, dry_run: bool = False, progress: bool = False,
             space_check: bool = True, like: str | Path | None = None) -> dict[str, Any]:
    """Megatron torch_dist in one layout -> torch_dist in the other (`to`: `miles` or `mcore`), verified, published
    atomically: the same tensors bit for bit under the other layout's names and transforms (bytes that only move
    are copied file to file, never read), the source's args, iteration and export records kept, so that export of
    the result equals export of `mcore_dir`. `to` equal to the source's layout is refused.

    What the target layout has no parameter for is kept under `glmconv_kept.`, counted in `homeless` (the
    warning in `homeless_warning`). A source saved by a trainer with no parameter for them (Megatron-Bridge's) has
    none: `like`, the HF checkpoint training started from, gives them (`taken_from_like`). `dry_run` returns the
    plan and writes nothing; `space_check` as for convert.
    """
    A.path("mcore_dir", mcore_dir), A.path("out_dir", out_dir), A.optional(A.path, "like", like)
    A.choice("to", to, LAYOUT_CHOICES), A.size("group_bytes", group_bytes)
    _flags(force=force, dry_run=dry_run, progress=progress, space_check=space_check)
    from glmconv.runners import relayout as relayout_runner  # its command's modules alone (architecture.md)

    job = relayout_runner.prepare(mcore_dir, out_dir, to=to, like=like)
    opts = relayout_runner.RelayoutOptions(group_bytes=group_bytes, progress=progress, space_check=space_check)
    return relayout_runner.dry_run_summary(job, opts) if dry_run else relayout_runner.relayout(job, opts, force=force)


@keywords_checked
def verify(hf_dir: str | Path, mcore_dir: str | Path, *, progress: bool = False,
           workers: int | str = D.DEFAULT_WORKERS, read_threads: int = D.DEFAULT_THREADS,
           device: str = D.DEFAULT_DEVICE) -> dict[str, Any]:
    """Every tensor of `hf_dir` against its mapped counterpart in `mcore_dir`, bit for bit, one mapping at a time.

    BF16/F32 kept dtypes must be equal bit for bit, FP8 weights dequantised by the reference formula must equal
    the Megatron BF16 tensor; the summary's `equal` is the verdict (the CLI's exit 1 when False), with the first
    and the worst mismatch (names on both sides, values that differ, max abs diff). Both checkpoints are checked
    first as convert and export check them (a stored `args` of another model is refused).

    `workers`, `read_threads` and `device` as convert's (the same mismatches, first and worst, whatever they are).
    """
    A.path("hf_dir", hf_dir), A.path("mcore_dir", mcore_dir)
    workers, read_threads = A.workers(workers, "workers"), A.read_threads(read_threads, "read_threads")
    A.choice("device", device, D.DEVICE_CHOICES)
    _flags(progress=progress)
    from glmconv.runners import verify as verify_runner  # its command's modules alone (architecture.md)

    job = verify_runner.prepare(hf_dir, mcore_dir)
    n = worker_count(workers)
    opts = verify_runner.VerifyOptions(workers=n, threads=read_threads, device=device, progress=progress)
    return verify_runner.verify(job, opts)


@keywords_checked
def hf_weights(params: Iterable[tuple[str, torch.Tensor]] | str | Path, config: GlmConfig | str | Path | None = None,
               *, fp8: bool = False, dtypes: dict[str, str] | None = None,
               layout: str = D.DEFAULT_LAYOUT) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of Megatron parameters, in bounded memory: an RL trainer's weight sync to a rollout engine.

    `params`: (Megatron name, tensor) pairs in any order (a split parameter, the hc alphas, is held only until
    its parts are in), or a torch_dist directory (streamed as export reads it). `config`: the model's config
    (needed for in-memory parameters). `dtypes`: HF name -> safetensors dtype to produce (default: the plan's;
    a directory's recorded source dtypes, as export). `fp8`: the release's FP8 set, as `export --fp8`. The
    tensors are export's, bit for bit; they may share memory with `params`. Unknown names, duplicates, wrong
    shapes and groups left incomplete raise `GlmconvError`. `layout`: whose torch_dist names in-memory `params`
    carry (`miles` or `mcore`; a directory says its own).
    """
    from glmconv import weight_sync

    if isinstance(params, (str, os.PathLike)):
        A.path("params", params)
    elif not isinstance(params, Iterable) or isinstance(params, (bytes, dict)):
        raise A.ArgumentError("params", params, "expected (Megatron name, tensor) pairs, or a torch_dist "
                              "directory (a str or pathlib.Path)")
    if config is not None and not isinstance(config, (GlmConfig, str, os.PathLike)):
        raise A.ArgumentError("config", config, "expected a GlmConfig, or a config.json or checkpoint directory (a str "
                              "or pathlib.Path)")
    _flags(fp8=fp8)
    A.optional(A.names_to, "dtypes", dtypes, "safetensors dtypes such as 'BF16'")
    A.choice("layout", layout, LAYOUT_CHOICES)
    return weight_sync.hf_weights(params, config, fp8=fp8, dtypes=dtypes, layout=layout)


@keywords_checked
def audit(src: str | Path, against: str | Path | None = None, *, fp8: bool | None = None, mtp: bool | None = None,
          vision: bool | None = None, layers: int | None = None, accept_flat_prefix: bool = False,
          config: str | Path | None = None, layout: str | None = None) -> dict[str, Any]:
    """Every tensor of `src` (config, HF or torch_dist) against the plan, and against `against` both ways.

    Returns what `audit-names --json` prints: `ok` (False when there are findings: the CLI's exit 1), the
    `findings` (kind, side, tensor, file, expected, found), `counts` and each side's `plans`; unreadable input
    raises. `layout`: the Megatron layout torch_dist sides are audited in (None: the one their names are spelled
    in; a glmconv.json record they contradict is a finding); two sides in different layouts meet through the
    mapping.
    """
    return _audit(src, against, fp8=fp8, mtp=mtp, vision=vision, layers=layers,
                  accept_flat_prefix=accept_flat_prefix, config=config, layout=layout).as_json()


@keywords_checked
def audit_report(src: str | Path, against: str | Path | None = None, *, fp8: bool | None = None,
                 mtp: bool | None = None, vision: bool | None = None, layers: int | None = None,
                 accept_flat_prefix: bool = False, config: str | Path | None = None,
                 layout: str | None = None) -> AuditReport:
    """`audit` as an object (`.ok`, `.findings`, `.summary()`): what the CLI prints its table from."""
    return _audit(src, against, fp8=fp8, mtp=mtp, vision=vision, layers=layers,
                  accept_flat_prefix=accept_flat_prefix, config=config, layout=layout)


def _audit(src: str | Path, against: str | Path | None, *, fp8: bool | None, mtp: bool | None, vision: bool | None,
           layers: int | None, accept_flat_prefix: bool, config: str | Path | None, layout: str | None) -> AuditReport:
    A.path("src", src), A.optional(A.path, "against", against), A.optional(A.path, "config", config)
    for name, value in (("fp8", fp8), ("mtp", mtp), ("vision", vision)):
        A.optional(A.flag, name, value)
    A.optional(A.int_in, "layers", layers, 1)
    _flags(accept_flat_prefix=accept_flat_prefix)
    A.optional(A.choice, "layout", layout, LAYOUT_CHOICES)
    return audit_runner.audit(src, against, fp8=fp8, mtp=mtp, vision=vision, layers=layers,
                              accept_flat_prefix=accept_flat_prefix, config=config, layout=layout)


@keywords_checked
def parity(hf_dir: str | Path, mcore_dir: str | Path, *, tokens: int | None = None, sequences: int | None = None,
           prompt_file: str | Path | None = None, fail_on: str | Sequence[str] = (), threshold: float | None = None,
           report_dir: str | Path | None = None, seed: int = D.DEFAULT_SEED, mode: str = D.DEFAULT_MODE,
           dtype: str = D.DEFAULT_PARITY_DTYPE, device: str = D.DEFAULT_PARITY_DEVICE,
           train_conventions: str = D.DEFAULT_TRAIN_CONVENTIONS, overrides: list[str] | tuple[str, ...] = (),
           kernels: str = D.DEFAULT_KERNELS, stream_layers: bool = False, replay: str = D.DEFAULT_REPLAY,
           replay_file: str | Path | None = None, self_test: bool = False, defects: str | None = None,
           allow_different_weights: bool = False, progress: bool = False,
           train_backend: str = D.DEFAULT_TRAIN_BACKEND) -> dict[str, Any]:
    """Layerwise train-vs-serve report of `hf_dir` and its conversion `mcore_dir`; `report["passed"]` is the verdict.

    `report["wall_s"]` is the whole call (reading, building both models, the passes); `report["elapsed_s"]` the
    forward passes of both models alone.

    `fail_on`: one bound such as "logprob_abs_diff.max>1e-4", or a sequence of them; `report_dir`: also write
    report.json, report.md and error_per_layer.png there (listed in `report["report_files"]`; without matplotlib
    the PNG is skipped and `report["report_skipped"]` says so). The other keywords are the CLI's flags of the same
    name (`overrides`: its `--train-convention KEY=VALUE`s; `progress`: print progress, off by default).
    """
    from glmconv.compare import ParityOptions, run_parity
    from glmconv.compare.metrics import parse_bound
    from glmconv.compare.report import JSON_NAME, MD_NAME, PNG_NAME, write_report

    start = time.monotonic()
    _parity_arguments(hf_dir, mcore_dir, tokens, sequences, prompt_file, threshold, report_dir, replay_file)
    A.int_in("seed", seed, *A.SEED_RANGE), A.choice("mode", mode, D.PARITY_MODES)
    A.choice("dtype", dtype, D.PARITY_DTYPES), A.text("device", device), A.optional(A.text, "defects", defects)
    A.choice("train_conventions", train_conventions, D.TRAIN_CONVENTIONS), A.texts("overrides", overrides)
    A.choice("kernels", kernels, D.KERNEL_CHOICES), A.choice("replay", replay, D.REPLAY_CHOICES)
    A.choice("train_backend", train_backend, D.TRAIN_BACKENDS)
    _flags(stream_layers=stream_layers, self_test=self_test, allow_different_weights=allow_different_weights,
           progress=progress)
    bounds = tuple(parse_bound(b) for b in A.fail_on(fail_on, "fail_on"))  # bad syntax: before any model is built
    check_pair("parity", hf_dir, mcore_dir)  # the arguments swapped, or a checkpoint of the wrong kind
    ignored = check_same_model(hf_dir, mcore_dir)
    inputs = {"HF checkpoint": Path(hf_dir), "torch_dist checkpoint": Path(mcore_dir),
              "prompt file": Path(prompt_file) if prompt_file else None,
              "replay file": Path(replay_file) if replay_file else None}  # the report never lands on an input
    opts = ParityOptions(
        hf_dir=Path(hf_dir), mcore_dir=Path(mcore_dir), tokens=D.DEFAULT_TOKENS if tokens is None else tokens,
        sequences=1 if sequences is None else sequences, seed=seed, prompt_file=inputs["prompt file"], mode=mode,
        dtype=dtype, device=device, train_conventions=train_conventions, overrides=tuple(overrides),
        threshold=threshold, bounds=bounds, progress=progress, allow_different_weights=allow_different_weights,
        kernels=kernels, stream_layers=stream_layers, replay=replay, replay_file=inputs["replay file"],
        self_test=self_test, defects=defects, train_backend=train_backend)
    # before the run: a directory that cannot take it fails now; a run that fails leaves nothing of it
    claim = claim_report_dir(Path(report_dir), inputs) if report_dir is not None else ReportClaim()
    try:
        report = run_parity(opts)
        report["wall_s"] = round(time.monotonic() - start, 3)  # the whole run; `elapsed_s`: the forward passes
        report["config_keys_ignored"] = ignored  # differ between the two configs, change neither model nor numerics
        if report_dir is not None:
            report["report_files"] = [str(p) for p in write_report(report, report_dir, inputs)]
    except BaseException:
        claim.undo([Path(report_dir) / n for n in (JSON_NAME, MD_NAME, PNG_NAME)] if report_dir is not None else [])
        raise
    return report


def _parity_arguments(hf_dir: object, mcore_dir: object, tokens: object, sequences: object, prompt_file: object,
                      threshold: object, report_dir: object, replay_file: object) -> None:
    """parity's paths and counts, checked before anything is read; the two the CLI reaches through here name both
    the keyword and the flag."""

    A.path("hf_dir", hf_dir), A.path("mcore_dir", mcore_dir), A.optional(A.path, "prompt_file", prompt_file)
    A.optional(A.path, "report_dir", report_dir), A.optional(A.path, "replay_file", replay_file)
    A.optional(A.int_in, "tokens", tokens), A.optional(A.int_in, "sequences", sequences)  # ranges: inputs.py
    if prompt_file is not None and (tokens is not None or sequences is not None):
        raise GlmconvError("--prompt-file sets the tokens and sequences (prompt_file, in Python); drop --tokens and "
                           "--sequences (tokens, sequences)")
    if threshold is not None:
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool):
            raise A.ArgumentError("threshold", threshold, "expected a positive number (an int or a float)")
        if not threshold > 0:
            raise GlmconvError(f"--threshold {threshold} (threshold, in Python): must be positive")

"""Where and how FP8 weights are dequantised during convert: CPU slabs on threads, or the GPU.

Both give the bits of `dequantize_fp8_blocks` (glmconv/numerics/fp8.py): every value is fp8 -> fp32 (exact), one fp32
multiply by its block's scale (IEEE, correctly rounded on any device) and a round-to-nearest-even cast to BF16.
On the CPU a weight is cut into slabs of whole 128-row blocks, each dequantised alone on a pool thread (torch's
own intra-op threads scale poorly on this elementwise chain: measured in benchmarks/RESULTS.md). On the GPU the
codes are read into pinned memory, copied on the calling thread's own stream (a reader thread each: two in
flight with the default two readers), dequantised and cast there, and copied back through a pinned buffer. Either
writes into an `out` it is given: convert assembles stacked experts by dequantising each straight into its rows
of the one output (a copy of every byte less than stacking after).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from glmconv import phases
from glmconv.defaults import AUTO, DEVICE_CHOICES
from glmconv.errors import GlmconvError
from glmconv.numerics.fp8 import FP8_BLOCK, Fp8FormatError, dequantize_fp8_blocks, refuse_nan_codes, scale_shape

if TYPE_CHECKING:
    import torch

SLAB_ROWS = 2 * FP8_BLOCK  # rows per CPU slab: fp32 temporaries of a few MB stay in cache
# auto picks the GPU for a worker with at least this many bytes of FP8 codes. Measured on an H100 (2026-12-06, a
# 1.0 GB FP8 convert): the CUDA context 0.12 s, reading + dequantising 0.95 s on the GPU against 2.71 s on the
# CPU's slabs: the GPU wins from about 70 MB (1 GiB before: auto ran that convert on the CPU, 1.3 s slower)
AUTO_CUDA_BYTES = 64 << 20


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def require_device(requested: str) -> None:
    """Refuse, before any work, a device that cannot be had: an unknown name, or `cuda` without a GPU."""
    if requested not in DEVICE_CHOICES:
        raise GlmconvError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {requested!r}")
    if requested == "cuda" and not _gpu_visible():
        raise GlmconvError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False); "
                           "use --device cpu or auto")


def resolve_device(requested: str, fp8_bytes: int) -> str:
    """`cpu` or `cuda` for one worker: `auto` is cuda when a GPU is visible and there are AUTO_CUDA_BYTES of FP8
    codes to dequantise (less costs less on the CPU than starting CUDA); `require_device` checked the rest."""
    if requested == "cpu" or (requested == AUTO and fp8_bytes < AUTO_CUDA_BYTES):
        return "cpu"
    return "cuda" if requested == "cuda" or _gpu_visible() else "cpu"


def _gpu_visible() -> bool:
    phases.import_torch()  # timed where it happens (the first question about the GPU imports torch)
    import torch

    return bool(torch.cuda.is_available())


class CpuDequantizer:
    """`dequantize_fp8_blocks`, slab by slab on `threads` threads (1: the reference call itself)."""

    pinned = False

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="glmconv-fp8") if self.threads > 1 else None

    def __call__(self, fp8: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        rows = fp8.shape[0] if fp8.dim() == 2 else 0
        if self._pool is None or rows <= SLAB_ROWS:
            return dequantize_fp8_blocks(fp8, scale_inv, out_dtype=out_dtype, out=out)
        if out is None:
            out = torch.empty(fp8.shape, dtype=out_dtype)

        def slab(start: int) -> None:
            stop = min(rows, start + SLAB_ROWS)
            scales = scale_inv[start // FP8_BLOCK:-(-stop // FP8_BLOCK)]
            dequantize_fp8_blocks(fp8[start:stop], scales, out_dtype=out_dtype, out=out[start:stop])

        _check_whole(fp8, scale_inv)  # each slab is checked against its own rows only
        list(self._pool.map(slab, range(0, rows, SLAB_ROWS)))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class ThreadStreams:
    """One CUDA stream per calling thread on `device`: reader threads copy and compute side by side."""

    def __init__(self, device: str = "cuda") -> None:
        import torch

        self.device = torch.device(device)
        self._local = threading.local()

    def _stream(self) -> Any:
        import torch

        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return stream


class CudaDequantizer(ThreadStreams):
    """Codes and scales to the GPU on the calling thread's stream, dequantised and cast there, back through a pinned
    buffer into ordinary memory. Outputs wait in the writer's queue (up to 2 GB of BF16 ahead): held in pinned
    memory, each run paid fresh page pinning for all of it (2.45 GB/s on the H100, RESULTS.md 2026-12-07), where one
    staging buffer per weight is reused from torch's cache and the copy out runs at memory speed."""

    pinned = True

    def __call__(self, fp8: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        stream = self._stream()
        with torch.cuda.stream(stream):
            codes = fp8.to(self.device, non_blocking=fp8.is_pinned())
            scales = scale_inv.to(self.device, non_blocking=scale_inv.is_pinned())
            w = dequantize_fp8_blocks(codes, scales, out_dtype=out_dtype)
            staged = torch.empty(w.shape, dtype=out_dtype, pin_memory=True)
            staged.copy_(w, non_blocking=True)  # the copy overlaps the other reader's work
        stream.synchronize()  # the codes, scales and `w` are released only once the copies are done
        out = torch.empty(w.shape, dtype=out_dtype) if out is None else out
        return out.copy_(staged)  # `staged` back to torch's pinned cache at once: see the class docstring

    def close(self) -> None:
        pass


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` within the block (None: left alone), restored after."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_dequantizer(device: str, threads: int, rank: int = 0) -> CpuDequantizer | CudaDequantizer:
    """The dequantiser of a resolved device (`resolve_device`); worker `rank` takes GPU rank % visible GPUs."""
    if device != "cuda":
        return CpuDequantizer(threads)
    return CudaDequantizer(cuda_device(rank))


def cuda_device(rank: int) -> str:
    """Worker `rank`'s GPU (rank % visible GPUs), its CUDA context made now and timed (phase `cuda_init`), not in
    the middle of the first read."""
    import torch

    name = f"cuda:{rank % torch.cuda.device_count()}"
    with phases.timed("cuda_init"):
        torch.empty(1, device=name)
    return name


def _check_whole(fp8: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """The reference's checks on the whole weight: dtypes, the scale grid, NaN codes."""
    import torch

    if fp8.dtype != torch.float8_e4m3fn or scale_inv.dtype != torch.float32:
        raise Fp8FormatError(f"expected a float8_e4m3fn weight and F32 block scales, got {fp8.dtype} and "
                             f"{scale_inv.dtype}")
    want = scale_shape(tuple(fp8.shape))
    if tuple(scale_inv.shape) != want:
        raise Fp8FormatError(f"block scales of a {list(fp8.shape)} FP8 weight must be {list(want)}, "
                             f"got {list(scale_inv.shape)}")
    refuse_nan_codes(fp8)  # on the whole weight: a slab would count and place only its own rows


@contextmanager
def share_dequantizer(requested: str, fp8_bytes: int, threads: int,
                      rank: int = 0) -> Iterator[tuple[str, CpuDequantizer | CudaDequantizer]]:
    """One worker's dequantiser (convert, verify): the device its `fp8_bytes` call for, CPU slabs on `threads`
    threads (torch's own kernels then on one: the slabs are the threads), closed after; (device, dequantiser)."""
    device = resolve_device(requested, fp8_bytes)
    with slab_worker(make_dequantizer(device, threads, rank), device, threads) as dequantize:
        yield device, dequantize


Closable = TypeVar("Closable", bound="SupportsClose")


class SupportsClose(Protocol):
    def close(self) -> None: ...


@contextmanager
def slab_worker(worker: Closable, device: str, threads: int) -> Iterator[Closable]:
    """A dequantiser or an encoder in use: where its CPU slabs run on `threads` threads, torch's own kernels run on
    one (the slabs are the threads); closed after."""
    try:
        with torch_threads(1 if device == "cpu" and threads > 1 else None):
            yield worker
    finally:
        worker.close()

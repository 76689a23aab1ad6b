"""Where `export --fp8` encodes its weights: CPU slabs on threads, or the GPU; the same bytes either way.

`fp8_reuse.encode` is block-local (a 128x128 block's codes and scale depend on that block of the weight and of
--like alone), so a weight cut into slabs of whole 128-row blocks, each encoded alone on a pool thread, gives the
whole weight's bytes, and the cores share the work (torch's own intra-op threads then stay at one, as for
dequantisation). On the GPU the same torch code runs on device copies: fp32 reductions, IEEE divisions by tensors
and round-to-nearest-even casts only (glmconv/numerics/fp8.py), so the bytes are the CPU's (tests/gpu). A mapping
step's small weights of one shape (experts) are encoded stacked, for the same reason: one call for many weights
(`Fp8Encoder.many`; on a GPU one copy each way and one synchronisation instead of one per weight).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from glmconv.numerics.dequant import SLAB_ROWS, ThreadStreams, cuda_device, resolve_device, slab_worker
from glmconv.numerics.fp8 import FP8_BLOCK
from glmconv.numerics.fp8_reuse import Fp8Blocks, comparable, encode, encode_stacked, split_stacked

if TYPE_CHECKING:
    import torch


Pair = tuple["torch.Tensor", "torch.Tensor"]  # --like's codes and scales of one weight


class Fp8Encoder(Protocol):
    """`fp8_reuse.encode` somewhere: a weight (and --like's pair) in, its FP8 bytes and counts out, on the CPU."""

    pinned: bool  # whether weights are best read into pinned memory (they are copied to a GPU)

    def __call__(self, w: torch.Tensor, like: Pair | None) -> Fp8Blocks: ...

    def many(self, ws: list[torch.Tensor], likes: list[Pair | None]) -> list[Fp8Blocks]:
        """Each weight as `__call__` gives it (a mapping step's experts: one call where the device gains by it)."""
        ...

    def close(self) -> None: ...


def stackable(ws: list[torch.Tensor], likes: list[Pair | None]) -> bool:
    """Whether `fp8_reuse.encode_stacked` gives these weights' bytes: more than one, 2-D, one shape and dtype, whole
    128-row blocks, and --like's pairs for all (each comparable) or for none."""
    first = ws[0]
    if len(ws) < 2 or first.dim() != 2 or first.shape[0] % FP8_BLOCK:
        return False
    if any(w.shape != first.shape or w.dtype != first.dtype for w in ws):
        return False
    if all(p is None for p in likes):
        return True
    return all(p is not None and comparable(w, *p) for w, p in zip(ws, likes))


class CpuEncoder:
    """`encode`, slab by slab of whole 128-row blocks on `threads` threads (1: the reference call itself)."""

    pinned = False

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="glmconv-fp8") if self.threads > 1 else None

    def __call__(self, w: torch.Tensor, like: tuple[torch.Tensor, torch.Tensor] | None) -> Fp8Blocks:
        rows = w.shape[0] if w.dim() == 2 else 0
        if self._pool is None or rows <= SLAB_ROWS:
            return encode(w, like)
        if like is not None and not comparable(w, *like):
            like = None  # what `encode` does with it: every block re-quantised
        w = w.contiguous()

        def slab(start: int) -> Fp8Blocks:
            stop = min(rows, start + SLAB_ROWS)
            pair = None if like is None else (like[0][start:stop], like[1][start // FP8_BLOCK:-(-stop // FP8_BLOCK)])
            return encode(w[start:stop], pair)

        return joined(list(self._pool.map(slab, range(0, rows, SLAB_ROWS))))

    def many(self, ws: list[torch.Tensor], likes: list[Pair | None]) -> list[Fp8Blocks]:
        """Small weights of one shape as one (no pool: each under a slab), larger ones each by slabs."""
        import torch

        if stackable(ws, likes) and ws[0].shape[0] <= SLAB_ROWS:
            return stacked_on(torch.device("cpu"), ws, likes)
        return [self(w, p) for w, p in zip(ws, likes, strict=True)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def joined(parts: list[Fp8Blocks]) -> Fp8Blocks:
    """Slabs of consecutive rows as one weight: codes and scales stacked, counts summed."""
    import torch

    codes = torch.cat([p.codes.view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
    return Fp8Blocks(codes, torch.cat([p.scales for p in parts]), sum(p.requantized for p in parts),
                     sum(p.scale_adjusted for p in parts), sum(p.inexact for p in parts))


class CudaEncoder(ThreadStreams):
    """The weight (and --like's pair) to the GPU on the calling thread's stream, encoded there, the bytes back."""

    pinned = True

    def __call__(self, w: torch.Tensor, like: Pair | None) -> Fp8Blocks:
        return self._on_stream([w], [like])[0]

    def many(self, ws: list[torch.Tensor], likes: list[Pair | None]) -> list[Fp8Blocks]:
        """Small weights of one shape (a step's experts) stacked: one copy each way and one synchronisation for all
        of them, where one each cost more than their encoding (tests/gpu: the bytes are the CPU's)."""
        if not stackable(ws, likes):
            return [self(w, p) for w, p in zip(ws, likes, strict=True)]
        return self._on_stream(ws, likes)

    def _on_stream(self, ws: list[torch.Tensor], likes: list[Pair | None]) -> list[Fp8Blocks]:
        import torch

        stream = self._stream()
        with torch.cuda.stream(stream):
            got = stacked_on(self.device, ws, likes)
        stream.synchronize()
        return got

    def close(self) -> None:
        pass


def stacked_on(device: torch.device, ws: list[torch.Tensor], likes: list[Pair | None]) -> list[Fp8Blocks]:
    """`stackable` weights encoded as one on `device` (one copy there of them and of --like's pairs, one back of
    the codes and scales: none where every block is --like's, whose tensors in hand are the bytes)."""
    import torch

    like = stacked_pairs(likes)
    pair = None if like is None else (_to(like[0], device), _to(like[1], device))
    codes, scales, counts = encode_stacked(_to(_rows(ws), device), pair, len(ws))  # counts: read back inside
    if pair is not None and codes is pair[0]:
        return [Fp8Blocks(p[0], p[1], 0, 0, 0) for p in likes if p is not None]
    return split_stacked(codes.view(torch.uint8).to("cpu").view(torch.float8_e4m3fn), scales.to("cpu"), counts)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from pinned memory without blocking the thread (the stream is synchronised after)."""
    return t.to(device, non_blocking=t.is_pinned())


def stacked_pairs(likes: list[Pair | None]) -> Pair | None:
    """--like's pairs stacked by rows as their weights are (None: no pair at all)."""
    import torch

    if any(p is None for p in likes):
        return None
    pairs = [p for p in likes if p is not None]
    return _rows([c.view(torch.uint8) for c, _ in pairs]).view(torch.float8_e4m3fn), _rows([s for _, s in pairs])


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors stacked by rows: a view where they already lie one after another in one storage (a read chunk's
    experts, --like's codes read together), else a copy (one alone: itself)."""
    import torch

    if len(tensors) == 1:
        return tensors[0]
    adjacent = _adjacent_rows(tensors)
    return adjacent if adjacent is not None else torch.cat(tensors)


def _adjacent_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one view when each starts where the one before ends, in one storage, rows of one shape."""
    first = tensors[0]
    at, rows = first.data_ptr(), 0
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or t.data_ptr() != at
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        at, rows = at + t.numel() * t.element_size(), rows + t.shape[0]
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def make_encoder(device: str, threads: int, rank: int = 0) -> Fp8Encoder:
    """The encoder of a resolved device; worker `rank` takes GPU rank % visible GPUs."""
    if device != "cuda":
        return CpuEncoder(threads)
    return CudaEncoder(cuda_device(rank))


@contextmanager
def share_encoder(requested: str, fp8_bytes: int, threads: int,
                  rank: int = 0) -> Iterator[tuple[str, Fp8Encoder]]:
    """One export worker's encoder: the device its `fp8_bytes` of FP8 codes call for (`resolve_device`, as
    convert's dequantiser), CPU slabs on `threads` threads (torch's own kernels then on one), closed after. A share
    with no FP8 to encode makes no CUDA context and leaves torch's threads alone: the CPU, whatever was asked."""
    device = resolve_device(requested, fp8_bytes) if fp8_bytes else "cpu"
    threads = threads if fp8_bytes else 1
    with slab_worker(make_encoder(device, threads, rank), device, threads) as encoder:
        yield device, encoder

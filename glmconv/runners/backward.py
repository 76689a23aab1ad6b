"""One mapping backward: Megatron tensors -> HF-named tensors (FP8 encoded where asked), in bounded memory.

Export writes these tensors and the weight-sync API yields them (`glmconv.weight_sync`), so the two cannot differ.
A parameter split on one side is reassembled whatever order its parts arrive in; a fused one is split, stacked
experts a few at a time. Which names group is the rules table's business."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Mapping as Dict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from glmconv import phases
from glmconv.defaults import DEFAULT_CHUNK_BYTES, READ_BUFFER_BYTES
from glmconv.errors import CheckpointError
from glmconv.io.dtypes import torch_dtype
from glmconv.io.read_buffers import ReadBuffers
from glmconv.io.safetensors.like_fp8 import LikeFp8
from glmconv.io.torch_dist.metadata import DcpCheckpoint
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.numerics.finite import NonFiniteError, require_finite
from glmconv.numerics.fp8_encode import Fp8Encoder, Pair
from glmconv.numerics.fp8_reuse import Fp8Blocks
from glmconv.numerics.fp8_reuse import encode as encode_fp8
from glmconv.plan import FP8, Mapping, TensorSpec
from glmconv.rules import names

if TYPE_CHECKING:
    import torch


Rows = tuple[int, int] | None

Read = Callable[[str, Rows], "torch.Tensor"]  # a Megatron tensor of the mapping, whole or rows [start, stop)

Named = tuple[str, "torch.Tensor"]

_STATS_LOCK = threading.Lock()


@dataclass
class Fp8Stats:
    """What FP8 encoding did: weights and blocks written, those re-quantised (the rest are --like's own bytes),
    and of those, scales moved off amax/448 and blocks not reproduced exactly."""

    tensors: int = 0
    blocks: int = 0
    scale_adjusted_blocks: int = 0
    inexact_blocks: int = 0
    requantized_tensors: int = 0
    requantized_blocks: int = 0

    def add(self, other: Fp8Stats) -> None:
        for k in vars(other):
            setattr(self, k, getattr(self, k) + getattr(other, k))


def mapping_hf(m: Mapping, read: Read, dtypes: Dict[str, str], chunk_bytes: int, stats: Fp8Stats,
               like: LikeFp8 | None = None) -> Iterator[Named]:
    """The HF tensors of `m` (FP8 weights followed by their scales), its Megatron tensors taken from `read`;
    stacked experts come `chunk_bytes` of experts at a time, never whole."""
    for _, make in mapping_hf_steps(m, read, dtypes, chunk_bytes, stats, like):
        yield from make()


def mapping_hf_steps(m: Mapping, read: Read, dtypes: Dict[str, str], chunk_bytes: int, stats: Fp8Stats,
                     like: LikeFp8 | None = None,
                     fp8: Fp8Encoder | None = None) -> Iterator[tuple[int, Callable[[], list[Named]]]]:
    """`mapping_hf` step by step: the Megatron bytes each step reads and what makes its HF tensors, so that
    export can run steps ahead on threads (`stats` is added to under a lock; `fp8` encodes FP8 weights, None:
    `fp8_reuse.encode` here). An FP8 weight holding NaN/Inf is refused by its encoding (`_encode_fp8`)."""
    steps = m.row_steps(chunk_bytes)
    if steps is None:
        def whole() -> list[Named]:
            hf = m.rule.transform.backward([read(t.name, None) for t in m.mcore], [t.shape for t in m.hf])
            return _encoded(m, range(len(m.hf)), hf, dtypes, stats, like, fp8)

        yield m.mcore_bytes, whole
        return
    row_bytes = m.mcore_bytes // max(1, m.mcore[0].shape[0])
    for rows, picks in steps:
        def part(rows: range = rows, picks: list[int] = picks) -> list[Named]:
            hf = m.rule.transform.backward([read(m.mcore[0].name, (rows.start, rows.stop))], [])
            return _encoded(m, picks, hf, dtypes, stats, like, fp8)

        yield len(rows) * row_bytes, part


def _encoded(m: Mapping, picks: Iterable[int], tensors: list[torch.Tensor], dtypes: Dict[str, str],
             stats: Fp8Stats, like: LikeFp8 | None, fp8: Fp8Encoder | None) -> list[Named]:
    """A step's HF tensors in the dtypes they are written as, an FP8 one as codes and then its block scales; the
    step's FP8 weights encoded together (`Fp8Encoder.many`: a GPU takes a step's small experts in one call)."""
    specs = [(m.hf[i], m.scales[i]) for i in picks]
    is_fp8 = [_is_fp8(spec, scale, t, dtypes) for (spec, scale), t in zip(specs, tensors, strict=True)]
    weights = [(spec, t) for (spec, _), t, f in zip(specs, tensors, is_fp8) if f]
    blocks = iter(_encode_fp8(weights, like, fp8) if weights else [])
    out: list[Named] = []
    for (spec, scale), t, f in zip(specs, tensors, is_fp8):
        if not f:
            out.append((spec.name, t.to(torch_dtype(dtypes.get(spec.name, spec.dtype))).contiguous()))
            continue
        got = next(blocks)
        with _STATS_LOCK:  # export encodes on reader threads
            stats.add(Fp8Stats(1, got.scales.numel(), got.scale_adjusted, got.inexact, int(got.requantized > 0),
                               got.requantized))
        assert scale is not None  # _is_fp8 refused an FP8 weight without one
        out += [(spec.name, got.codes), (scale.name, got.scales)]
    return out


def _is_fp8(spec: TensorSpec, scale: TensorSpec | None, t: torch.Tensor, dtypes: Dict[str, str]) -> bool:
    """Whether `t`, of the planned shape, is written as FP8 (then with a scale)."""
    if tuple(t.shape) != spec.shape:
        raise CheckpointError(f"{spec.name}: backward transform gave {list(t.shape)}, the plan says {list(spec.shape)}")
    if dtypes.get(spec.name, spec.dtype) != FP8:
        return False
    if scale is None:
        raise CheckpointError(f"{spec.name}: FP8 in the plan without a {names.SCALE_SUFFIX} tensor")
    return True


def _encode_fp8(weights: list[tuple[TensorSpec, torch.Tensor]], like: LikeFp8 | None,
                fp8: Fp8Encoder | None) -> list[Fp8Blocks]:
    """The weights' FP8 bytes (--like's blocks where they reproduce a weight), in order. They are encoded in the
    order they lie in memory, with --like's pairs read together in that order: a step's experts, split from one
    read chunk, then stack without a copy (`Fp8Encoder.many`); encoding is per weight, so the order changes no byte."""
    order = sorted(range(len(weights)), key=lambda i: weights[i][1].data_ptr())
    ws = [weights[i][1] for i in order]
    with phases.busy("like"):
        names = [weights[i][0].name for i in order]
        pairs: list[Pair | None] = [None] * len(names)
        if like is not None:
            pairs = like.pairs(names, pin=fp8 is not None and fp8.pinned)
    with phases.busy("encode"):
        try:
            got = [encode_fp8(t, pair) for t, pair in zip(ws, pairs)] if fp8 is None else fp8.many(ws, pairs)
        except NonFiniteError:  # found where it was encoded (a GPU): named from the copies in hand
            for spec, t in weights:
                require_finite(t, spec.name, "export --fp8")
            for name, pair in zip(names, pairs, strict=True):
                if pair is not None:
                    require_finite(pair[0], name, "--like")
            raise
    by_weight = dict(zip(order, got, strict=True))
    return [by_weight[i] for i in range(len(weights))]


def export_mappings(reader: DcpReader, mappings: list[Mapping], dtypes: dict[str, str] | None = None, *,
                    stored_rows: dict[str, int] | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    stats: Fp8Stats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors (FP8 weights followed by their scales) of `mappings`, read and transformed one group at a time."""
    for m in mappings:
        yield from mapping_tensors(m, reader, dtypes or {}, stored_rows or {}, chunk_bytes, stats or Fp8Stats())


def mapping_tensors(m: Mapping, reader: DcpReader, dtypes: dict[str, str], stored_rows: dict[str, int],
                    chunk_bytes: int, stats: Fp8Stats,
                    like: LikeFp8 | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One mapping backward, read from the `.distcp` files (a padded vocabulary: its first rows) through the
    weight-sync code (`mapping_hf`); stacked experts `chunk_bytes` at a time, never whole."""
    try:
        yield from mapping_hf(m, stored_read(m, lambda: reader, stored_rows), dtypes, chunk_bytes, stats, like)
    finally:
        reader.drop_cache()


def stored_read(m: Mapping, reader: Callable[[], DcpReader], stored_rows: dict[str, int],
                check: bool | None = None) -> Read:
    """How `mapping_hf` reads `m`'s Megatron tensors: whole ones as stored, a padded vocabulary by its first rows
    (`check`: NaN/Inf refused as read, None: as the reader does)."""
    plain = {t.name: (0, t.shape[0]) if t.name in stored_rows else None for t in m.mcore}

    def read(name: str, rows: Rows) -> torch.Tensor:
        with phases.busy("load"):
            return reader().read(name, plain[name] if rows is None else rows, check)

    return read


def stored_steps(m: Mapping, readers: ThreadReaders, stored_rows: dict[str, int], dtypes: Dict[str, str],
                 chunk_bytes: int, stats: Fp8Stats, like: LikeFp8 | None,
                 fp8: Fp8Encoder | None) -> Iterator[tuple[int, Callable[[], list[Named]]]]:
    """`mapping_hf_steps` of `m` read from the `.distcp` files. A mapping written all in FP8 is read without the
    NaN/Inf scan, a pass over every value on the reading thread: its encoding proves each value finite (a reused
    block by reproducing it, a re-quantised one by its own check); a step so refused is read again scanned, so
    that the refusal names the Megatron tensor and its checkpoint as every other does."""
    scanned = mapping_hf_steps(m, stored_read(m, readers.get, stored_rows), dtypes, chunk_bytes, stats, like, fp8)
    if not readers.check_finite or not all(dtypes.get(s.name, s.dtype) == FP8 for s in m.hf):
        yield from scanned
        return
    unscanned = stored_read(m, readers.get, stored_rows, check=False)
    for (nbytes, make), (_, again) in zip(mapping_hf_steps(m, unscanned, dtypes, chunk_bytes, stats, like, fp8),
                                          scanned, strict=True):
        yield nbytes, _rescanned(make, again)


def _rescanned(make: Callable[[], list[Named]], again: Callable[[], list[Named]]) -> Callable[[], list[Named]]:
    """`make`; where its encoding refuses a NaN/Inf, `again` (its reads scanned) first, to refuse it by name."""
    def run() -> list[Named]:
        try:
            return make()
        except NonFiniteError:
            again()
            raise

    return run


class ThreadReaders:
    """One DcpReader per thread (sharing what the first inspected and located), their bytes read summed. Memory:
    each holds at most one stored chunk and READ_BUFFER_BYTES of buffers its reads reuse (CPU memory)."""

    def __init__(self, src: Path, check_finite: bool, ckpt: DcpCheckpoint | None = None, pin: bool = False) -> None:
        """`ckpt`: `src` already inspected (else the first reader inspects it): every reader shares it; `pin`: read
        into pinned memory (what is read goes to a GPU)."""
        self._src, self.check_finite, self._ckpt, self._pin = src, check_finite, ckpt, pin
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[DcpReader] = []

    def get(self) -> DcpReader:
        reader = getattr(self._local, "reader", None)
        if reader is None:
            with self._lock:  # the checkpoint inspected and each chunk located once, shared by every thread's reader
                sibling = self._all[0] if self._all else None
                reader = self._local.reader = DcpReader(self._src, check_finite=self.check_finite, ckpt=self._ckpt,
                                                        pin=self._pin, sibling=sibling,
                                                        buffers=None if self._pin else ReadBuffers(READ_BUFFER_BYTES))
                self._all.append(reader)
        return reader

    @property
    def bytes_read(self) -> int:
        with self._lock:
            return sum(r.bytes_read for r in self._all)


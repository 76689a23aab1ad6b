"""Megatron parameters -> HF-named tensors in bounded memory: what an RL trainer pushes to a rollout engine every
few steps, and what `glmconv export` writes (export's tensors come from `mapping_hf` too, so the two cannot differ).

A parameter split on one side is reassembled whatever order its parts arrive in: only the parts of an incomplete
group are held (the three hc alphas -> the hc scale); a fused one is split (fc1 -> gate/up, the conv -> q/k/v,
stacked experts -> per-expert tensors, a few experts at a time). Which names group is the rules table's business.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Mapping as Dict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from glmconv.config import GlmConfig, load_config
from glmconv.errors import CheckpointError, GlmconvError
from glmconv.plan import FP8, Mapping, Plan, TensorSpec, build_plan
from glmconv.rules import names
from glmconv.rules.layouts import DEFAULT_LAYOUT
from glmconv.runners.flow import DEFAULT_CHUNK_BYTES

if TYPE_CHECKING:
    import torch

    from glmconv.io.fp8_reuse import LikeFp8

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


# ---- one mapping backward: the code export and weight sync share ------------------------------------------

def mapping_hf(m: Mapping, read: Read, dtypes: Dict[str, str], chunk_bytes: int, stats: Fp8Stats,
               like: LikeFp8 | None = None) -> Iterator[Named]:
    """The HF tensors of `m` (FP8 weights followed by their scales), its Megatron tensors taken from `read`;
    stacked experts come `chunk_bytes` of experts at a time, never whole."""
    for _, make in mapping_hf_steps(m, read, dtypes, chunk_bytes, stats, like):
        yield from make()


def mapping_hf_steps(m: Mapping, read: Read, dtypes: Dict[str, str], chunk_bytes: int, stats: Fp8Stats,
                     like: LikeFp8 | None = None) -> Iterator[tuple[int, Callable[[], list[Named]]]]:
    """`mapping_hf` step by step: the Megatron bytes each step reads and what makes its HF tensors, so that
    export can run steps ahead on threads (`stats` is added to under a lock)."""
    steps = m.row_steps(chunk_bytes)
    if steps is None:
        def whole() -> list[Named]:
            hf = m.rule.transform.backward([read(t.name, None) for t in m.mcore], [t.shape for t in m.hf])
            return _encoded(m, range(len(m.hf)), hf, dtypes, stats, like)

        yield m.mcore_bytes, whole
        return
    row_bytes = m.mcore_bytes // max(1, m.mcore[0].shape[0])
    for rows, picks in steps:
        def part(rows: range = rows, picks: list[int] = picks) -> list[Named]:
            hf = m.rule.transform.backward([read(m.mcore[0].name, (rows.start, rows.stop))], [])
            return _encoded(m, picks, hf, dtypes, stats, like)

        yield len(rows) * row_bytes, part


def _encoded(m: Mapping, picks: Iterable[int], tensors: list[torch.Tensor], dtypes: Dict[str, str],
             stats: Fp8Stats, like: LikeFp8 | None) -> list[Named]:
    return [out for i, tensor in zip(picks, tensors, strict=True)
            for out in encode(m.hf[i], m.scales[i], tensor, dtypes, stats, like)]


def encode(spec: TensorSpec, scale: TensorSpec | None, t: torch.Tensor, dtypes: Dict[str, str],
           stats: Fp8Stats, like: LikeFp8 | None = None) -> Iterator[Named]:
    """One HF tensor in the dtype it is written as; an FP8 one as codes and then its block scales."""
    from glmconv.io.dtypes import TORCH_DTYPES

    if tuple(t.shape) != spec.shape:
        raise CheckpointError(f"{spec.name}: backward transform gave {list(t.shape)}, the plan says {list(spec.shape)}")
    dtype = dtypes.get(spec.name, spec.dtype)
    if dtype != FP8:
        yield spec.name, t.to(TORCH_DTYPES[dtype]).contiguous()
        return
    if scale is None:
        raise CheckpointError(f"{spec.name}: FP8 in the plan without a {names.SCALE_SUFFIX} tensor")
    from glmconv.io.finite import require_finite
    from glmconv.io.fp8_reuse import encode as encode_fp8

    require_finite(t, spec.name, "export --fp8")  # a NaN or Inf would wipe its 128x128 block
    fp8 = encode_fp8(t, like.pair(spec.name) if like is not None else None)
    with _STATS_LOCK:  # export encodes on reader threads
        stats.add(Fp8Stats(1, fp8.scales.numel(), fp8.scale_adjusted, fp8.inexact, int(fp8.requantized > 0),
                           fp8.requantized))
    yield spec.name, fp8.codes
    yield scale.name, fp8.scales


# ---- in-process: parameters pushed one at a time, in any order ----------------------------------------------

class WeightSync:
    """Megatron parameters pushed in any order -> HF tensors as soon as each mapping's parts are all in.

    Memory: the parts of incomplete groups (at most the hc alphas, three scalars per site) plus one step's output.
    Yielded tensors may share memory with the pushed ones (a rename in the same dtype is the tensor itself): copy
    them before the trainer updates its parameters in place.
    """

    def __init__(self, plan: Plan, dtypes: Dict[str, str] | None = None, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.plan, self.dtypes, self.chunk_bytes = plan, dict(dtypes or {}), chunk_bytes
        self.stats = Fp8Stats()
        self._parts: dict[str, dict[str, torch.Tensor]] = {}  # a mapping's first Megatron name -> parts in
        self._seen: set[str] = set()

    def push(self, name: str, tensor: torch.Tensor) -> Iterator[Named]:
        """Take one Megatron parameter (checked now: unknown, duplicate, wrong shape); the HF tensors it completes."""
        if names.is_extra_state(name):
            return iter(())  # a TE linear's state-dict entry, not a weight
        m = self.plan.mapping_of_mcore.get(name)
        if m is None:
            raise GlmconvError(f"{name}: not a Megatron parameter of this model (no rule maps it)")
        if name in self._seen:
            raise GlmconvError(f"{name}: pushed twice")
        self._seen.add(name)
        group = self._parts.setdefault(m.mcore[0].name, {})
        group[name] = _fitted(self.plan, self.plan.mcore_index[name], tensor)
        if len(group) < len(m.mcore):
            return iter(())
        del self._parts[m.mcore[0].name]
        return mapping_hf(m, _rows_of(group), self.dtypes, self.chunk_bytes, self.stats)

    def close(self) -> None:
        """Refuse a group left incomplete (some of its parts pushed, not all): its HF tensor was never produced."""
        if not self._parts:
            return
        first, got = next(iter(self._parts.items()))
        m = self.plan.mapping_of_mcore[first]
        missing = [t.name for t in m.mcore if t.name not in got]
        more = f" ({len(self._parts) - 1} more groups are incomplete)" if len(self._parts) > 1 else ""
        raise GlmconvError(f"{missing[0]}: never pushed, so {', '.join(t.name for t in m.hf)} is incomplete "
                           f"(pushed: {', '.join(got)}){more}")


def _rows_of(group: dict[str, torch.Tensor]) -> Read:
    return lambda name, rows: group[name] if rows is None else group[name][rows[0]:rows[1]]


def _fitted(plan: Plan, spec: TensorSpec, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in the plan's shape: a vocabulary Megatron padded loses its extra rows; other shapes are refused."""
    import torch

    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise GlmconvError(f"{spec.name}: expected a floating-point tensor, got {_kind(tensor)}")
    shape = tuple(tensor.shape)
    if shape == spec.shape:
        return tensor
    from glmconv.runners.export import padded_rows

    padded_rows(plan, spec, shape, "the pushed parameters")  # refuses all but a padded vocabulary
    return tensor[: spec.shape[0]]


def _kind(x: object) -> str:
    dtype = getattr(x, "dtype", None)
    return f"{type(x).__name__} of {dtype}" if dtype is not None else type(x).__name__


# ---- the public entry point ---------------------------------------------------------------------------------

def hf_weights(params: Iterable[tuple[str, torch.Tensor]] | str | Path, config: GlmConfig | str | Path | None = None,
               *, fp8: bool = False, dtypes: Dict[str, str] | None = None,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, layout: str = DEFAULT_LAYOUT) -> Iterator[Named]:
    """HF-named tensors of Megatron `params` ((name, tensor) pairs in any order, or a torch_dist directory).

    `layout`: whose torch_dist names in-memory `params` carry (`miles` or `mcore`; a directory says its own).

    `config`: the model's config (a GlmConfig, config.json or a directory holding one; a torch_dist directory
    defaults to the config beside it). `dtypes`: HF name -> safetensors dtype to produce (default: the plan's,
    or for a directory the source dtypes convert recorded, as export). `fp8`: the release's FP8 set, as
    `export --fp8`. Unknown names, duplicates, wrong shapes and groups left incomplete are refused (GlmconvError).
    """
    if isinstance(params, (str, Path)):
        return _from_checkpoint(Path(params), config, fp8, dtypes, chunk_bytes)
    if config is None:
        raise GlmconvError("hf_weights: pass the model's config (a config.json or GlmConfig) with in-memory parameters")
    cfg = config if isinstance(config, GlmConfig) else load_config(config)
    return _pushed(params, WeightSync(build_plan(cfg, fp8=fp8, layout=layout), dtypes, chunk_bytes=chunk_bytes))


def _pushed(params: Iterable[tuple[str, torch.Tensor]], sync: WeightSync) -> Iterator[Named]:
    for name, tensor in params:
        yield from sync.push(name, tensor)
    sync.close()


def _from_checkpoint(src: Path, config: GlmConfig | str | Path | None, fp8: bool, dtypes: Dict[str, str] | None,
                     chunk_bytes: int) -> Iterator[Named]:
    """Export's own stream of `src` (its checks first: plan, stored args, shapes), without writing anything."""
    from glmconv.io.torch_dist.reader import DcpReader
    from glmconv.runners.export import check_loadable, mapping_tensors, source_job

    if isinstance(config, GlmConfig):
        raise GlmconvError("hf_weights: for a torch_dist directory, pass the config as a path (or none)")
    job = source_job(src, config=config, fp8=fp8, config_option=None)
    check_loadable(job.src)
    want = {**job.dtypes, **(dtypes or {})}

    def stream() -> Iterator[Named]:
        reader, stats = DcpReader(src), Fp8Stats()
        for m in job.plan.mappings:
            yield from mapping_tensors(m, reader, want, job.stored_rows, chunk_bytes, stats)

    return stream()

"""Megatron parameters -> HF-named tensors in bounded memory: what an RL trainer pushes to a rollout engine every
few steps, and what `glmconv export` writes (export's tensors come from `mapping_hf` too, so the two cannot differ).

A parameter split on one side is reassembled whatever order its parts arrive in: only the parts of an incomplete
group are held (the three hc alphas -> the hc scale); a fused one is split (fc1 -> gate/up, the conv -> q/k/v,
stacked experts -> per-expert tensors, a few experts at a time). Which names group is the rules table's business.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from collections.abc import Mapping as Dict
from pathlib import Path
from typing import TYPE_CHECKING

from glmconv.arguments import ArgumentError
from glmconv.config import GlmConfig
from glmconv.defaults import DEFAULT_CHUNK_BYTES, DEFAULT_LAYOUT
from glmconv.errors import GlmconvError
from glmconv.io.config_file import load_config
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.plan import Plan, TensorSpec, build_plan
from glmconv.rules import names
from glmconv.runners.backward import Fp8Stats, Named, Read, mapping_hf, mapping_tensors
from glmconv.runners.export_job import check_loadable, padded_rows, source_job
from glmconv.text import show

if TYPE_CHECKING:
    import torch

# ---- one mapping backward: the code export and weight sync share ------------------------------------------


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
    if not isinstance(config, (GlmConfig, str, os.PathLike)):
        raise ArgumentError("config", config, "expected a GlmConfig, or a config.json or checkpoint directory (a str "
                            "or pathlib.Path)")
    cfg = config if isinstance(config, GlmConfig) else load_config(config)
    return _pushed(params, WeightSync(build_plan(cfg, fp8=fp8, layout=layout), dtypes, chunk_bytes=chunk_bytes))


def _pushed(params: Iterable[tuple[str, torch.Tensor]], sync: WeightSync) -> Iterator[Named]:
    for i, pair in enumerate(params):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise GlmconvError(f"glmconv.hf_weights(): params[{i}]={show(pair, quote=True)}: expected a (Megatron "
                               f"name, tensor) pair")
        yield from sync.push(*pair)
    sync.close()


def _from_checkpoint(src: Path, config: GlmConfig | str | Path | None, fp8: bool, dtypes: Dict[str, str] | None,
                     chunk_bytes: int) -> Iterator[Named]:
    """Export's own stream of `src` (its checks first: plan, stored args, shapes), without writing anything."""

    if isinstance(config, GlmConfig):
        raise GlmconvError("hf_weights: for a torch_dist directory, pass the config as a path (or none)")
    job = source_job(src, config=config, fp8=fp8, config_option=None)
    check_loadable(job.src, job.source)
    want = {**job.dtypes, **(dtypes or {})}

    def stream() -> Iterator[Named]:
        reader, stats = DcpReader(src), Fp8Stats()
        for m in job.plan.mappings:
            yield from mapping_tensors(m, reader, want, job.stored_rows, chunk_bytes, stats)

    return stream()

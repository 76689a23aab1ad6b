"""How much memory a parity run needs and took: refuse a resident run that cannot fit, report the peak.

A resident run holds both models' weights; past the device's free memory it would die half-way in an
out-of-memory error, so it is refused up front with the way out (`--stream-layers`, one layer at a time).
"""

from __future__ import annotations

import math
import resource
import sys
from typing import TYPE_CHECKING, Any

from glmconv.config import GlmConfig
from glmconv.errors import GlmconvError
from glmconv.plan import build_plan
from glmconv.rules import roles as R

if TYPE_CHECKING:
    import torch


HEADROOM = 0.9  # share of the free memory a resident run may plan to fill (activations need the rest)


def resident_bytes(config: GlmConfig, dtype: torch.dtype) -> int:
    """Both sides' weights held at once: every text tensor in the model dtype (experts in BF16, as stored)."""

    import torch

    size = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for m in build_plan(config, mtp=False, vision=False).mappings:
        per = 2 if m.rule.role in (R.MOE_EXPERTS_FC1, R.MOE_EXPERTS_FC2) else size
        total += sum(math.prod(t.shape) for t in m.hf) * per
    return 2 * total


def free_bytes(device: torch.device) -> int:
    """Free memory where the weights go: the CUDA device's, or the host's available RAM."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as fh:
        info = {line.split(":")[0]: line.split()[1] for line in fh}
    return int(info.get("MemAvailable", 0)) * 1024


def check_resident_fits(config: GlmConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a resident run whose weights cannot fit, naming the flag that makes it fit."""
    need, free = resident_bytes(config, dtype), free_bytes(device)
    if free and need > HEADROOM * free:
        raise GlmconvError(f"holding both models needs ~{need / 1e9:.1f} GB on {device} but {free / 1e9:.1f} GB "
                           "are free: add --stream-layers (one layer at a time)")


def start_peak(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """The run's peak memory: allocated CUDA memory on a GPU, the process's peak RSS on the CPU."""
    import torch

    if device.type == "cuda":
        return {"device": str(device), "bytes": int(torch.cuda.max_memory_allocated(device)),
                "what": "torch.cuda.max_memory_allocated"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"device": "cpu", "bytes": int(rss), "what": "peak RSS of the process"}

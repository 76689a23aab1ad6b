"""Two ranks, megatron-core's own load and save, then glmconv export: a trainer's multi-rank round trip.

    torchrun --nproc-per-node 2 benchmarks/multirank_roundtrip.py --backend gloo|nccl --fixture HF_DIR \
        [--layout miles|mcore] [--work DIR] [--json-out FILE]

1. Rank 0 converts the HF fixture (`glmconv fixture make DIR --preset cut8`) in the Megatron layout `--layout`;
   both ranks load it through `megatron.core.dist_checkpointing.load` at TP2, EP2 and TP2xEP2 (ETP1), with the
   sharded state dict a trainer requests (`glmconv.mcore_layout.plan_pieces`: the shard kind of each tensor's
   role and transform, column/row/SwiGLU/expert shards, plus every `_extra_state`; `strict="raise_all"`, or in a
   layout with homeless tensors `"return_all"` with the stored-but-unrequested keys required to be exactly the
   `glmconv_kept.` ones), and compare every local shard bit for bit with the same slice of the tensor glmconv's
   rules compute from the HF files (forward; `glmconv verify` below checks the rules against the HF files).
   Kept tensors are then loaded whole on their own (no trainer module asks for them) so the save carries them.
2. The TP2xEP2 shards are saved back with `dist_checkpointing.save` (both ranks write `.distcp` files; row-parallel
   weights split along dim 1, column-parallel and experts along dim 0, expert fc1 along dims 0 and 1) with the
   common state loaded; rank 0 then writes the tracker, as Megatron-LM's trainer does. No glmconv file is copied.
3. Rank 0 exports it (`--config`, `--like` the fixture: what a trainer's checkpoint needs) in this process,
   counting chunks read through torch.load, checks every HF tensor bit for bit against the fixture, and runs
   `glmconv audit-names SAVED --against FIXTURE` and `glmconv verify FIXTURE SAVED` (exit codes recorded).

Without CUDA, megatron's save calls `torch.cuda.synchronize()` and `torch.cuda.current_device()`; they are stubbed
then (docs/torch_dist.md (e)). With `--backend nccl` each rank uses the GPU of its local rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

LAYOUTS = {"tp2": dict(tp=2, ep=1, etp=2), "ep2": dict(tp=1, ep=2, etp=1), "tp2xep2": dict(tp=2, ep=2, etp=1)}
SAVE_LAYOUT = "tp2xep2"
RELEASE = "release"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@contextmanager
def alone() -> Iterator[None]:
    """glmconv in this process as one process (it would otherwise take torchrun's RANK/WORLD_SIZE as its own)."""
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def expected_mcore(fixture: Path, layout: str) -> dict[str, torch.Tensor]:
    """Every Megatron tensor of the plan, computed from the HF files by glmconv's rules (forward)."""
    from glmconv.io.dtypes import torch_dtype
    from glmconv.io.safetensors.reader import HfTensorSource
    from glmconv.runners import convert

    job = convert.source_job(fixture, layout=layout)
    out: dict[str, torch.Tensor] = {}
    with HfTensorSource(job.files) as source:
        for m in job.plan.mappings:
            dtype = torch_dtype(m.mcore[0].dtype)
            hf = [source.weight(t.name, dtype) for t in m.hf]
            out.update(zip((t.name for t in m.mcore), m.rule.transform.forward(hf, len(m.mcore))))
    return out


def init_layout(tp: int, ep: int, etp: int) -> Any:
    """megatron-core's parallel state for one layout on the world of 2; this rank's place in it."""
    from megatron.core import parallel_state

    from glmconv.mcore_layout import ranks_from_parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    return ranks_from_parallel_state()


def requests(plan: Any, r: Any, device: str) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The sharded state dict a trainer at layout `r` loads (tensors and `_extra_state` objects), and per key
    the Piece and spec each tensor request came from."""
    from glmconv.io.dtypes import torch_dtype
    from glmconv.mcore_layout import object_request, plan_pieces

    sd: dict[str, Any] = {}
    origin: dict[str, tuple[Any, Any]] = {}
    for spec, pieces in plan_pieces(plan, r):
        for i, piece in enumerate(pieces):
            key = f"{spec.name}#{i}"
            sd[key] = piece.request(spec.shape, torch_dtype(spec.dtype), device=device)
            origin[key] = (piece, spec)
    sd.update({k: o for k in plan.mcore_objects() if (o := object_request(k, r)) is not None})
    return sd, origin


def kept_requests(plan: Any, r: Any, device: str) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The homeless (`glmconv_kept.`) tensors, whole and replicated: no trainer asks for them; the save carries
    them so that export has the whole model back."""
    from glmconv.io.dtypes import torch_dtype
    from glmconv.mcore_layout import Piece

    sd: dict[str, Any] = {}
    origin: dict[str, tuple[Any, Any]] = {}
    for spec in (t for m in plan.homeless() for t in m.mcore):
        piece = Piece(spec.name, (), (), (0, r.tp_rank, r.dp_rank))
        sd[spec.name] = piece.request(spec.shape, torch_dtype(spec.dtype), device=device)
        origin[spec.name] = (piece, spec)
    return sd, origin


def load_layout(plan: Any, ckpt: Path, r: Any, want: dict[str, torch.Tensor], device: str) -> tuple[dict, dict]:
    """Load at layout `r`; (figures, what was loaded and how it was requested, for the save)."""
    from megatron.core import dist_checkpointing

    sd, origin = requests(plan, r, device)
    kept = {t.name for m in plan.homeless() for t in m.mcore}
    start = time.monotonic()
    if kept:  # stored, requested by no trainer: megatron's "missing" keys, exactly these
        loaded, missing, unexpected = dist_checkpointing.load(sd, str(ckpt / RELEASE), strict="return_all")
        if set(missing) != kept or unexpected:
            raise AssertionError(f"unrequested {sorted(set(missing) ^ kept)[:5]}, absent {sorted(unexpected)[:5]}")
    else:
        loaded = dist_checkpointing.load(sd, str(ckpt / RELEASE), strict="raise_all")
    seconds = time.monotonic() - start
    if kept:
        ksd, korigin = kept_requests(plan, r, device)
        loaded.update(dist_checkpointing.load(ksd, str(ckpt / RELEASE)))
        origin = {**origin, **korigin}
    equal = sum(_same(loaded[k].cpu(), want[spec.name][piece.index]) for k, (piece, spec) in origin.items())
    state = {"loaded": loaded, "origin": origin}
    return {"pieces": len(origin), "kept_unrequested": len(kept), "bit_exact": equal,
            "load_s": round(seconds, 3)}, state


def save_layout(state: dict, plan: Any, out: Path, rank: int, device: str) -> float:
    """megatron-core's own save of the loaded shards (tensors, objects, common state); seconds."""
    from megatron.core import dist_checkpointing

    from glmconv.io.dtypes import torch_dtype
    from glmconv.io.file_names import TRACKER_NAME

    loaded, origin = state["loaded"], state["origin"]
    sd: dict[str, Any] = {k: piece.request(spec.shape, torch_dtype(spec.dtype), data=loaded[k])
                          for k, (piece, spec) in origin.items()}
    for key, obj in requests(plan, _ranks(), device)[0].items():
        if key not in origin:  # an _extra_state object: saved with the value loaded
            obj.data = loaded[key]
            sd[key] = obj
    sd.update({k: loaded[k] for k in ("args", "checkpoint_version", "iteration")})
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        (out / RELEASE).mkdir(parents=True)
    dist.barrier()
    with ExitStack() as stack:
        if not torch.cuda.is_available():  # megatron's save calls these unconditionally
            stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None))
            stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        start = time.monotonic()
        dist_checkpointing.save(sd, str(out / RELEASE))
        dist.barrier()
        seconds = time.monotonic() - start
    if rank == 0:
        (out / TRACKER_NAME).write_text(RELEASE)
    return seconds


def _ranks() -> Any:
    from glmconv.mcore_layout import ranks_from_parallel_state

    return ranks_from_parallel_state()


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    bits = ints[got.element_size()]
    return bool(torch.equal(got.contiguous().view(bits), want.contiguous().view(bits)))


def chunk_dims(saved: Path) -> dict[str, int]:
    """How many stored tensors have chunks split along each dim (what the save really wrote)."""
    from glmconv.io.torch_dist.reader import DcpReader

    reader = DcpReader(saved)
    dims: dict[str, int] = {}
    for name in reader.names():
        size = reader.shape(name)
        split = {d for off, sz in reader.chunks(name) for d in range(len(size)) if sz[d] != size[d]}
        for d in split:
            dims[f"dim{d}"] = dims.get(f"dim{d}", 0) + 1
    return dict(sorted(dims.items()))


def export_check(saved: Path, fixture: Path, out: Path) -> dict[str, Any]:
    """glmconv export of the megatron-saved checkpoint (torch.load calls counted), compared with the fixture."""
    from glmconv.io.torch_dist.reader import DcpReader
    from glmconv.runners import export

    loads: list[str] = []
    real = DcpReader._load

    def counted(self: DcpReader, name: str, chunk: Any) -> torch.Tensor:
        loads.append(name)
        return real(self, name, chunk)

    shutil.rmtree(out, ignore_errors=True)
    with mock.patch.object(DcpReader, "_load", counted):
        start = time.monotonic()
        job = export.prepare(saved, out, like=fixture, config=fixture / "config.json")
        summary = export.export(job, export.ExportOptions(progress=False))
        seconds = time.monotonic() - start
    got, want = _safetensors(out), _safetensors(fixture)
    same = sum(_same(got[n], t) for n, t in want.items() if n in got)
    return {"export_s": round(seconds, 3), "hf_tensors": len(want), "bit_exact": same,
            "extra": len(set(got) - set(want)), "chunks_via_torch_load": len(loads), "bytes_in": summary["bytes_in"]}


def _safetensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def cli(*args: str) -> tuple[int, float]:
    """`python -m glmconv ARGS` outside torchrun's environment (else it would join this world); exit code, seconds."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "glmconv", *args], env=env, capture_output=True, text=True)
    if done.returncode:
        print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
    return done.returncode, round(time.monotonic() - start, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--fixture", type=Path, required=True, help="HF checkpoint (glmconv fixture make --preset cut8)")
    p.add_argument("--layout", choices=("miles", "mcore"), default="miles", help="the Megatron layout converted")
    p.add_argument("--work", type=Path, default=Path("/tmp/glmconv-multirank"))
    p.add_argument("--json-out", type=Path)
    a = p.parse_args()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = "cpu"
    if a.backend == "nccl":
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group(a.backend)
    assert dist.get_world_size() == 2, "run with torchrun --nproc-per-node 2"
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    fixture, converted, saved = a.fixture.resolve(), a.work / "converted", a.work / "megatron-saved"
    result: dict[str, Any] = {"backend": a.backend, "layout": a.layout, "device": device, "torch": torch.__version__}
    if rank == 0:
        from glmconv.runners import convert

        shutil.rmtree(a.work, ignore_errors=True)
        a.work.mkdir(parents=True)
        start = time.monotonic()
        with alone():
            convert.convert(convert.prepare(fixture, converted, layout=a.layout), convert.RunOptions(progress=False))
        result["convert_s"] = round(time.monotonic() - start, 3)
    dist.barrier()
    from glmconv.runners import convert

    plan = convert.source_job(fixture, layout=a.layout).plan
    want = expected_mcore(fixture, a.layout)
    layouts, state = {}, None
    for name, sizes in LAYOUTS.items():
        r = init_layout(**sizes)
        figures, state = load_layout(plan, converted, r, want, device)
        layouts[name] = _gathered(figures)
    result["load"] = layouts
    result["save_s"] = round(save_layout(state, plan, saved, rank, device), 3)  # the last layout: TP2xEP2
    if rank == 0:
        result["saved_chunks_split_along"] = chunk_dims(saved)
        with alone():
            result["export"] = export_check(saved, fixture, a.work / "exported")
        code, secs = cli("audit-names", str(saved), "--against", str(fixture), "--config", str(fixture / "config.json"))
        result["audit_names_against"] = {"exit": code, "s": secs}
        code, secs = cli("verify", str(fixture), str(saved))
        result["verify"] = {"exit": code, "s": secs}
        print(json.dumps(result, indent=2))
        if a.json_out:
            a.json_out.parent.mkdir(parents=True, exist_ok=True)
            a.json_out.write_text(json.dumps(result, indent=2) + "\n")
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _gathered(figures: dict[str, Any]) -> dict[str, Any]:
    """Both ranks' figures: pieces and bit-exact pieces summed, the slower rank's load time."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, figures)
    return {"pieces": sum(f["pieces"] for f in every), "bit_exact": sum(f["bit_exact"] for f in every),
            "kept_unrequested": every[0]["kept_unrequested"], "load_s": max(f["load_s"] for f in every)}


if __name__ == "__main__":
    main()

"""Converted checkpoints load through megatron-core's `dist_checkpointing` at TP=1, TP=2 and EP=2, in both
Megatron layouts (`convert --layout miles|mcore`).

Per parallel layout, one group of 2 gloo processes on CPU (spawned, like tests/helpers/mcore_helpers.py) loads the
converted `tiny`, `tiny --fp8` and `cut8` of each Megatron layout with a sharded state dict of
`ShardedTensor.from_rank_offsets` requests for every tensor of the plan a trainer requests (as it shards it:
`mcore_helpers.plan_pieces`, the shard kind of each tensor's role and transform) plus every `_extra_state`
ShardedObject (Transformer Engine linears and norms; for the mcore layout exactly the keys of the recorded
Megatron-Bridge model inventory, tests/helpers/bridge_inventory.py), at `strict="raise_all"`: nothing requested is
missing, nothing stored is left unrequested. The mcore layout's homeless tensors (`glmconv_kept.`: kept for export, no
trainer parameter) are in the `glmconv_kept/` sidecar beside the DCP, which megatron never reads.
Every local shard must equal the same slice of `mcore_helpers.reference_mcore` (computed from the HF files
alone; FP8 sources dequantised block by block; the mcore layout's names from its plan), bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import bridge_inventory
from helpers import mcore_helpers as mh

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FIXTURES = ("tiny", "tiny-fp8", "cut8")
MEGATRON_LAYOUTS = ("miles", "mcore")
PARALLEL = {"tp1": dict(tp=1, ep=1), "tp2": dict(tp=2, ep=1), "ep2": dict(tp=1, ep=2)}
KEPT_PREFIX = "glmconv_kept."
Case = tuple[str, str, str, str]  # (fixture, Megatron layout, HF dir, converted root)


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tiny_fp8_ckpt: Path, cut8_ckpt: Path,
              tmp_path_factory: pytest.TempPathFactory) -> list[Case]:
    """Each fixture converted once per Megatron layout, in this process."""
    from glmconv.runners.convert import RunOptions, convert, prepare

    root = tmp_path_factory.mktemp("converted")
    out = []
    for layout in MEGATRON_LAYOUTS:
        (root / layout).mkdir()
        for name, src in zip(FIXTURES, (tiny_ckpt, tiny_fp8_ckpt, cut8_ckpt)):
            convert(prepare(src, root / layout / name, layout=layout), RunOptions(progress=False))
            out.append((name, layout, str(src), str(root / layout / name)))
    return out


def _check_fixture(name: str, layout: str, src: str, root: str, r: mh.Ranks) -> int:
    """Load one converted checkpoint at this rank's parallel layout; returns the number of local pieces compared."""
    from glmconv.io.dtypes import torch_dtype
    from glmconv.runners.convert import prepare

    plan = prepare(src, Path(root) / "unused", layout=layout).plan
    want = mh.reference_mcore(src, layout=layout)
    assert set(plan.mcore_index) == set(want), f"{name} {layout}: plan and reference disagree on the tensor set"
    request, expected = {}, {}
    for spec, pieces in mh.plan_pieces(plan, r):
        for i, piece in enumerate(pieces):
            request[f"{spec.name}#{i}"] = piece.request(spec.shape, torch_dtype(spec.dtype))
            expected[f"{spec.name}#{i}"] = want[spec.name][piece.index]
    kept = {t.name for m in plan.homeless() for t in m.mcore}
    requested = {k.split("#")[0] for k in request}
    assert requested | kept == set(plan.mcore_index) and not requested & kept, f"{name} {layout}"
    assert all(k.startswith(KEPT_PREFIX) for k in kept) and bool(kept) == (layout == "mcore"), f"{name} {layout}"
    objects = {k: o for k in plan.mcore_objects() if (o := mh.object_request(k, r)) is not None}
    ckpt = str(Path(root) / "release")
    if layout == "mcore" and name != "tiny-fp8":  # what is requested is the Megatron-Bridge model's own inventory
        bridge = bridge_inventory.recorded(name)
        assert (requested, set(plan.mcore_objects())) == (set(bridge.tensors), bridge.objects), name
    loaded = mh.load({**request, **objects}, ckpt, strict="raise_all")  # the kept tensors: in the sidecar
    for key, t in expected.items():
        mh.assert_same(f"{name} {layout}: {key} at {r}", loaded[key], t)
    for key in objects:
        value = loaded[key]
        assert isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.numel() == 0, (key, value)
    assert (loaded["checkpoint_version"], loaded["iteration"]) == (3.0, 0)
    assert loaded["args"].num_layers == plan.config.num_layers
    # the mcore layout's trainer has no MTP module: its MTP tensors are kept only, and the args say so
    mtp_layers = None if layout == "mcore" else plan.config.num_mtp_layers or None
    assert loaded["args"].mtp_num_layers == mtp_layers, f"{name} {layout}"
    return len(expected)


def _load_worker(rank: int, tp: int, ep: int, cases: list[Case], counts_file: str) -> None:
    mh.init_parallel(tp=tp, ep=ep)
    r = mh.ranks_from_parallel_state()
    assert (r.tp, r.ep) == (tp, ep)
    counts = {(name, layout): _check_fixture(name, layout, src, root, r) for name, layout, src, root in cases}
    torch.save({"ranks": r, "counts": counts}, f"{counts_file}.{rank}")


@pytest.mark.parametrize("layout", list(PARALLEL))
def test_megatron_loads_every_tensor_and_extra_state_at_layout(layout: str, converted: list[Case],
                                                               tmp_path: Path) -> None:
    """Both Megatron layouts of every fixture, in one group of 2 processes per parallel layout."""
    mh.spawn(_load_worker, PARALLEL[layout]["tp"], PARALLEL[layout]["ep"], converted, str(tmp_path / "counts"))
    seen = [torch.load(tmp_path / f"counts.{rank}", weights_only=False) for rank in (0, 1)]
    ranks = [s["ranks"] for s in seen]
    if layout == "tp2":  # the two ranks hold different halves of every split tensor and expert
        assert [(x.tp_rank, x.etp, x.etp_rank) for x in ranks] == [(0, 2, 0), (1, 2, 1)]
    elif layout == "ep2":  # each rank loads its own 4 of the 8 experts
        assert [(x.ep, x.ep_rank, x.tp) for x in ranks] == [(2, 0, 1), (2, 1, 1)]
    else:  # data parallel: both ranks load everything, one as the main replica
        assert [(x.tp, x.ep, x.dp_rank) for x in ranks] == [(1, 1, 0), (1, 1, 1)]
    for name in FIXTURES:
        assert all(s["counts"][(name, "miles")] > 150 for s in seen), seen
        assert all(s["counts"][(name, "mcore")] > 80 for s in seen), seen


def test_common_state_and_tensor_metadata_read_through_megatron(converted: list[Case]) -> None:
    """`load_common_state_dict` and `load_tensors_metadata`, in this process (neither needs a process group)."""
    from megatron.core import dist_checkpointing

    from glmconv.runners.convert import prepare

    for name, layout, src, root in converted:
        ckpt = str(Path(root) / "release")
        plan = prepare(src, Path(root) / "unused", layout=layout).plan
        common = dist_checkpointing.load_common_state_dict(ckpt)
        assert (common["checkpoint_version"], common["iteration"]) == (3.0, 0), name
        t = plan.config.text
        args = common["args"]
        assert (args.num_layers, args.hidden_size, args.num_experts) == (
            t["num_hidden_layers"], t["hidden_size"], t["n_routed_experts"]), name
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
        assert args.mtp_num_layers == (None if layout == "mcore" else plan.config.num_mtp_layers), (name, layout)
        meta = dist_checkpointing.load_tensors_metadata(ckpt)  # megatron sees no kept tensor: they are beside it
        want = {k: v for k, v in mh.reference_mcore(src, layout=layout).items() if not k.startswith(KEPT_PREFIX)}
        assert sorted(meta) == sorted(want), name
        for key, t_ in want.items():
            assert (tuple(meta[key].global_shape), meta[key].dtype) == (tuple(t_.shape), t_.dtype), key

"""The mcore layout is exactly what a Megatron-Bridge glm5_next trainer requests at load, both ways.

`tests/helpers/bridge_inventory.py` derives that request from the model specs (megatron-core 0.19.2's own modules where
it has them, the bridge's recorded spec for the hyper-connections and KDA, Transformer Engine stand-ins): every
ShardedTensor key with its global shape and every ShardedObject (`_extra_state`) key of
`GPTModel.sharded_state_dict()`. Its output is recorded in `fixtures/bridge-inventory/<config>.json` for the
tiny and cut8 presets, the release's config, and cut8-shared (cut8 with DSA layer 7's indexer "shared").

(a) the generator still reproduces the recorded inventories (one spawned gloo process builds all four, meta
    tensors, about 15 s); a deliberate change is recorded again with
    `.venv/bin/python tests/helpers/bridge_inventory.py` and reviewed in `git diff fixtures/bridge-inventory`;
(b) the recorded inventories equal the mcore plan's loadable tensors (all but `glmconv_kept.`) with their shapes,
    and its `_extra_state` objects, for every config, both ways.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers.bridge_inventory import CONFIGS, SHARED_INDEXER, bridge_inventories, config, recorded

from glmconv.plan import build_plan

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _differences(want: dict[str, Any] | set[str], got: dict[str, Any] | set[str], want_side: str,
                 got_side: str) -> list[str]:
    out = []
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        out.append(f"{len(missing)} in {want_side}, missing from {got_side}:\n  " + "\n  ".join(missing))
    if extra:
        out.append(f"{len(extra)} in {got_side}, missing from {want_side}:\n  " + "\n  ".join(extra))
    if isinstance(want, dict) and isinstance(got, dict):
        shapes = [f"{k}: {want_side} {want[k]}, {got_side} {got[k]}" for k in sorted(set(want) & set(got))
                  if tuple(want[k]) != tuple(got[k])]
        if shapes:
            out.append(f"{len(shapes)} shaped differently:\n  " + "\n  ".join(shapes))
    return out


def test_the_generator_reproduces_the_recorded_inventories() -> None:
    """One test for all configs: one spawned process builds them, whatever pytest-xdist's distribution."""
    generated = bridge_inventories({name: config(name) for name in CONFIGS})
    problems = []
    for name in CONFIGS:
        want, got = recorded(name), generated[name]
        problems += [f"{name}: {p}" for p in _differences(want.tensors, got.tensors, "the recording", "the generator")
                     + _differences(want.objects, got.objects, "the recording", "the generator")]
    if problems:
        pytest.fail("the generator's inventory is not the recorded one (after a deliberate change: "
                    ".venv/bin/python tests/helpers/bridge_inventory.py)\n" + "\n".join(problems))


@pytest.mark.parametrize("name", CONFIGS)
def test_the_mcore_plan_loads_exactly_what_the_bridge_requests(name: str) -> None:
    bridge = recorded(name)
    plan = build_plan(config(name), layout="mcore")
    tensors = {t.name: t.shape for t in plan.mcore_tensors() if not t.name.startswith("glmconv_kept.")}
    objects = set(plan.mcore_objects())
    problems = (_differences(bridge.tensors, tensors, "the bridge's request", "the mcore plan")
                + _differences(bridge.objects, objects, "the bridge's request", "the mcore plan (objects)"))
    if problems:
        pytest.fail(f"{name}:\n" + "\n".join(problems))


def test_the_recordings_have_every_kind_of_layer() -> None:
    """The fixtures cover KDA and DSA attention, dense and MoE MLPs, shared and routed experts."""
    release = recorded("release")
    cfg = config("release")
    for i, (attn, mlp) in enumerate(zip(cfg.attn_types, cfg.mlp_types)):
        p = f"decoder.layers.{i}."
        probe = {"kda": p + "self_attention.q_conv1d.weight",
                 "dsa": p + "self_attention.core_attention.indexer.linear_wk.weight"}[attn]
        assert probe in release.tensors, probe
        fc1 = {"dense": p + "mlp.linear_fc1.layer_norm_weight", "moe": p + "mlp.experts.experts.linear_fc1.weight"}
        assert fc1[mlp] in release.tensors, fc1[mlp]
    experts = cfg.text["n_routed_experts"]
    assert release.tensors["decoder.layers.3.mlp.experts.experts.linear_fc1.weight"][0] == experts
    assert {k for k in release.objects if k.startswith("decoder.layers.3.mlp.experts.experts.linear_fc2.")} == {
        f"decoder.layers.3.mlp.experts.experts.linear_fc2._extra_state/shard_{e}_{experts}" for e in range(experts)}


def test_a_dsa_layer_without_its_own_indexer_has_no_indexer_keys_and_nothing_else_changes() -> None:
    shared, layer = SHARED_INDEXER
    full, reuse = recorded("cut8"), recorded(shared)
    indexer = f"decoder.layers.{layer}.self_attention.core_attention.indexer."
    assert config(shared).indexer_full[layer] is False and config("cut8").attn_types[layer] == "dsa"
    assert {k for k in full.tensors if k.startswith(indexer)} and {k for k in full.objects if k.startswith(indexer)}
    assert reuse.tensors == {k: v for k, v in full.tensors.items() if not k.startswith(indexer)}
    assert reuse.objects == {k for k in full.objects if not k.startswith(indexer)}

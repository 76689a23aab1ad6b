"""`parity --train-backend megatron` at TP 1: megatron-core's own DSA attention and MoE modules as the train side.

One spawned gloo process (megatron-core 0.19.2 on CPU, its unfused torch path) per fixture converts nothing: the
`tiny` and `cut8` fixtures are converted to the mcore layout here, then the worker
  - loads megatron-core's modules from the converted checkpoint through `dist_checkpointing.load` of their own
    `sharded_state_dict()` (strict: glmconv.models.megatron.load) and records what they requested;
  - runs `run_parity` with the megatron backend (isolated, glmconv's own parts on serve's conventions) and reads
    each record's `impl`;
  - runs it on a copy of the checkpoint with one expert's weights altered (a defect planted in what megatron-core
    loads), which the verdict must name at its layer;
  - measures the findings at sub-block level (test_megatron_findings.py asserts on them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import mcore_helpers as mh

from glmconv.rules.modules import attention_prefix, mlp_prefix

pytestmark = pytest.mark.filterwarnings("ignore")
FIXTURES = ("tiny", "cut8")
PLANTED = {"tiny": 2, "cut8": 4}  # a MoE layer (tiny's is before its DSA layer: the first divergence)
TOKENS, SEQUENCES = 64, 2


@pytest.fixture(scope="module")
def mcore_pairs(tiny_ckpt: Path, cut8_ckpt: Path,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Each fixture and its mcore-layout conversion."""
    from glmconv.runners.convert import RunOptions, convert, prepare

    root = tmp_path_factory.mktemp("mcore")
    out = {}
    for name, src in zip(FIXTURES, (tiny_ckpt, cut8_ckpt)):
        convert(prepare(src, root / name, layout="mcore"), RunOptions(progress=False))
        out[name] = (str(src), str(root / name))
    return out


def _planted(mc: str, dst: Path, layer: int) -> str:
    """A copy of `mc` with expert 0's fc1 of `layer` scaled by 1.5 (in what megatron-core loads)."""
    from glmconv.io.config_file import load_config
    from glmconv.plan import build_plan
    from glmconv.rules import roles as R

    plan = build_plan(load_config(mc), layout="mcore")
    (spec,) = next(m for m in plan.mappings if m.layer == layer and m.rule.role == R.MOE_EXPERTS_FC1).mcore

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t = tensors[spec.name].clone()
        t[0] = (t[0].float() * 1.5).to(t.dtype)
        return {**tensors, spec.name: t}

    return str(mh.rewrite_dcp(Path(mc), dst, edit, keep=("config.json", "glmconv.json")))


def _parity(hf: str, mc: str, self_test: bool = False, dtype: str = "fp32", mode: str = "isolated",
            stream: bool = False) -> dict[str, Any]:
    from glmconv.compare import ParityOptions, run_parity

    return run_parity(ParityOptions(Path(hf), Path(mc), tokens=TOKENS, sequences=SEQUENCES, mode=mode,
                                    train_conventions="serve", progress=False, train_backend="megatron",
                                    self_test=self_test, dtype=dtype, stream_layers=stream))


def _streamed(hf: str, mc: str) -> dict[str, Any]:
    """bf16 propagated runs held whole and streamed, and the most layers the streamed run's modules (the bf16 set
    and its fp32 twin) held at once, with each layer's loads."""
    from glmconv.models.megatron.load import MegatronModules

    real = MegatronModules._module
    held: list[int] = []
    both: list[int] = []  # modules held in both dtypes at once
    loads: list[tuple[str, str]] = []

    def spy(self: MegatronModules, prefix: str, layer: int) -> Any:
        if prefix not in self.prefixed():
            loads.append((str(self.dtype), prefix))
        out = real(self, prefix, layer)
        held.append(len({layer for layer, _ in self._held.values()}))
        other = self.source or self._precise
        both.append(len(set(self._held) & set(other._held)) if other is not None else 0)
        return out

    whole = _parity(hf, mc, dtype="bf16", mode="propagated")
    MegatronModules._module = spy  # type: ignore[method-assign]
    try:
        streamed = _parity(hf, mc, dtype="bf16", mode="propagated", stream=True)
    finally:
        MegatronModules._module = real  # type: ignore[method-assign]
    return {"whole": whole, "streamed": streamed, "most_layers_held": max(held), "most_in_both_dtypes": max(both),
            "loads": loads}


def _worker(rank: int, hf: str, mc: str, planted_dir: str, layer: int, out: str) -> None:
    from helpers import megatron_findings
    from helpers.mixed_dtypes import MixedDtypes

    from glmconv.io.config_file import load_config
    from glmconv.models.megatron import load_modules
    from glmconv.models.weights import MegatronWeights

    mh.init_parallel()
    config = load_config(hf)
    modules = load_modules(config, mc, MegatronWeights(mc).layout, torch.float32, torch.device("cpu"))
    requested: set[str] = set()
    for prefix, module in modules.prefixed().items():
        requested |= {v.key for v in _sharded_tensors(module.sharded_state_dict(prefix=prefix))}
    clean = _parity(hf, mc, self_test=True)
    planted = _parity(hf, _planted(mc, Path(planted_dir), layer))
    findings = megatron_findings.measure(hf, mc, TOKENS, SEQUENCES)
    from megatron.core.transformer.experimental_attention_variant import dsa

    from glmconv.models.megatron.model import spied

    rotated: list[Any] = []
    with spied(dsa, "rotate_activation", rotated), MixedDtypes() as mixed:
        bf16 = _parity(hf, mc, dtype="bf16")
    torch.save({"requested": requested, "prefixes": list(modules.prefixed()), "hadamard": modules.hadamard,
                "clean": clean, "planted": planted, "findings": findings, "bf16": bf16,
                "rotated": [t.dtype for t in rotated], "mixed_dtypes": sorted(set(mixed.found)),
                "streamed": _streamed(hf, mc)}, out)


def _sharded_tensors(sd: dict[str, Any]) -> list[Any]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sd)
    return [v for v in nested_values(sd) if isinstance(v, ShardedTensor)]


@pytest.fixture(scope="module")
def runs(mcore_pairs: dict[str, tuple[str, str]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, (hf, mc) in mcore_pairs.items():
        mh.spawn(_worker, hf, mc, str(root / f"{name}-planted"), PLANTED[name], str(root / name), nprocs=1)
        out[name] = torch.load(root / name, weights_only=False)
    return out


@pytest.mark.parametrize("fixture", FIXTURES)
def test_the_modules_request_every_stored_tensor_under_them(fixture: str, runs: dict[str, Any],
                                                           mcore_pairs: dict[str, tuple[str, str]]) -> None:
    """Strict: what megatron-core's modules request is exactly what the mcore plan stores under their prefixes
    (the kpool compression is kept in the sidecar, which megatron-core never reads)."""
    from glmconv.io.config_file import load_config
    from glmconv.plan import build_plan

    run = runs[fixture]
    plan = build_plan(load_config(mcore_pairs[fixture][1]), layout="mcore")
    stored = {n for n in plan.mcore_index if n.startswith(tuple(run["prefixes"]))}
    assert run["requested"] == stored
    kept = {t.name for m in plan.homeless() for t in m.mcore
            if m.layer is not None and m.layer < plan.config.num_layers}
    assert kept and all("kpool" in k for k in kept)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_every_dsa_and_moe_record_names_the_megatron_core_module(fixture: str, runs: dict[str, Any]) -> None:
    report = runs[fixture]["clean"]
    for rec in report["layers"]:
        want = {("attention", "dsa"): "megatron-core AbsorbedMLASelfAttention+DSAttention"}.get(
            (rec["sub_block"], rec["attn_type"]), "glmconv")
        if rec["sub_block"] == "mlp":
            want = "megatron-core MoELayer" if rec["mlp_type"] == "moe" else "glmconv"
        assert rec.get("impl") == want, rec
    assert runs[fixture]["hadamard"] == "torch stand-in"  # fast_hadamard_transform is CUDA-only


@pytest.mark.parametrize("fixture", FIXTURES)
def test_only_megatron_cores_sub_blocks_diverge(fixture: str, runs: dict[str, Any]) -> None:
    """Isolated, fp32, glmconv's own parts on serve's conventions: glmconv's sub-blocks are exact; megatron-core's
    diverge (the findings below), the MoE layers with the very experts serve chooses."""
    report = runs[fixture]["clean"]
    for rec in report["layers"]:
        if rec["impl"] == "glmconv":
            assert rec["rel_err"] == 0.0 and not rec["diverged"], rec
        else:
            assert rec["diverged"] and rec["weights"] == "equal", rec
            assert rec["sub_block"] == "attention" or rec["expert_overlap"] == 1.0, rec
    first = report["first_divergence"]
    assert report["layers"][2 * first["layer"] + (first["sub_block"] == "mlp")]["impl"] != "glmconv"


@pytest.mark.parametrize("fixture", FIXTURES)
def test_a_weight_defect_planted_in_what_megatron_core_loads_is_named_at_its_layer(fixture: str,
                                                                                  runs: dict[str, Any]) -> None:
    """The MoE layers diverge anyway (finding 6): the defect is named by its weights, at its layer, and moves the
    megatron-core module's output."""
    report, layer = runs[fixture]["planted"], PLANTED[fixture]
    rec, clean = report["layers"][2 * layer + 1], runs[fixture]["clean"]["layers"][2 * layer + 1]
    assert rec["impl"] == "megatron-core MoELayer" and rec["diverged"] and rec["weights"] != "equal", rec
    assert clean["weights"] == "equal" and abs(rec["rel_err"] - clean["rel_err"]) > 1e-3, (rec, clean)
    named = {(d["layer"], d["sub_block"]) for d in report["weight_diffs"]}
    assert named == {(layer, "mlp")}, report["weight_diffs"]
    if fixture == "tiny":  # before any DSA layer: the first divergence of the run, caused by the weights
        first = report["first_divergence"]
        assert (first["layer"], first["sub_block"], first["cause"]) == (layer, "mlp", "weights"), first


def test_a_miles_layout_checkpoint_is_refused_with_the_relayout_command() -> None:
    from glmconv.errors import GlmconvError
    from glmconv.models.megatron.load import load_modules

    with pytest.raises(GlmconvError, match=r"relayout .* --to mcore"):
        load_modules(None, "/some/MC", "miles", torch.float32, torch.device("cpu"))  # type: ignore[arg-type]


def test_strictness_names_what_is_missing_and_what_is_left_unrequested() -> None:
    from glmconv.errors import GlmconvError
    from glmconv.models.megatron.load import check_strict

    check_strict(set(), {"decoder.layers.0.self_attention.A_log"}, ("decoder.layers.3.self_attention.",), "CK")
    with pytest.raises(GlmconvError, match="request 1 key.*linear_proj.weight"):
        check_strict({"decoder.layers.3.self_attention.linear_proj.weight"}, set(), (), "CK")
    with pytest.raises(GlmconvError, match="no module requests.*router.weight"):
        check_strict(set(), {"decoder.layers.3.mlp.router.weight"}, ("decoder.layers.3.mlp.",), "CK")


def test_the_hadamard_stand_in_is_the_normalised_walsh_hadamard_transform() -> None:
    """fast_hadamard_transform's `hadamard_transform(x, scale)` is x @ H_n^T * scale (H_n Sylvester's); megatron-core
    calls it with scale n^-0.5, an orthonormal map: q.k is unchanged when both are rotated."""
    from glmconv.models.megatron.standins import hadamard_transform, sylvester

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 16, 128):
        x = torch.randn(3, 5, n, generator=g, dtype=torch.float64)
        h = sylvester(n).to(torch.float64)
        torch.testing.assert_close(hadamard_transform(x, n ** -0.5), x @ h.T * n ** -0.5, rtol=1e-12, atol=1e-12)
        q, k = torch.randn(7, n, generator=g, dtype=torch.float64), torch.randn(9, n, generator=g, dtype=torch.float64)
        rq, rk = hadamard_transform(q, n ** -0.5), hadamard_transform(k, n ** -0.5)
        torch.testing.assert_close(rq @ rk.T, q @ k.T, rtol=1e-12, atol=1e-12)
    assert hadamard_transform(torch.ones(2, 16, dtype=torch.bfloat16), 0.25).dtype == torch.bfloat16


# ---- the findings (tests/helpers/megatron_findings.py measures them; docs/megatron_backend.md writes them up) --------


@pytest.mark.parametrize("fixture", FIXTURES)
def test_finding_token_level_indexer_is_reproduced_by_indexer_kpool_off_with_megatrons_k_norm_eps(
        fixture: str, runs: dict[str, Any]) -> None:
    """megatron-core's DSA against serve: the token-level indexer (no kpool) and its k-norm eps. glmconv's model
    with indexer_kpool=off and the k-norm eps at megatron-core's (1e-5; no switch sets it, the reference's constant
    is set) scores every (query, token) as megatron-core does to fp32 noise, selects the same tokens but for exact
    ties, and attends over megatron-core's selection to fp32 noise."""
    for layer, f in runs[fixture]["findings"]["dsa"].items():
        assert f["serve_rel"] > 1e-2 and f["serve_topk_overlap"] < 1.0, (layer, f)  # the divergence
        matched = f["token_eps_megatron"]
        assert matched["score_max_abs"] < 1e-6 and matched["differs_only_at_ties"], (layer, matched)
        assert matched["replayed_rel"] < 1e-6, (layer, matched)
        assert f["token_eps_glmconv"]["score_max_abs"] > 1e-5, (layer, f)  # the eps alone moves the scores


@pytest.mark.parametrize("fixture", FIXTURES)
def test_no_finding_at_the_indexer_query_megatron_core_feeds_it_the_normed_q(fixture: str,
                                                                              runs: dict[str, Any]) -> None:
    """megatron-core's DSA spec keeps q_layernorm apart from linear_q_up_proj (QKNormConfigResolver: DSA cannot
    fuse it) and hands the indexer the normed q: the train default indexer_query=raw is not what it runs."""
    for layer, f in runs[fixture]["findings"]["dsa"].items():
        assert f["token_eps_megatron_raw_query"]["score_max_abs"] > 1e-3, (layer, f)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_finding_the_fused_swiglu_drops_the_clamp_reproduced_by_swiglu_clamp_off(fixture: str,
                                                                                runs: dict[str, Any]) -> None:
    """A Megatron-LM launch with megatron-args' flags gets --activation-func-clamp-value 10 and, by default,
    --bias-swiglu-fusion: megatron-core's fused SwiGLU (bias_swiglu_impl / weighted_bias_swiglu_impl) takes no clamp,
    so the experts run unclamped. The routing (sigmoid, expert bias for the choice only, normalised top-k times
    routed_scaling_factor) is serve's: the same experts. glmconv's swiglu_clamp=off matches to fp32 noise."""
    for layer, f in runs[fixture]["findings"]["moe"].items():
        assert f["experts_equal"] and f["serve_rel"] > 1e-2, (layer, f)
        assert f["swiglu_clamp_off_rel"] < 1e-6, (layer, f)


def test_self_test_defects_that_cannot_act_on_megatron_cores_modules_are_skipped_with_the_reason() -> None:
    """A switch or a kernel acting only where megatron-core's modules run cannot act there; weight defects are
    planted (in the module's parameters where it runs them), and switches acting elsewhere too act."""
    from types import SimpleNamespace

    from glmconv.models.megatron.model import MegatronModel

    fake = SimpleNamespace(impl=lambda layer, sub_block: "megatron-core MoELayer" if layer == 2 else "glmconv")
    why = lambda kind, path, sites: MegatronModel.cannot_plant(  # noqa: E731
        fake, SimpleNamespace(kind=kind, path=path), sites)  # type: ignore[arg-type]
    assert why("weights", ("moe", "experts"), [(2, "mlp")]) is None  # planted in the module's own parameters
    assert why("weights", ("hc", "fn"), [(2, "mlp")]) is None
    assert why("weights", ("kda", "q_proj"), [(0, "attention")]) is None
    assert "its own numerics" in why("convention", (), [(2, "mlp")])
    assert why("convention", (), [(0, "mlp"), (2, "mlp")]) is None


@pytest.mark.parametrize("fixture", FIXTURES)
def test_self_test_weight_defects_are_planted_in_megatron_cores_modules(fixture: str, runs: dict[str, Any]) -> None:
    """The catalog's weight defects are planted, for the call, in megatron-core's own parameters; the MoE ones are
    named at their layer where the clean pair has not diverged before it (a defect after the clean pair's first
    divergence cannot be told apart: the report says so); only switches acting at DSA layers alone are skipped."""
    report = runs[fixture]["clean"]
    moe = {"experts-swapped", "router-bias", "shared-rows-zero", "hc-mix-split"}
    named = {row["defect"] for row in report["self_test"] if row["named"]}
    if fixture == "tiny":  # its first MoE layer (2) comes before its DSA layer; cut8's (3) after the DSA at 3
        assert moe <= named, report["self_test"]
    planted = {row["defect"] for row in report["self_test"]}
    assert moe | {"kv-heads-permuted", "norm-offset", "fp8-scale-block"} <= planted
    skipped = {row["defect"] for row in report["self_test_skipped"] if "its own numerics" in row["why"]}
    assert skipped == {"convention-indexer_query", "convention-indexer_kpool"}
    for layer, f in runs[fixture]["findings"]["dsa"].items():  # each DSA defect moves the module's own output
        moved = dict(f["planted_rel"])
        assert moved.pop("restored") == 0.0, (layer, moved)
        if moved:  # planted at the first DSA layer; fp8-scale-block doubles wk's first 128x128 block, at toy dims
            assert moved.pop("fp8-scale-block") < 1e-6  # all of wk, which k_norm (a LayerNorm) then undoes
            assert set(moved) == {"norm-offset", "kv-heads-permuted"} and min(moved.values()) > 1e-2, (layer, moved)


def test_a_planted_change_is_run_by_the_parameter_holding_it_and_restored() -> None:
    """plant.changes finds what a defect changed (a SwiGLU's gate and up as one fc1); plant.planted swaps the
    parameter holding it, found by value, for the call, and refuses a change no parameter holds."""
    import dataclasses

    from glmconv.errors import GlmconvError
    from glmconv.models.megatron.plant import changes, planted
    from glmconv.models.weights import Swiglu

    g = torch.Generator().manual_seed(0)
    gate, up, down, other = (torch.randn(4, 3, generator=g) for _ in range(4))
    clean = Swiglu(gate, up, down.T.contiguous())
    fc1 = torch.nn.Linear(3, 8, bias=False)
    fc1.weight.data = torch.cat([gate, up]).clone()
    damaged = dataclasses.replace(clean, up=other)
    found = changes(clean, damaged)
    assert len(found) == 1 and torch.equal(found[0][1], torch.cat([gate, other]))
    with planted(fc1, found, "here"):
        assert torch.equal(fc1.weight, torch.cat([gate, other]))
    assert torch.equal(fc1.weight, torch.cat([gate, up]))
    with pytest.raises(GlmconvError, match="no parameter"):
        with planted(fc1, changes(clean, dataclasses.replace(clean, down=other.T.contiguous())), "here"):
            pass


@pytest.mark.parametrize("stream", [[], ["--stream-layers"]], ids=["whole", "streamed"])
def test_the_cli_runs_the_megatron_backend(mcore_pairs: dict[str, tuple[str, str]], stream: list[str]) -> None:
    """`glmconv parity HF MC --train-backend megatron` end to end (its own process: the gloo group of one is the
    run's, made before anything reads it; streamed, no module is loaded before the run): exit 1 on the findings,
    the report naming megatron-core's modules."""
    import json
    import subprocess
    import sys

    hf, mc = mcore_pairs["tiny"]
    res = subprocess.run([sys.executable, "-m", "glmconv", "parity", hf, mc, "--train-backend", "megatron",
                          "--train-conventions", "serve", "--mode", "isolated", "--tokens", "32", "--json", *stream],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    report = json.loads(res.stdout)
    assert set(report["train_impl"]) >= {"megatron-core AbsorbedMLASelfAttention+DSAttention",
                                         "megatron-core MoELayer"}, report["train_impl"]
    assert "Warning" not in res.stderr, res.stderr[-2000:]  # megatron-core's import-time warnings kept off


@pytest.mark.parametrize("fixture", FIXTURES)
def test_bf16_rotates_the_indexer_and_measures_the_noise_against_the_fp32_twin(fixture: str,
                                                                               runs: dict[str, Any]) -> None:
    """In bf16 megatron-core's indexer rotates q and k (the torch stand-in of fast_hadamard_transform); the fp32
    twin (the same modules cast, the rotation off: megatron-core rotates bf16 only) measures the train side's
    noise; glmconv's sub-blocks stay within theirs."""
    run = runs[fixture]
    assert run["rotated"] and set(run["rotated"]) == {torch.bfloat16}
    for rec in run["bf16"]["layers"]:
        if rec["impl"] == "glmconv":
            assert not rec["diverged"], rec
        else:
            assert rec["noise_train"] > 0.0 and rec["diverged"], rec


@pytest.mark.parametrize("fixture", FIXTURES)
def test_bf16_hands_no_norm_or_linear_a_mix_of_dtypes_that_cuda_refuses(fixture: str, runs: dict[str, Any]) -> None:
    """The bf16 run's norms and linears each see one floating dtype: CUDA's kernels refuse a bf16 input with fp32
    weights, which the CPU's promote. megatron-core's torch norms make fp32 weights; TE's (what a trainer runs, and
    the stand-in) make them in params_dtype."""
    assert runs[fixture]["mixed_dtypes"] == []


@pytest.mark.parametrize("fixture", FIXTURES)
def test_streaming_holds_one_layers_modules_and_gives_the_same_records(fixture: str, runs: dict[str, Any]) -> None:
    """--stream-layers: megatron-core's modules are loaded as their layer runs, one layer's at a time (the bf16 set
    and its fp32 twin, never one module in both dtypes at once), each once, and every record equals the run that
    holds them all."""
    run = runs[fixture]["streamed"]
    assert run["most_layers_held"] == 1
    assert run["most_in_both_dtypes"] == 0  # the bf16 module leaves before its fp32 twin arrives
    assert len(run["loads"]) == len(set(run["loads"]))  # each module loaded once per dtype: the twin casts in step
    whole, streamed = run["whole"]["layers"], run["streamed"]["layers"]
    assert [(r["layer"], r["sub_block"], r["impl"]) for r in streamed] == [
        (r["layer"], r["sub_block"], r["impl"]) for r in whole]
    for a, b in zip(whole, streamed):
        assert (a["rel_err"], a["noise_train"], a["diverged"]) == (b["rel_err"], b["noise_train"], b["diverged"]), a
    prefix = {"attention": attention_prefix, "mlp": mlp_prefix}
    assert {p for _, p in run["loads"]} == {prefix[r["sub_block"]](r["layer"]) for r in whole if r["impl"] != "glmconv"}

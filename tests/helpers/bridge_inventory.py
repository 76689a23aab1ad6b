"""The checkpoint keys a Megatron-Bridge glm5_next trainer requests at load, derived from the model specs.

`bridge_inventory(cfg)` is every key the GPTModel that Megatron-Bridge's glm5_next bridge builds for a GLM-5.3-Flash
config passes to `dist_checkpointing.load(model.sharded_state_dict(), ...)` at TP = PP = EP = 1: each ShardedTensor
key with its global shape, and each ShardedObject's unique key (`<module>._extra_state/shard_<offsets>_<shape>`).
No MTP (the bridge sets `mtp_num_layers=None`), no vision tower.

How it is derived. One spawned gloo process (megatron-core 0.19.2 on CPU, `initialize_model_parallel(1, 1)`)
builds the whole model with megatron-core's own `GPTModel`, `TransformerBlock` and `TransformerLayer`, from the
block spec of Megatron-Bridge's `glm5_next_layer_specs.build_glm5_next_layer_spec(config)` as recorded below,
then calls `model.sharded_state_dict()` and `apply_factories`. Parameters live on the meta device, so the model
is built at the config's real dimensions (the release's 42 MoE layers of 288 experts included) without
allocating anything: every shape is the global shape megatron-core itself gives, none is computed here.

Built by megatron-core 0.19.2 (its modules, its sharded_state_dict code):
  - GPTModel: `embedding.word_embeddings.weight`, `output_layer.weight` (GPTModel.sharded_state_dict drops
    `output_layer._extra_state`, gpt_model.py), `decoder.final_layernorm` (TransformerBlock, `layer_norm` spec);
  - TransformerLayer: `input_layernorm`, `pre_mlp_layernorm` (MoE layers; IdentityOp on dense ones);
  - DSA attention: `get_dsa_module_spec_for_backend` (AbsorbedMLASelfAttention, DSAttention, DSAIndexer);
    a DSA layer without its own indexer (`cfg.indexer_full[i]` False, indexer_types "shared") is built through
    megatron-core's own index-share path (DSAttention builds no `indexer` for a skip-top-k layer);
  - MoE: `get_moe_module_spec_for_backend` (MoELayer, TopKRouter with `moe_router_enable_expert_bias=True`,
    SharedExpertMLP when the config has shared experts, SequentialMLP experts: see the backend below);
  - dense MLP: `get_mlp_module_spec_for_backend(backend, num_experts=None)` (MLP, the pre-MLP norm fused into
    `linear_fc1`).

Recorded from the spec (megatron-core 0.19.2 has no such module; grep finds no KimiDeltaAttention nor
HyperConnection in megatron/core):
  - `HyperConnectionTransformerLayer`: a TransformerLayer with two more submodules,
    `self_attention_hyper_connection` and `mlp_hyper_connection`, each a `HyperConnectionModule` with plain
    parameters `mapping_proj.weight` [(2+n)n, n*hidden], `bias` [(2+n)n], `alpha_pre`/`alpha_post`/`alpha_res`
    [1] (n = hc_mult; no extra state);
  - `KimiDeltaAttention` (KDA layers' self_attention): q_proj, k_proj, v_proj, f_b_proj, g_b_proj, b_proj =
    backend.column_parallel_linear(); f_a_proj, g_a_proj = backend.linear(); o_proj =
    backend.row_parallel_linear() (all built by the backend stand-ins below, so they save `weight` and
    `_extra_state` through megatron-core's code); its own `q_conv1d`/`k_conv1d`/`v_conv1d.weight`, `A_log`,
    `dt_bias`, `o_norm.weight` are plain parameters (no extra state), shaped from the HF side (glmconv's
    tests/rules/test_layout_mcore_names.py restates the bridge's names).

Transformer Engine stand-ins (TE is not installed; the bridge requires the TE backend). `TEBackend` subclasses
megatron-core's LocalSpecProvider and hands out modules that save what TE's save, through the same
megatron-core helpers (`make_sharded_tensors_for_checkpoint`, which turns every `_extra_state` entry into a
ShardedObject):
  - TELinear (duplicated), TEColumnParallelLinear, TERowParallelLinear: megatron-core's Column/RowParallelLinear
    with TE's sharded_state_dict axis maps (None / weight 0 / weight 1) and TE's extra state
    (`torch.empty(0, dtype=torch.uint8)` without FP8): `weight`, `_extra_state`. absorbed_mla.py only passes
    `parallel_mode="duplicated"` to a class that *is* TELinear (`submodules.linear_q_down_proj in [TELinear]`),
    so the worker points absorbed_mla's `TELinear` name (None without TE) at the stand-in;
  - TELayerNormColumnParallelLinear: adds `layer_norm_weight` (replicated, like TE's);
  - TENorm: like TENorm.__new__, an RMSNorm or (config.normalization "LayerNorm": the indexer's k_norm) a
    LayerNorm with bias, whose `get_extra_state` returns `torch.empty(0, dtype=torch.uint8)`;
  - the routed experts: TESpecProvider builds TEGroupedMLP (TEColumn/RowParallelGroupedLinear) under
    moe_grouped_gemm, which needs TE itself; SequentialMLP of the stand-in linears is built instead.
    megatron-core saves both under the same keys (experts.py, TEGroupedMLP.sharded_state_dict: "interchangable
    with SequentialMLP's"): the stacked `mlp.experts.experts.linear_fc{1,2}.weight` [E, ...] and one
    `_extra_state` ShardedObject per expert (`.../shard_<e>_<E>`; TEGroupedLinear._sharded_state_dict_grouped
    gives each gemm's `_extra_state` the expert axis offset (e, E), as SequentialMLP does).

Choices that change no key: the bridge's Glm5NextDSAttention is megatron-core's DSAttention here (a subclass
with its submodules); the MoE token dispatcher is "allgather" (alltoall's constructor wants CUDA streams; neither
has parameters). The shared-indexer path follows glmconv's rules (`indexer=True` rules skip such layers), not a
recorded bridge source.

Recorded fixtures: `fixtures/bridge-inventory/{tiny,cut8,cut8-shared,release}.json`
(tests/rules/test_bridge_inventory.py; cut8-shared is cut8 with DSA layer 7's indexer "shared", the one recording
of a layer without an indexer). To regenerate them after a deliberate change, from the repository root (about
15 s), then review `git diff fixtures/bridge-inventory`:

    .venv/bin/python tests/helpers/bridge_inventory.py            # all four; or name some: ... tiny cut8
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_DIR = ROOT / "fixtures" / "bridge-inventory"
REAL_CONFIG = ROOT / "fixtures" / "glm-5.3-flash.config.json"
CONFIGS = ("tiny", "cut8", "cut8-shared", "release")


@dataclass
class Inventory:
    """What `dist_checkpointing.load` is asked for: ShardedTensor key -> global shape, ShardedObject unique keys."""

    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    objects: set[str] = field(default_factory=set)

    def to_json(self, name: str) -> str:
        """One key a line, sorted (reviewable diffs)."""
        tensors = ",\n".join(f"  {json.dumps(k)}: {json.dumps(list(self.tensors[k]))}" for k in sorted(self.tensors))
        objects = ",\n".join(f"  {json.dumps(k)}" for k in sorted(self.objects))
        return (f'{{"config": {json.dumps(name)},\n "generator": "tests/helpers/bridge_inventory.py",\n'
                f' "tensors": {{\n{tensors}\n }},\n "objects": [\n{objects}\n ]}}\n')

    @classmethod
    def from_json(cls, text: str) -> Inventory:
        raw = json.loads(text)
        return cls({k: tuple(v) for k, v in raw["tensors"].items()}, set(raw["objects"]))


SHARED_INDEXER = ("cut8-shared", 7)  # cut8 whose DSA layer 7 reuses layer 3's top-k: indexer_types "shared"


def config(name: str) -> Any:
    """The GlmConfig of a fixture: a glmconv preset (tiny, cut8), the release's config.json, or SHARED_INDEXER."""
    from glmconv.config import parse_config
    from glmconv.fixtures import preset_config

    if name == SHARED_INDEXER[0]:
        raw = preset_config("cut8")
        raw["text_config"]["indexer_types"][SHARED_INDEXER[1]] = "shared"
    else:
        raw = json.loads(REAL_CONFIG.read_text()) if name == "release" else preset_config(name)
    return parse_config(raw)


def recorded(name: str) -> Inventory:
    return Inventory.from_json((FIXTURE_DIR / f"{name}.json").read_text())


def bridge_inventory(cfg: Any) -> Inventory:
    """The inventory of one config (one spawned gloo process)."""
    return bridge_inventories({"cfg": cfg})["cfg"]


def bridge_inventories(cfgs: dict[str, Any]) -> dict[str, Inventory]:
    """The inventories of several configs, all built in one spawned gloo process."""
    from helpers import mcore_helpers as mh

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "inventories.json"
        mh.spawn(_worker, cfgs, str(out), nprocs=1)
        raw = json.loads(out.read_text())
    return {n: Inventory({k: tuple(v) for k, v in r["tensors"].items()}, set(r["objects"])) for n, r in raw.items()}


def _worker(rank: int, cfgs: dict[str, Any], out: str) -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # RotaryEmbedding's device query
    from megatron.core import parallel_state
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    parallel_state.initialize_model_parallel(1, 1)
    absorbed_mla.TELinear = _standins()["TELinear"]  # None without TE; see the module docstring
    result = {}
    for name, cfg in cfgs.items():
        inv = _inventory(_gpt_model(cfg))
        result[name] = {"tensors": {k: list(v) for k, v in inv.tensors.items()}, "objects": sorted(inv.objects)}
    Path(out).write_text(json.dumps(result))


def _inventory(model: Any) -> Inventory:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)  # the SwiGLU fc1 factories: two ShardedTensors (gate rows, up rows) of one key
    inv = Inventory()
    for v in nested_values(sd):
        if isinstance(v, ShardedTensor):
            shape = tuple(v.global_shape)
            assert inv.tensors.setdefault(v.key, shape) == shape, f"{v.key}: global shapes disagree"
        elif isinstance(v, ShardedObject):
            inv.objects.add(v.unique_key)
        else:
            raise AssertionError(f"{type(v).__name__} in the sharded state dict: neither tensor nor object")
    return inv


# ---- the model: megatron-core's GPTModel with the bridge's block spec ----

def _gpt_model(cfg: Any) -> Any:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    t = cfg.text
    s = _standins()
    with torch.device("meta"):  # the parameters' storage: none; shapes only
        tc = _transformer_config(cfg)
        backend = s["TEBackend"]()
        layers = [_layer_spec(cfg, i, tc, backend) for i in range(cfg.num_layers)]
        block = TransformerBlockSubmodules(layer_specs=layers, layer_norm=backend.layer_norm(rms_norm=True))
        return GPTModel(tc, block, vocab_size=t["vocab_size"], max_sequence_length=t["max_position_embeddings"],
                        pre_process=True, post_process=True, position_embedding_type="rope",
                        share_embeddings_and_output_weights=bool(t.get("tie_word_embeddings", False)))


def _transformer_config(cfg: Any) -> Any:
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    t = cfg.text
    shared = t["moe_intermediate_size"] * t["n_shared_experts"]
    return MLATransformerConfig(
        num_layers=cfg.num_layers, hidden_size=t["hidden_size"], num_attention_heads=t["num_attention_heads"],
        ffn_hidden_size=t["intermediate_size"], normalization="RMSNorm", layernorm_epsilon=t["rms_norm_eps"],
        gated_linear_unit=True, add_bias_linear=False,
        # DSA attention (MLA, NoPE where qk_rope_head_dim is 0), the indexer at the config's own settings
        multi_latent_attention=True, q_lora_rank=t["q_lora_rank"], kv_lora_rank=t["kv_lora_rank"],
        qk_head_dim=t["qk_nope_head_dim"], qk_pos_emb_head_dim=t["qk_rope_head_dim"], v_head_dim=t["v_head_dim"],
        qk_layernorm=True, rope_type="rope", experimental_attention_variant="dsa",
        dsa_indexer_n_heads=t["index_n_heads"], dsa_indexer_head_dim=t["index_head_dim"],
        dsa_indexer_topk=t["index_topk"],
        # MoE: the config's expert count, the router's expert bias, shared experts when it has them
        num_moe_experts=t["n_routed_experts"], moe_ffn_hidden_size=t["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=shared or None, moe_router_topk=t["num_experts_per_tok"],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_layer_freq=[int(m == "moe") for m in cfg.mlp_types],
        moe_token_dispatcher_type="allgather",  # no parameters either way; alltoall's wants CUDA streams
        use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.bfloat16)


def _layer_spec(cfg: Any, i: int, tc: Any, backend: Any) -> Any:
    """`build_glm5_next_layer_spec`'s layer i (see the module docstring)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    s = _standins()
    t = cfg.text
    if cfg.attn_types[i] == "kda":
        attention = s["kda_spec"](cfg, backend)
    else:
        attention = get_dsa_module_spec_for_backend(tc, backend)
        core = attention.submodules.core_attention  # the bridge's Glm5NextDSAttention: DSAttention's submodules
        if not cfg.indexer_full[i]:
            core.module = s["IndexSharingDSAttention"]
    moe = cfg.mlp_types[i] == "moe"
    if moe:
        mlp = get_moe_module_spec_for_backend(backend, num_experts=t["n_routed_experts"], moe_grouped_gemm=True)
    else:
        mlp = get_mlp_module_spec_for_backend(backend, num_experts=None)
    hc = ModuleSpec(module=s["HyperConnectionModule"], params={"hc_mult": t["hc_mult"]})
    norm = backend.layer_norm(rms_norm=True, for_qk=False)
    return ModuleSpec(module=s["HyperConnectionTransformerLayer"], submodules=s["HyperConnectionLayerSubmodules"](
        input_layernorm=norm, self_attention=attention, self_attention_hyper_connection=hc,
        pre_mlp_layernorm=norm if moe else IdentityOp, mlp=mlp, mlp_hyper_connection=hc))


_STANDINS: dict[str, Any] = {}


def _standins() -> dict[str, Any]:
    """The stand-in classes (defined on first use: they subclass megatron-core, imported in the worker only)."""
    if not _STANDINS:
        _STANDINS.update(_define_standins())
    return _STANDINS


def _define_standins() -> dict[str, Any]:
    from functools import partial

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    class TEExtraState:
        """TE modules' extra state without FP8: an empty uint8 tensor (saved as a ShardedObject)."""

        def get_extra_state(self) -> torch.Tensor:
            return torch.empty(0, dtype=torch.uint8)

        def set_extra_state(self, state: Any) -> None:
            assert state is None or (isinstance(state, torch.Tensor) and state.numel() == 0), state

    def te_sharded(module: torch.nn.Module, axis_map: dict[str, int] | None, prefix: str, offsets: tuple,
                   metadata: dict | None) -> Any:
        """TE linears' sharded_state_dict (extensions/transformer_engine.py): their state dict, with `axis_map`."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True), prefix, axis_map,
                                                   offsets, tp_group=module.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])

    class TEColumnParallelLinear(TEExtraState, ColumnParallelLinear):
        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
            return te_sharded(self, {"weight": 0, "bias": 0}, prefix, sharded_offsets, metadata)

    class TERowParallelLinear(TEExtraState, RowParallelLinear):
        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
            return te_sharded(self, {"weight": 1}, prefix, sharded_offsets, metadata)

    class TELinear(TEExtraState, ColumnParallelLinear):
        """TELinear(parallel_mode="duplicated"): one whole weight on every TP rank, replicated on save."""

        def __init__(self, input_size: int, output_size: int, *, parallel_mode: str | None, **kw: Any) -> None:
            assert parallel_mode == "duplicated", parallel_mode  # the only mode TELinear saves (its assert)
            kw.pop("tp_group", None)
            super().__init__(input_size, output_size, gather_output=False, **kw)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
            return te_sharded(self, None, prefix, sharded_offsets, metadata)

    class TELayerNormColumnParallelLinear(TEColumnParallelLinear):
        """The norm fused into the linear: `layer_norm_weight` beside `weight` (TE's LayerNormLinear)."""

        def __init__(self, input_size: int, output_size: int, *, config: Any, **kw: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kw)
            self.layer_norm_weight = torch.nn.Parameter(torch.empty(input_size, dtype=config.params_dtype))

    class TERMSNorm(TEExtraState, torch.nn.RMSNorm):
        pass

    class TELayerNorm(TEExtraState, torch.nn.LayerNorm):
        pass

    class TENorm:
        """TENorm.__new__: TE's LayerNorm or RMSNorm by config.normalization."""

        def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, has_residual: bool = False) -> Any:
            kinds = {"RMSNorm": TERMSNorm, "LayerNorm": TELayerNorm}
            return kinds[config.normalization](hidden_size, eps=eps, dtype=config.params_dtype)

    class TEBackend(LocalSpecProvider):
        """TESpecProvider's choices, with the stand-ins."""

        def linear(self) -> type:
            return TELinear

        def column_parallel_linear(self) -> type:
            return TEColumnParallelLinear

        def row_parallel_linear(self) -> type:
            return TERowParallelLinear

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self) -> type:
            return TELayerNormColumnParallelLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> Any:
            return TENorm

        def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> Any:
            # TEGroupedMLP needs TE; SequentialMLP saves the same keys (see the module docstring)
            return partial(SequentialMLP, submodules=MLPSubmodules(linear_fc1=TEColumnParallelLinear,
                                                                   linear_fc2=TERowParallelLinear))

    class IndexSharingDSAttention(DSAttention):
        """A DSA layer that reuses an earlier layer's top-k (indexer_types "shared"): megatron-core's index-share
        path (dsa_indexer_topk_freq > 1, a skip-top-k layer number) builds it without an `indexer`."""

        def __init__(self, config: Any, *args: Any, layer_number: int, **kw: Any) -> None:
            assert layer_number > 1, "the first layer computes its own top-k"
            config = copy.copy(config)
            config.dsa_indexer_topk_freq, config.dsa_indexer_skip_topk_offset = layer_number, 0
            super().__init__(config, *args, layer_number=layer_number, **kw)
            assert self.indexer is None

    @dataclass
    class HyperConnectionLayerSubmodules(TransformerLayerSubmodules):
        self_attention_hyper_connection: Any = IdentityOp
        mlp_hyper_connection: Any = IdentityOp

    class HyperConnectionTransformerLayer(TransformerLayer):
        """The bridge's layer: megatron-core's TransformerLayer and a hyper-connection module per site."""

        def __init__(self, config: Any, submodules: Any, *args: Any, **kw: Any) -> None:
            super().__init__(config, submodules, *args, **kw)
            self.self_attention_hyper_connection = build_module(submodules.self_attention_hyper_connection,
                                                                config=config)
            self.mlp_hyper_connection = build_module(submodules.mlp_hyper_connection, config=config)

    class Weight(torch.nn.Module):
        def __init__(self, *shape: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(*shape, dtype=torch.float32))

    class HyperConnectionModule(MegatronModule):
        """Recorded: `mapping_proj.weight`, `bias`, `alpha_pre`, `alpha_post`, `alpha_res`; no extra state."""

        def __init__(self, config: Any, hc_mult: int) -> None:
            super().__init__(config)
            mix = (2 + hc_mult) * hc_mult
            self.mapping_proj = Weight(mix, hc_mult * config.hidden_size)
            self.bias = torch.nn.Parameter(torch.empty(mix, dtype=torch.float32))
            for a in ("pre", "post", "res"):
                setattr(self, f"alpha_{a}", torch.nn.Parameter(torch.empty(1, dtype=torch.float32)))

    @dataclass
    class KimiDeltaAttentionSubmodules:
        q_proj: Any
        k_proj: Any
        v_proj: Any
        f_a_proj: Any
        f_b_proj: Any
        g_a_proj: Any
        g_b_proj: Any
        b_proj: Any
        o_proj: Any

    class KimiDeltaAttention(MegatronModule):
        """Recorded: the KDA module's linears from the backend, its convs, A_log, dt_bias and o_norm plain."""

        def __init__(self, config: Any, submodules: KimiDeltaAttentionSubmodules, layer_number: int,
                     heads: int, head_dim: int, conv: int, **kw: Any) -> None:
            super().__init__(config)
            hidden, dim = config.hidden_size, heads * head_dim
            common = {"config": config, "init_method": config.init_method, "bias": False, "skip_bias_add": False}
            column = {**common, "gather_output": False}
            for name, n_in, n_out in (("q_proj", hidden, dim), ("k_proj", hidden, dim), ("v_proj", hidden, dim),
                                      ("f_b_proj", head_dim, dim), ("g_b_proj", head_dim, dim),
                                      ("b_proj", hidden, heads)):
                setattr(self, name, build_module(getattr(submodules, name), n_in, n_out, **column))
            for name in ("f_a_proj", "g_a_proj"):
                setattr(self, name, build_module(getattr(submodules, name), hidden, head_dim,
                                                 parallel_mode="duplicated", **common))
            self.o_proj = build_module(submodules.o_proj, dim, hidden, input_is_parallel=True, **common)
            for p in "qkv":
                setattr(self, f"{p}_conv1d", torch.nn.Conv1d(dim, dim, conv, groups=dim, bias=False))
            self.A_log = torch.nn.Parameter(torch.empty(heads, dtype=torch.float32))
            self.dt_bias = torch.nn.Parameter(torch.empty(dim, dtype=torch.float32))
            self.o_norm = torch.nn.RMSNorm(head_dim)

    def kda_spec(cfg: Any, backend: Any) -> Any:
        """`get_kda_module_spec(config, backend)` as recorded (see the module docstring)."""
        t = cfg.text
        col = backend.column_parallel_linear()
        return ModuleSpec(module=KimiDeltaAttention,
                          params={"heads": t["linear_num_heads"], "head_dim": t["linear_head_dim"],
                                  "conv": t["linear_conv_kernel_dim"]},
                          submodules=KimiDeltaAttentionSubmodules(
                              q_proj=col, k_proj=col, v_proj=col, f_b_proj=col, g_b_proj=col, b_proj=col,
                              f_a_proj=backend.linear(), g_a_proj=backend.linear(),
                              o_proj=backend.row_parallel_linear()))

    return {"TEBackend": TEBackend, "TELinear": TELinear, "IndexSharingDSAttention": IndexSharingDSAttention,
            "HyperConnectionLayerSubmodules": HyperConnectionLayerSubmodules,
            "HyperConnectionTransformerLayer": HyperConnectionTransformerLayer,
            "HyperConnectionModule": HyperConnectionModule, "kda_spec": kda_spec}


def main(names: list[str]) -> None:
    import time

    start = time.perf_counter()
    invs = bridge_inventories({n: config(n) for n in names or CONFIGS})
    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    for name, inv in invs.items():
        (FIXTURE_DIR / f"{name}.json").write_text(inv.to_json(name))
        print(f"{name}: {len(inv.tensors)} tensors, {len(inv.objects)} objects")
    print(f"wrote {FIXTURE_DIR.relative_to(ROOT)} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `helpers` importable when run as a script
    main(sys.argv[1:])

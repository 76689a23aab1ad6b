"""The non-tensor ("common") state of a Megatron torch_dist checkpoint: build it, and read it safely.

megatron-core 0.19.2 keeps it inside the DCP checkpoint as the bytes entry `common_state/shard_0_1`
(`torch.save([state])`); older checkpoints keep it in `common.pt` (`torch.save(state)`). See
docs/torch_dist.md for the evidence. Reading never unpickles anything outside an explicit allow-list.
"""

from __future__ import annotations

import argparse
import copy
import copyreg
import io
import pathlib
import pickle
import re
import signal
import types
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv.config import MOE, GlmConfig
from glmconv.errors import CheckpointError
from glmconv.io.checkpoint_files import optional_file
from glmconv.io.file_names import COMMON_PT_NAME, COMMON_STATE_KEY
from glmconv.io.torch_dist.metadata import TORCH_DIST
from glmconv.io.torch_dist.reader import read_bytes_entry

CHECKPOINT_VERSION = 3.0
VOCAB_DIVISOR = 128

# Classes a Megatron trainer's common state may hold and that are safe to build for real.
SAFE_CLASSES: tuple[type, ...] = (argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals)
# megatron-core classes (its own weights_only allow-list, megatron/core/safe_globals.py) that trainer
# args may hold. They load as inert `OpaqueValue`s, so reading never needs or imports megatron.
OPAQUE_GLOBALS: tuple[str, ...] = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)


class OpaqueValue:
    """Inert stand-in for an allow-listed megatron object: keeps its constructor args and state, runs nothing.

    Pickled by `STAND_IN_PICKLE`, it is written back as the megatron object it stands for: the same global, called
    with the same args (an enum) or built from the same state (a dataclass), so a trainer loads the original."""

    qualname = "?"
    state: Any = None

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        args = getattr(self, "args", None)  # None: it was made by NEWOBJ (cls.__new__), as copyreg pickles objects
        if args is None:
            return (copyreg.__newobj__, (type(self),), self.state)  # type: ignore[attr-defined]  # typeshed omits it
        return (type(self), args) if self.state is None else (type(self), args, self.state)

    def __repr__(self) -> str:
        return f"<{self.qualname} {getattr(self, 'args', None) or self.state!r}>"


def _opaque_allow_list() -> list[tuple[type, str]]:
    return [(type(name.rsplit(".", 1)[1], (OpaqueValue,), {"qualname": name}), name) for name in OPAQUE_GLOBALS]


_OPAQUE = _opaque_allow_list()


if TYPE_CHECKING:
    class _PyPickler(pickle._Pickler):
        """The Python pickler's undocumented internals that `_StandInPickler` uses (typeshed leaves them out)."""

        proto: int

        def save(self, obj: object) -> None: ...
        def write(self, data: bytes) -> None: ...
        def memoize(self, obj: object) -> None: ...
        def save_global(self, obj: object, name: str | None = None) -> None: ...
else:
    _PyPickler = pickle._Pickler  # the Python pickler: save_global can be overridden


class _StandInPickler(_PyPickler):
    """pickle's own (Python) pickler, writing a stand-in class as the megatron global it stands for, by name: a
    trainer's unpickler finds the real class there; megatron is never imported here."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if not (isinstance(obj, type) and issubclass(obj, OpaqueValue) and obj is not OpaqueValue):
            super().save_global(obj, name)
            return
        module, _, qualname = obj.qualname.rpartition(".")
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


STAND_IN_PICKLE = types.ModuleType("glmconv_stand_in_pickle")  # torch.save(..., pickle_module=STAND_IN_PICKLE)
STAND_IN_PICKLE.Pickler = _StandInPickler  # type: ignore[attr-defined]  # a module built here


def pickle_module_for(obj: Any) -> Any:
    """The pickle module `torch.save` needs for `obj`: `STAND_IN_PICKLE` when it holds a stand-in, else pickle."""
    return STAND_IN_PICKLE if any(isinstance(v, OpaqueValue) for _, v in _walk(obj)) else pickle


GLMCONV_ENTRY = "glmconv"  # the common state's record of what glmconv wrote (its Megatron layout)


def build_args(config: GlmConfig, *, padded_vocab_size: int | None = None, **overrides: Any) -> argparse.Namespace:
    """The model args a Megatron trainer reads back from `state_dict['args']` (checks, --use-checkpoint-args)."""
    t = config.text
    shared = t["moe_intermediate_size"] * t["n_shared_experts"]
    args: dict[str, Any] = dict(
        num_layers=config.num_layers, hidden_size=t["hidden_size"], ffn_hidden_size=t["intermediate_size"],
        num_attention_heads=t["num_attention_heads"], normalization="RMSNorm", layernorm_epsilon=t["rms_norm_eps"],
        swiglu=True, add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
        position_embedding_type="none", add_position_embedding=False,
        max_position_embeddings=t.get("max_position_embeddings"),
        vocab_size=t["vocab_size"], padded_vocab_size=padded_vocab_size or t["vocab_size"],
        make_vocab_size_divisible_by=VOCAB_DIVISOR, tokenizer_type="HuggingFaceTokenizer",
        multi_latent_attention=True, q_lora_rank=t["q_lora_rank"], kv_lora_rank=t["kv_lora_rank"],
        qk_head_dim=t["qk_nope_head_dim"], qk_pos_emb_head_dim=t["qk_rope_head_dim"], v_head_dim=t["v_head_dim"],
        num_experts=t["n_routed_experts"], moe_ffn_hidden_size=t["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=shared or None, moe_router_topk=t["num_experts_per_tok"],
        moe_layer_freq=[int(m == MOE) for m in config.mlp_types], moe_router_enable_expert_bias=True,
        moe_router_score_function=t.get("scoring_func", "sigmoid"),
        moe_router_topk_scaling_factor=t.get("routed_scaling_factor"),
        mtp_num_layers=config.num_mtp_layers or None,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        expert_tensor_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        bf16=True, ckpt_format=TORCH_DIST, no_save_optim=True, no_save_rng=True,
    )
    args.update(overrides)
    return argparse.Namespace(**args)


def build_common_state(config: GlmConfig, *, iteration: int = 0, padded_vocab_size: int | None = None,
                       content_metadata: dict[str, Any] | None = None, layout: str | None = None,
                       **arg_overrides: Any) -> dict[str, Any]:
    """`args`, `checkpoint_version` 3.0 and `iteration`; `content_metadata` only when the caller has one; with
    `layout`, a `glmconv` entry recording it (a trainer ignores keys it does not know).

    Without `content_metadata` a trainer uses its own sharding metadata (e.g. singleton_local_shards). In a
    layout whose trainer has no MTP module the args say so (`mtp_num_layers` None): the MTP tensors are kept only.
    """
    if layout is not None:
        arg_overrides.setdefault("mtp_num_layers", mtp_num_layers(config, layout))
    state: dict[str, Any] = {
        "args": build_args(config, padded_vocab_size=padded_vocab_size, **arg_overrides),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
    }
    if layout is not None:
        state[GLMCONV_ENTRY] = {"layout": layout}
    if content_metadata is not None:
        state["content_metadata"] = dict(content_metadata)
    return state


def mtp_num_layers(config: GlmConfig, layout: str) -> int | None:
    """`args.mtp_num_layers` in a layout: None where its trainer has no MTP module (the MTP tensors are kept only)."""
    from glmconv.rules.layouts import MTP_PART
    from glmconv.rules.layouts import layout as find_layout

    return None if MTP_PART in find_layout(layout).homeless_parts else config.num_mtp_layers or None


def relaid_common_state(common: dict[str, Any], config: GlmConfig, layout: str) -> dict[str, Any]:
    """A checkpoint's common state for `layout` (relayout): its own `args`, iteration and the rest kept, with the
    layout's `mtp_num_layers` rule and `glmconv` entry, as `build_common_state` writes them.

    Megatron objects the reader keeps as inert stand-ins (`OpaqueValue`) are carried as they are: the writer
    pickles them back as the globals they stand for (`pickle_module_for`)."""
    state = dict(common)
    args = state.get("args")
    if isinstance(args, argparse.Namespace | types.SimpleNamespace):
        args = copy.copy(args)
        args.mtp_num_layers = mtp_num_layers(config, layout)
        state["args"] = args
    entry = state.get(GLMCONV_ENTRY)
    state[GLMCONV_ENTRY] = {**(entry if isinstance(entry, dict) else {}), "layout": layout}
    return state


def _walk(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of every value in a common state (dicts, lists, namespaces), depth first."""
    if isinstance(obj, dict):
        items = [(f"{path}.{k}" if path else str(k), v) for k, v in obj.items()]
    elif isinstance(obj, list | tuple):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, argparse.Namespace | types.SimpleNamespace):
        items = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    else:
        return []
    return [pair for key, value in items for pair in ((key, value), *_walk(value, key))]


def load_common_state(data: bytes, *, source: str) -> dict[str, Any]:
    """Unpickle a common state (`[state]` from DCP, or a bare dict from common.pt) through the allow-list: without
    torch where it holds only allow-listed classes (`_without_torch`), else with torch's weights_only."""
    obj = _without_torch(data)
    if obj is None:
        obj = _with_torch(data, source)
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{source}: common state is a {type(obj).__name__}, expected a dict")
    return obj


class _TorchDecides(Exception):
    """Something `_without_torch` does not read (a tensor, another global, another format): torch.load decides."""


def _module_and_name(qualname: str) -> tuple[str, str]:
    """`"a.b.C"` -> `("a.b", "C")`, as pickle names a global."""
    module, _, name = qualname.rpartition(".")
    return module, name


class _PlainUnpickler(pickle.Unpickler):
    """The allow-list of `_with_torch` (SAFE_CLASSES, the opaque megatron stand-ins, OrderedDict), nothing else."""

    ALLOWED: dict[tuple[str, str], Any] = {
        **{(c.__module__, c.__qualname__): c for c in SAFE_CLASSES},
        **{_module_and_name(name): cls for cls, name in _OPAQUE}, ("collections", "OrderedDict"): OrderedDict}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise _TorchDecides
        return self.ALLOWED[(module, name)]

    def persistent_load(self, pid: Any) -> Any:
        raise _TorchDecides


def _without_torch(data: bytes) -> Any:
    """A `torch.save` archive holding no tensor and only allow-listed classes, read with zipfile and pickle (torch
    takes 1-6 s to import); None where torch.load has to decide."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            pickles = [n for n in z.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(pickles) != 1:
                return None
            return _PlainUnpickler(io.BytesIO(z.read(pickles[0]))).load()
    except Exception:  # anything unusual: torch.load gives its verdict, as it always did
        return None


def _with_torch(data: bytes, source: str) -> Any:
    """torch.load with weights_only and the allow-list; its refusals as one line naming `source`."""
    import torch

    try:
        with torch.serialization.safe_globals([*SAFE_CLASSES, *_OPAQUE]):
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"unsupported global:?\s+(?:GLOBAL\s+)?([\w.]+)", str(exc), re.IGNORECASE)  # torch 2.6 / 2.13
        if found:
            raise CheckpointError(f"{source}: common state holds the disallowed global {found.group(1)}; "
                                  "refusing to unpickle it") from None
        raise CheckpointError(f"{source}: common state is not a readable torch archive ({_why(exc)})") from None
    except Exception as exc:  # any failure of the weights-only unpickler: a damaged archive
        raise CheckpointError(f"{source}: common state is not a readable torch archive ({_line(exc)})") from None
    return obj


def read_common_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The common state of a torch_dist checkpoint directory: legacy `common.pt` first, as megatron does."""
    d = Path(ckpt_dir)
    legacy = optional_file(d, COMMON_PT_NAME)
    if legacy is not None:
        return load_common_state(legacy.read_bytes(), source=str(legacy))
    return load_common_state(read_bytes_entry(d, COMMON_STATE_KEY), source=f"{d}:{COMMON_STATE_KEY}")


def _why(exc: Exception) -> str:
    """The WeightsUnpickler's own reason, without torch's multi-paragraph advice."""
    found = re.search(r"WeightsUnpickler error:\s*(.+)", str(exc))
    return found.group(1).strip() if found else _line(exc)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

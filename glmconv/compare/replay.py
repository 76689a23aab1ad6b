"""Routing and indexer replay: the selections an RL engine captured, checked before a train side uses them.

Replay hands the train side the selections made elsewhere (by the serve side in parity, or by an inference
engine in RL): per MoE layer the routed-expert ids [T, top_k], per DSA layer the indexer's token ids [T, W]
(-1 = none). Only the selection is replayed: the gate weights are the train router's own scores at the replayed
experts (normalised as usual, as Megatron's RouterReplay does), and the attention itself is the train side's.
A payload that cannot be what a real router or indexer chose is refused with one GlmconvError line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from glmconv.config import GlmConfig
from glmconv.defaults import REPLAY_CHOICES
from glmconv.errors import GlmconvError
from glmconv.io.safetensors.header import read_header
from glmconv.text import count, show

if TYPE_CHECKING:
    import torch


BYPASSED = "all routed-expert ids are 0: the backend most likely bypassed routing capture"


@dataclass(frozen=True)
class Replay:
    """What the train side replays; `experts` / `topk` by layer, or empty dicts to replay the serve side's own."""

    routing: bool = False
    indexer: bool = False
    experts: dict[int, torch.Tensor] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def parse(cls, what: str) -> Replay:
        if what not in REPLAY_CHOICES:
            raise GlmconvError(f"--replay {what!r}: choose from {', '.join(REPLAY_CHOICES)}")
        return cls(routing=what in ("routing", "both"), indexer=what in ("indexer", "both"))

    @property
    def name(self) -> str:
        return {(False, False): "none", (True, False): "routing", (False, True): "indexer"}.get(
            (self.routing, self.indexer), "both")

    def expert_ids(self, layer: int, serve_aux: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The ids the train side's MoE layer `layer` runs (None: its own choice)."""
        return _given(self.experts, layer, serve_aux, "experts") if self.routing else None

    def token_ids(self, layer: int, serve_aux: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The ids the train side's DSA layer `layer` attends over (None: its own selection)."""
        return _given(self.topk, layer, serve_aux, "topk") if self.indexer else None

    def ids(self, sub_block: str, layer: int, serve_aux: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """What the train side's `sub_block` of `layer` replays: token ids (attention) or expert ids (mlp)."""
        return self.token_ids(layer, serve_aux) if sub_block == "attention" else self.expert_ids(layer, serve_aux)


def _given(payload: dict[int, torch.Tensor], layer: int, serve_aux: dict[str, torch.Tensor],
           key: str) -> torch.Tensor | None:
    """The payload's ids for `layer` when a payload was given, else the serve side's own (aux `key`)."""
    return payload.get(layer) if payload else serve_aux.get(key)


# ---- payload checks -----------------------------------------------------------------------------------------

def moe_layers(config: GlmConfig) -> list[int]:
    return [i for i, t in enumerate(config.mlp_types) if t == "moe"]


def dsa_layers(config: GlmConfig) -> list[int]:
    return [i for i, t in enumerate(config.attn_types) if t == "dsa"]


def selection_width(config: GlmConfig) -> int:
    """The indexer's row width: index_topk, plus the kpool tail (kpool - 1) when the tail is always selected."""
    t = config.text
    tail = int(t["index_kpool"]) - 1 if bool(t.get("index_kpool_always_select_tail", True)) else 0
    return int(t["index_topk"]) + tail


def check_routing_payload(experts: Sequence[torch.Tensor], config: GlmConfig, tokens: int) -> dict[int, torch.Tensor]:
    """One [T, top_k] integer tensor of expert ids per MoE layer, in layer order -> {layer: ids}.

    Refused: a count other than the MoE layers', a payload of zeros (a backend that skipped capture routes every
    token to expert 0), a wrong shape, ids outside [0, n_routed_experts), an expert chosen twice for one token.
    """
    layers = moe_layers(config)
    _check_count("routing", len(experts), len(layers), "MoE layer", "dense layers route nothing")
    if experts and all(_integer(ids) and not bool(ids.any()) for ids in experts):
        raise GlmconvError(f"routing payload: {BYPASSED}")
    n, k = int(config.text["n_routed_experts"]), int(config.text["num_experts_per_tok"])
    return {layer: _routing_layer(layer, ids, tokens, n, k) for layer, ids in zip(layers, experts)}


def _routing_layer(layer: int, ids: torch.Tensor, tokens: int, n: int, k: int) -> torch.Tensor:
    where = f"routing payload, layer {layer}"
    _check_shape(where, ids, (tokens, k), "[tokens, num_experts_per_tok]")
    if not bool(ids.any()):
        raise GlmconvError(f"{where}: {BYPASSED}")
    ids = ids.long()
    bad = (ids < 0) | (ids >= n)
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        raise GlmconvError(f"{where}: token {t} names expert {int(ids[t, j])}, outside [0, {n})")
    _check_distinct(where, ids, "expert")
    return ids


def check_indexer_payload(streams: Sequence[torch.Tensor], config: GlmConfig,
                          cu_seqlens: torch.Tensor | int) -> dict[int, torch.Tensor]:
    """One [T, W] integer tensor of token ids (-1 = none) per DSA layer, in layer order -> {layer: ids}.

    `cu_seqlens`: the packed sequences' boundaries (or the token count of one sequence). Refused: a count other
    than the DSA layers' (KDA layers have no indexer), a wrong shape, ids outside [-1, T), a future token or one
    of another packed sequence, a token selected twice for one query.
    """
    import torch

    layers = dsa_layers(config)
    _check_count("indexer", len(streams), len(layers), "DSA layer", "KDA layers have no indexer")
    cu = torch.tensor([0, cu_seqlens]) if isinstance(cu_seqlens, int) else cu_seqlens.detach().cpu().long()
    tokens, width = int(cu[-1]), selection_width(config)
    start = torch.repeat_interleave(cu[:-1], cu.diff())  # each query's sequence start
    return {layer: _indexer_layer(layer, ids, tokens, width, start) for layer, ids in zip(layers, streams)}


def _indexer_layer(layer: int, ids: torch.Tensor, tokens: int, width: int, start: torch.Tensor) -> torch.Tensor:
    import torch

    where = f"indexer payload, layer {layer}"
    _check_shape(where, ids, (tokens, width), "[tokens, index_topk + index_kpool - 1]")
    ids = ids.long()
    _first_bad(where, ids, (ids < -1) | (ids >= tokens), f"token id {{v}}, outside [-1, {tokens})")
    pos = torch.arange(tokens, device=ids.device)[:, None]
    _first_bad(where, ids, ids > pos, "token {v}, a future token")
    _first_bad(where, ids, (ids >= 0) & (ids < start.to(ids.device)[:, None]), "token {v}, of an earlier sequence")
    _check_distinct(where, ids, "token", ignore=-1)
    return ids


def _check_count(kind: str, got: int, want: int, unit: str, why: str) -> None:
    if got != want:
        raise GlmconvError(f"{kind} payload: {count(got, 'stream')} but the config has {count(want, unit)} "
                           f"(one per {unit}, in layer order; {why})")


def _integer(ids: torch.Tensor) -> bool:
    import torch

    return isinstance(ids, torch.Tensor) and not ids.dtype.is_floating_point and not ids.dtype.is_complex \
        and ids.dtype != torch.bool


def _check_shape(where: str, ids: object, shape: tuple[int, int], what: str) -> None:
    import torch

    if not isinstance(ids, torch.Tensor) or not _integer(ids):
        kind = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise GlmconvError(f"{where}: expected an integer tensor, got {kind}")
    if tuple(ids.shape) != shape:
        raise GlmconvError(f"{where}: shape {list(ids.shape)}, expected {list(shape)} {what}")


def _first_bad(where: str, ids: torch.Tensor, bad: torch.Tensor, what: str) -> None:
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        raise GlmconvError(f"{where}: query {t} selects {what.format(v=int(ids[t, j]))}")


def _check_distinct(where: str, ids: torch.Tensor, unit: str, ignore: int | None = None) -> None:
    s = ids.sort(dim=-1).values
    dup = s[:, 1:] == s[:, :-1]
    if ignore is not None:
        dup &= s[:, 1:] != ignore
    if bool(dup.any()):
        t, j = (int(v) for v in dup.nonzero()[0])
        raise GlmconvError(f"{where}: token {t} selects {unit} {int(s[t, j])} twice")


# ---- a payload file -----------------------------------------------------------------------------------------

ROUTING_KEY, INDEXER_KEY = "routed_experts", "indexer_topk"


def load_replay_file(path: Path, replay: Replay, config: GlmConfig, cu_seqlens: torch.Tensor) -> Replay:
    """`replay` with the selections of a safetensors payload (never a pickle), each checked as above.

    The file holds `routed_experts` [MoE layers, T, top_k] and/or `indexer_topk` [DSA layers, T, W]: one stream
    per layer along dim 0, in layer order; `--replay` says which of them the train side uses.
    """
    if not (replay.routing or replay.indexer):
        raise GlmconvError("--replay-file needs --replay routing, indexer or both (what to replay from it)")
    tensors = _read(path)
    tokens = int(cu_seqlens[-1])
    experts = check_routing_payload(_streams(path, tensors, ROUTING_KEY), config, tokens) if replay.routing else {}
    topk = check_indexer_payload(_streams(path, tensors, INDEXER_KEY), config, cu_seqlens) if replay.indexer else {}
    return Replay(replay.routing, replay.indexer, experts, topk)


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise GlmconvError(f"{show(str(path))}: no such replay file")
    try:
        entries = read_header(path).entries  # a pickle or any other non-safetensors file stops here, unread
    except GlmconvError as exc:
        raise GlmconvError(f"--replay-file {exc} (not a safetensors file)") from None
    unknown = sorted(set(entries) - {ROUTING_KEY, INDEXER_KEY})
    if unknown:
        raise GlmconvError(f"{show(str(path))}: holds {show(unknown[0], quote=True)}; a replay file holds only "
                           f"{ROUTING_KEY} and {INDEXER_KEY}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise GlmconvError(f"{show(str(path))}: cannot read the replay file ({exc})") from None


def _streams(path: Path, tensors: dict[str, torch.Tensor], key: str) -> list[torch.Tensor]:
    if key not in tensors:
        raise GlmconvError(f"{show(str(path))}: no {key} tensor, which --replay asks for")
    t = tensors[key]
    if t.dim() != 3:
        raise GlmconvError(f"{show(str(path))}: {key} has shape {list(t.shape)}; expected [layers, tokens, ids]")
    return list(t.unbind(0))

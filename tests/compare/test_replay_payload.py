"""Replay payloads as an RL engine delivers them: what `glmconv.compare.replay` accepts and what it refuses.

cut8's schedule: KDA at 0-2 and 4-6, DSA at 3 and 7; dense MLPs at 0-2, MoE at 3-7 (8 experts, top 2); the
indexer's rows are index_topk 16 + kpool tail 3 = 19 wide.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glmconv.compare.replay import (
    BYPASSED,
    Replay,
    check_indexer_payload,
    check_routing_payload,
    load_replay_file,
    selection_width,
)
from glmconv.config import GlmConfig, parse_config
from glmconv.errors import GlmconvError
from glmconv.fixtures.configs import preset_config

T = 12


@pytest.fixture(scope="module")
def cut8() -> GlmConfig:
    return parse_config(preset_config("cut8"))


def _experts(layers: int = 5, tokens: int = T) -> list[torch.Tensor]:
    """Valid routing: token t of every layer goes to experts t % 8 and (t + 1) % 8."""
    t = torch.arange(tokens)
    return [torch.stack([t % 8, (t + 1) % 8], dim=1) for _ in range(layers)]


def _topk(layers: int = 2, cu: list[int] | None = None) -> list[torch.Tensor]:
    """Valid selections: each query selects itself and the token before it in its sequence, -1 elsewhere."""
    cu = cu or [0, T]
    rows = torch.full((cu[-1], 19), -1, dtype=torch.int64)
    for lo, hi in zip(cu, cu[1:]):
        for t in range(lo, hi):
            rows[t, 0] = t
            if t > lo:
                rows[t, 1] = t - 1
    return [rows.clone() for _ in range(layers)]


# ---- routing ----------------------------------------------------------------------------------------------

def test_a_valid_routing_payload_is_keyed_by_moe_layer(cut8: GlmConfig) -> None:
    got = check_routing_payload(_experts(), cut8, T)
    assert sorted(got) == [3, 4, 5, 6, 7]
    assert got[3].dtype == torch.int64 and got[3][5].tolist() == [5, 6]


def test_an_all_zero_routing_payload_names_the_bypassed_capture(cut8: GlmConfig) -> None:
    zeros = [torch.zeros(T, 2, dtype=torch.int32) for _ in range(5)]
    with pytest.raises(GlmconvError) as exc:
        check_routing_payload(zeros, cut8, T)
    assert str(exc.value) == f"routing payload: {BYPASSED}"
    assert BYPASSED == "all routed-expert ids are 0: the backend most likely bypassed routing capture"


def test_one_all_zero_layer_is_named_with_the_same_cause(cut8: GlmConfig) -> None:
    experts = _experts()
    experts[2] = torch.zeros(T, 2, dtype=torch.int64)
    with pytest.raises(GlmconvError, match=f"^routing payload, layer 5: {BYPASSED}$"):
        check_routing_payload(experts, cut8, T)


def test_routing_streams_must_number_the_moe_layers(cut8: GlmConfig) -> None:
    with pytest.raises(GlmconvError, match=r"^routing payload: 8 streams but the config has 5 MoE layers "
                                           r"\(one per MoE layer, in layer order; dense layers route nothing\)$"):
        check_routing_payload(_experts(8), cut8, T)


@pytest.mark.parametrize("shape", [(T, 3), (T + 1, 2), (T,), (1, T, 2)])
def test_routing_ids_must_be_tokens_by_top_k(cut8: GlmConfig, shape: tuple[int, ...]) -> None:
    experts = _experts()
    experts[0] = torch.ones(shape, dtype=torch.int64)
    want = f"routing payload, layer 3: shape {list(shape)}, expected [12, 2] [tokens, num_experts_per_tok]"
    with pytest.raises(GlmconvError, match=f"^{re.escape(want)}$"):
        check_routing_payload(experts, cut8, T)


@pytest.mark.parametrize("bad", [8, -1])
def test_routing_ids_must_name_an_expert(cut8: GlmConfig, bad: int) -> None:
    experts = _experts()
    experts[1][4, 1] = bad
    with pytest.raises(GlmconvError,
                       match=rf"^routing payload, layer 4: token 4 names expert {bad}, outside \[0, 8\)$"):
        check_routing_payload(experts, cut8, T)


def test_routing_refuses_an_expert_chosen_twice_for_one_token(cut8: GlmConfig) -> None:
    experts = _experts()
    experts[4][7] = torch.tensor([3, 3])
    with pytest.raises(GlmconvError, match="^routing payload, layer 7: token 7 selects expert 3 twice$"):
        check_routing_payload(experts, cut8, T)


def test_routing_ids_must_be_integers(cut8: GlmConfig) -> None:
    experts = _experts()
    experts[0] = experts[0].float()
    with pytest.raises(GlmconvError, match="^routing payload, layer 3: expected an integer tensor, got torch.float32$"):
        check_routing_payload(experts, cut8, T)


# ---- indexer ----------------------------------------------------------------------------------------------

def test_a_valid_indexer_payload_is_keyed_by_dsa_layer(cut8: GlmConfig) -> None:
    got = check_indexer_payload(_topk(cu=[0, 5, T]), cut8, torch.tensor([0, 5, T]))
    assert sorted(got) == [3, 7] and selection_width(cut8) == 19
    assert got[7][5, :3].tolist() == [5, -1, -1]  # the first token of the second sequence


def test_indexer_streams_must_number_the_dsa_layers_not_the_kda_ones(cut8: GlmConfig) -> None:
    with pytest.raises(GlmconvError, match=r"^indexer payload: 8 streams but the config has 2 DSA layers "
                                           r"\(one per DSA layer, in layer order; KDA layers have no indexer\)$"):
        check_indexer_payload(_topk(8), cut8, T)


def test_indexer_rows_must_be_the_selection_width(cut8: GlmConfig) -> None:
    streams = _topk()
    streams[1] = streams[1][:, :16]
    with pytest.raises(GlmconvError, match=r"^indexer payload, layer 7: shape \[12, 16\], expected \[12, 19\] "):
        check_indexer_payload(streams, cut8, T)


@pytest.mark.parametrize("bad", [-2, T])
def test_indexer_ids_must_lie_in_minus_one_to_t(cut8: GlmConfig, bad: int) -> None:
    streams = _topk()
    streams[0][11, 4] = bad
    with pytest.raises(GlmconvError, match=rf"^indexer payload, layer 3: query 11 selects token id {bad}, "
                                           r"outside \[-1, 12\)$"):
        check_indexer_payload(streams, cut8, T)


def test_indexer_refuses_a_future_token(cut8: GlmConfig) -> None:
    streams = _topk()
    streams[0][4, 2] = 9
    with pytest.raises(GlmconvError, match="^indexer payload, layer 3: query 4 selects token 9, a future token$"):
        check_indexer_payload(streams, cut8, T)


def test_indexer_refuses_a_token_of_an_earlier_packed_sequence(cut8: GlmConfig) -> None:
    streams = _topk(cu=[0, 5, T])
    streams[1][6, 2] = 4
    with pytest.raises(GlmconvError,
                       match="^indexer payload, layer 7: query 6 selects token 4, of an earlier sequence$"):
        check_indexer_payload(streams, cut8, torch.tensor([0, 5, T]))


def test_indexer_refuses_a_token_selected_twice(cut8: GlmConfig) -> None:
    streams = _topk()
    streams[0][8, 2] = 7
    with pytest.raises(GlmconvError, match="^indexer payload, layer 3: token 8 selects token 7 twice$"):
        check_indexer_payload(streams, cut8, T)


# ---- --replay and the payload file ------------------------------------------------------------------------

def test_replay_choices() -> None:
    assert [(r.routing, r.indexer, r.name) for r in map(Replay.parse, ("none", "routing", "indexer", "both"))] == [
        (False, False, "none"), (True, False, "routing"), (False, True, "indexer"), (True, True, "both")]
    with pytest.raises(GlmconvError, match="^--replay 'experts': choose from none, routing, indexer, both$"):
        Replay.parse("experts")


def test_a_replay_file_is_read_and_checked(cut8: GlmConfig, tmp_path: Path) -> None:
    save_file({"routed_experts": torch.stack(_experts()), "indexer_topk": torch.stack(_topk())}, tmp_path / "p")
    got = load_replay_file(tmp_path / "p", Replay.parse("both"), cut8, torch.tensor([0, T]))
    assert sorted(got.experts) == [3, 4, 5, 6, 7] and sorted(got.topk) == [3, 7]
    assert torch.equal(got.expert_ids(4, {"experts": torch.zeros(1)}), _experts()[1])  # the file's, not serve's


def test_a_replay_file_of_zeros_names_the_bypassed_capture(cut8: GlmConfig, tmp_path: Path) -> None:
    save_file({"routed_experts": torch.zeros(5, T, 2, dtype=torch.int64)}, tmp_path / "p")
    with pytest.raises(GlmconvError, match=f"^routing payload: {BYPASSED}$"):
        load_replay_file(tmp_path / "p", Replay.parse("routing"), cut8, torch.tensor([0, T]))


@pytest.mark.parametrize("replay,tensors,match", [
    ("none", {"routed_experts": torch.ones(5, T, 2)}, "--replay-file needs --replay routing, indexer or both"),
    ("indexer", {"routed_experts": torch.ones(5, T, 2)}, "no indexer_topk tensor, which --replay asks for"),
    ("routing", {"experts": torch.ones(5, T, 2)}, "holds 'experts'; a replay file holds only routed_experts"),
    ("routing", {"routed_experts": torch.ones(T, 2)}, r"routed_experts has shape \[12, 2\]; expected \[layers, "),
])


def test_a_replay_file_must_hold_what_replay_asks(cut8: GlmConfig, tmp_path: Path, replay: str,
                                                  tensors: dict[str, torch.Tensor], match: str) -> None:
    save_file(tensors, tmp_path / "p")
    with pytest.raises(GlmconvError, match=match):
        load_replay_file(tmp_path / "p", Replay.parse(replay), cut8, torch.tensor([0, T]))


def test_a_pickled_replay_file_is_never_unpickled(cut8: GlmConfig, tmp_path: Path) -> None:
    torch.save({"routed_experts": torch.stack(_experts())}, tmp_path / "p.pt")
    with pytest.raises(GlmconvError, match="p.pt"):
        load_replay_file(tmp_path / "p.pt", Replay.parse("routing"), cut8, torch.tensor([0, T]))

"""A trainer's common state holding megatron objects is read without megatron and written back as the same objects.

glmconv never imports megatron to read a common state: allow-listed megatron globals load as inert stand-ins
(`OpaqueValue`). Relayout writes the state back; a trainer must then load the very objects it saved. Each side
runs in its own process, so that "megatron imported" and "megatron never imported" are facts, not assumptions.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TRAINER_STATE = """
import argparse
from megatron.core.enums import ModelType
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.enums import AttnBackend
state = {"args": argparse.Namespace(attention_backend=AttnBackend.flash, model_type=ModelType.encoder_or_decoder,
                                    num_layers=4, mtp_num_layers=1),
         "optimizer": OptimizerConfig(lr=3e-4, adam_beta2=0.95), "iteration": 7, "checkpoint_version": 3.0}
"""


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_megatron_objects_round_trip_through_a_process_that_never_imports_megatron(tmp_path: Path) -> None:
    saved, relaid = tmp_path / "saved.pt", tmp_path / "relaid.pt"
    _run(TRAINER_STATE + f"""
import io, torch
buf = io.BytesIO(); torch.save([state], buf); open({str(saved)!r}, "wb").write(buf.getvalue())
""")
    _run(f"""
import sys
from glmconv.config import parse_config
from glmconv.fixtures import preset_config
from glmconv.io.torch_dist.common_state import load_common_state
from glmconv.megatron_args import relaid_common_state
from glmconv.io.torch_dist.pickle_allow import OpaqueValue
from glmconv.io.torch_dist.writer import _serialize
read = load_common_state(open({str(saved)!r}, "rb").read(), source="saved")
assert isinstance(read["args"].attention_backend, OpaqueValue) and isinstance(read["optimizer"], OpaqueValue)
state = relaid_common_state(read, parse_config(preset_config("tiny")), "mcore")
open({str(relaid)!r}, "wb").write(_serialize(state).getvalue())
assert not [m for m in sys.modules if m.split(".")[0] == "megatron"], "megatron was imported"
""")
    out = _run(TRAINER_STATE + f"""
import argparse, io, torch
from megatron.core.safe_globals import SAFE_GLOBALS
data = open({str(relaid)!r}, "rb").read()
(back,) = torch.load(io.BytesIO(data), weights_only=False)
with torch.serialization.safe_globals([*SAFE_GLOBALS, argparse.Namespace]):
    (strict,) = torch.load(io.BytesIO(data), weights_only=True)
for got in (back, strict):
    assert got["args"].attention_backend is state["args"].attention_backend
    assert got["args"].model_type is state["args"].model_type
    assert got["optimizer"] == state["optimizer"]
    assert (got["iteration"], got["args"].num_layers, got["args"].mtp_num_layers) == (7, 4, None)
print(back["glmconv"])
""")
    assert out.strip() == "{'layout': 'mcore'}"


def test_a_state_without_megatron_objects_is_pickled_by_pickle_itself() -> None:
    import pickle

    from glmconv.io.torch_dist.common_state import pickle_module_for
    from glmconv.io.torch_dist.pickle_allow import OpaqueValue

    stand_in = type("AttnBackend", (OpaqueValue,), {"qualname": "megatron.core.transformer.enums.AttnBackend"})
    assert pickle_module_for({"args": {"x": 1}, "iteration": 0}) is pickle
    assert pickle_module_for({"args": {"backend": stand_in(1)}}) is not pickle

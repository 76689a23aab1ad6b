"""benchmarks/multirank_roundtrip.py on two gloo ranks: megatron-core loads a converted cut8 at TP2, EP2 and
TP2xEP2, saves it with its own saver at TP2xEP2 (chunks split along dims 0 and 1, both ranks writing), and
glmconv export gives the HF fixture back bit for bit from it, through the zero-copy path only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import mcore_helpers as mh

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multirank_roundtrip.py"


@pytest.mark.slow
def test_megatron_load_save_at_tp2xep2_then_export_is_bit_exact(cut8_ckpt: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(mh.free_port()), str(SCRIPT), "--backend", "gloo", "--fixture", str(cut8_ckpt),
           "--work", str(tmp_path / "work"), "--json-out", str(tmp_path / "result.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    for layout, figures in result["load"].items():
        assert figures["bit_exact"] == figures["pieces"] > 700, layout
    assert result["saved_chunks_split_along"] == {"dim0": 84, "dim1": 24}
    export = result["export"]
    assert export["bit_exact"] == export["hf_tensors"] == 427 and export["extra"] == 0
    assert export["chunks_via_torch_load"] == 0
    assert result["audit_names_against"]["exit"] == 0 and result["verify"]["exit"] == 0

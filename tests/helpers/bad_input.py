"""Breaking a checkpoint and checking a refusal: the bad-input contract of tests/io/test_bad_input.py (one `error:`
line, exit 2, every input untouched, nothing published), shared by every test that checks a refusal that way."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from glmconv.io.config_file import load_config
from glmconv.io.file_names import COMMON_STATE_KEY, CONFIG_NAME, DCP_METADATA_NAME, INDEX_NAME, RELEASE
from glmconv.io.torch_dist.safe_unpickle import safe_load
from glmconv_cli.main import cli

TEXT = "model.language_model."
DOWN0 = TEXT + "layers.0.mlp.down_proj.weight"  # BF16 [64, 160]; FP8 in the FP8 fixture
Q_B3 = TEXT + "layers.3.self_attn.q_b_proj.weight"  # FP8 in the FP8 fixture
EMBED = TEXT + "embed_tokens.weight"
EXPERTS_FC2 = "decoder.layers.3.mlp.experts.experts.linear_fc2.weight"  # [8, 64, 32] in Megatron


# ---- checking a run ----------------------------------------------------------------------------------

def sha256_tree(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (symlinks followed, so a link's target counts too)."""
    out = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if os.path.isdir(d) else []  # isdir: False for a name too long


@dataclass
class Outcome:
    exit_code: int
    stderr: str
    stdout: str


def invoke(args: list[str]) -> Outcome:
    result = CliRunner().invoke(cli, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        tb = "".join(traceback.format_exception(*result.exc_info))  # type: ignore[misc]
        pytest.fail(f"`glmconv {' '.join(args)}` died of an exception instead of an error line:\n{tb}")
    return Outcome(result.exit_code, result.stderr, result.stdout)


def assert_refused(args: list[str], inputs: list[Path], out: Path, pattern: str, exit_code: int = 2) -> str:
    """Run `glmconv ARGS` and check the contract; returns the error line."""
    before_inputs = sha256_tree(*inputs)
    parent = out.parent
    before_parent = listing(parent)
    before_out = sha256_tree(out) if os.path.exists(out) else None
    got = invoke(args)
    assert "Traceback" not in got.stderr + got.stdout, got.stderr
    lines = got.stderr.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"stderr is not one error line: {got.stderr!r}"
    line = lines[0]
    assert re.search(pattern, line), f"{line!r} does not match {pattern!r}"
    assert got.exit_code == exit_code, (got.exit_code, line)
    assert sha256_tree(*inputs) == before_inputs, "the input was modified"
    assert listing(parent) == before_parent, f"left behind in {parent}: {set(listing(parent)) ^ set(before_parent)}"
    if before_out is not None:
        assert sha256_tree(out) == before_out, "an existing OUT was modified"
    return line


# ---- breaking an HF checkpoint -----------------------------------------------------------------------

def weight_map(src: Path) -> dict[str, str]:
    return json.loads((src / INDEX_NAME).read_text())["weight_map"]


def write_index(src: Path, wm: dict[str, str]) -> None:
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"] = wm
    (src / INDEX_NAME).write_text(json.dumps(index, indent=2))


def edit_shard(src: Path, shard: str, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Rewrite one shard with its tensors edited (the index is left to the caller)."""
    path = src / shard
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    save_file(edit(tensors), str(path), metadata=meta)


def edit_tensor(src: Path, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    edit_shard(src, weight_map(src)[name], lambda ts: {**ts, name: fn(ts[name]).contiguous()})


def drop_tensor(src: Path, name: str) -> None:
    wm = weight_map(src)
    shard = wm.pop(name)
    edit_shard(src, shard, lambda ts: {k: v for k, v in ts.items() if k != name})
    write_index(src, wm)


def add_tensor(src: Path, name: str, t: torch.Tensor, shard: str | None = None, index: bool = True) -> None:
    wm = weight_map(src)
    shard = shard or sorted(set(wm.values()))[-1]
    edit_shard(src, shard, lambda ts: {**ts, name: t})
    if index:
        wm[name] = shard
        write_index(src, wm)


def shard_names(src: Path) -> list[str]:
    return sorted(set(weight_map(src).values()))


def edit_config(src: Path, fn: Callable[[dict], dict | None]) -> None:
    cfg = json.loads((src / CONFIG_NAME).read_text())
    cfg = fn(cfg) or cfg
    (src / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))


def set_text(**kv: object) -> Callable[[dict], None]:
    return lambda cfg: cfg["text_config"].update(kv)


def cut_config_layers(src: Path, n: int) -> None:
    (src / CONFIG_NAME).write_text(json.dumps(load_config(src).cut(n).to_json(), indent=2))


def overwrite_header(src: Path, shard: str, fn: Callable[[bytes], bytes]) -> None:
    path = src / shard
    path.write_bytes(fn(path.read_bytes()))


def garbage_header(data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    return data[:8] + b"\xff{not json" + b"x" * (n - 11) + data[8 + n:]


def absurd_length(data: bytes) -> bytes:
    return struct.pack("<Q", 2**40) + data[8:]


def set_first(value: float, index: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[index] = value
        return t
    return fn


def fp8_nan_code(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(torch.uint8)[2, 9] = 0x7F  # e4m3fn NaN
    return t


# ---- breaking a torch_dist checkpoint ----------------------------------------------------------------

def edit_metadata(mc: Path, fn: Callable[[object], None]) -> None:
    path = mc / RELEASE / DCP_METADATA_NAME
    md = safe_load(path)
    fn(md)
    path.write_bytes(pickle.dumps(md))


def drop_common_state(md: object) -> None:
    del md.state_dict_metadata[COMMON_STATE_KEY]  # type: ignore[attr-defined]
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != COMMON_STATE_KEY}  # type: ignore


def first_distcp(mc: Path) -> Path:
    return sorted((mc / RELEASE).glob("*.distcp"))[0]


def set_mcore(name: str, value: float, index: tuple[int, ...]) -> Callable[[dict], dict]:
    def edit(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ts[name] = ts[name].clone()
        ts[name][index] = value
        return ts
    return edit

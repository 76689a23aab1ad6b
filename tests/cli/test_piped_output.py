"""Output read through a pipe: counts agree with their nouns, tables keep tensor names on one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.checkpoints import plan_tensors, tiny_config, write_hf

from glmconv.text import PIPE_WIDTH, console, count
from glmconv_cli.main import cli


def test_count_is_singular_only_for_one() -> None:
    assert [count(n, "shard") for n in (0, 1, 2, 1234)] == ["0 shards", "1 shard", "2 shards", "1,234 shards"]
    assert count(1, "HF tensor") == "1 HF tensor" and count(3, "mapping") == "3 mappings"


def test_console_is_wide_when_stdout_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert console().width == PIPE_WIDTH  # pytest captures stdout: not a terminal


def test_audit_table_keeps_a_long_tensor_name_on_one_line_when_piped(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    t = plan_tensors(tiny_config())
    name = "model.language_model.layers.1.self_attn.indexer.k_norm.bias_" + "x" * 60  # 120 characters
    t[name] = t.pop("model.language_model.layers.1.self_attn.indexer.k_norm.bias")
    res = CliRunner().invoke(cli, ["audit-names", str(write_hf(tmp_path / "ck", tensors=t))])
    assert res.exit_code == 1, res.output
    rows = [line for line in res.output.splitlines() if "│ unexpected" in line]
    assert len(rows) == 1 and name in rows[0]


def test_fixture_make_says_1_shard(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["fixture", "make", str(tmp_path / "f"), "--shard-size", "1GB"])
    assert res.exit_code == 0, res.output
    assert res.output.rstrip().endswith(" in 1 shard"), res.output

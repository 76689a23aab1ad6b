"""Publishing is durable: every staged file and directory is on disk before OUT's name points at them."""

from __future__ import annotations

import os
from pathlib import Path

from glmconv.io import output


def test_publish_fsyncs_every_file_and_directory_before_the_rename(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out"
    real = output.resolve_out(out)
    output.check_target(out, real, False)
    stage = output.open_stage(real)
    (stage.path / "model.safetensors").write_bytes(b"weights")
    (stage.path / "hf_sidecars").mkdir()
    (stage.path / "hf_sidecars" / "generation_config.json").write_text("{}")
    synced: list[tuple[str, bool]] = []
    fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), out.exists()))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    output.publish(stage, out, real, False)
    before = {Path(p).relative_to(stage.path).as_posix() for p, published in synced
              if not published and p.startswith(str(stage.path))}
    assert {"model.safetensors", "hf_sidecars", "hf_sidecars/generation_config.json", "."} <= before
    assert (str(tmp_path), True) in synced  # then the directory holding OUT, for the rename itself
    assert (out / "model.safetensors").read_bytes() == b"weights"

"""A whole checkpoint's stored objects checked before a run starts, the way a trainer's load will read them
(`stored_objects` checks one object; the common state must also parse as glmconv reads it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmconv.io.file_names import COMMON_STATE_KEY
from glmconv.io.torch_dist.common_state import EXPECTED, MAX_COMMON_BYTES, load_common_state
from glmconv.io.torch_dist.reader import iter_bytes_entries
from glmconv.io.torch_dist.stored_objects import check_object


def check_stored_objects(iter_dir: Path, keys: list[str], metadata: Any = None) -> None:
    """Load every non-tensor entry `keys` of the checkpoint in `iter_dir` as a trainer would; refuse the first
    that fails, naming the entry and its data file (`metadata`: its `.metadata`, already read as stand-ins)."""

    limits = {COMMON_STATE_KEY: (MAX_COMMON_BYTES, EXPECTED)}  # refused unread, as reading it refuses it
    for key, (file, data) in zip(keys, iter_bytes_entries(iter_dir, keys, limits=limits, metadata=metadata)):
        where = f"{iter_dir / file}: {key}"
        if key == COMMON_STATE_KEY:
            load_common_state(data, source=where)
        check_object(data, where)

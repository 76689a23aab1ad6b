"""Issue 25: a `.metadata` whose objects are malformed (a field of the wrong type, a list where a dict belongs,
an offset None, an attribute renamed) is the user's input: one CheckpointError naming `.metadata`, never an
AttributeError or TypeError (the CLI's "internal error", exit 3)."""

from __future__ import annotations

import copy
import pickle
import shutil
import tempfile
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.checkpoints import small_torch_dist
from helpers.fuzzing import fuzz
from hypothesis import given
from hypothesis import strategies as st

from glmconv.errors import CheckpointError
from glmconv.io.file_names import DCP_METADATA_NAME, RELEASE
from glmconv.io.torch_dist.metadata import inspect_torch_dist
from glmconv.io.torch_dist.reader import DcpReader, read_bytes_entry
from glmconv.io.torch_dist.safe_unpickle import safe_load

HOSTILE = [None, -1, 2**70, 1.5, True, "x", "", [], {}, (), [0, 0], {"a": 1}, b"\x00"]
Edit = Callable[[Any], None]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_torch_dist(tmp_path_factory.mktemp("md") / "ck")


def _fields(obj: Any) -> Iterator[tuple[str, Any]]:
    """The attributes of a metadata object (dataclass or plain), as pickled."""
    state = obj.__getstate__() if hasattr(type(obj), "__setstate__") else getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        yield from state.items()


def places(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in the metadata's object graph a value sits: attributes, list items, dict values, dict keys."""
    if isinstance(obj, dict):
        for i, v in enumerate(obj.values()):
            yield (*path, ("key", i))
            yield (*path, ("value", i))
            yield from places(v, (*path, ("value", i)))
        return
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            yield (*path, ("item", i))
            yield from places(v, (*path, ("item", i)))
        return
    if type(obj).__module__.startswith("torch.distributed"):
        for name, v in _fields(obj):
            yield (*path, ("attr", name))
            yield from places(v, (*path, ("attr", name)))


def _get(obj: Any, step: tuple[str, Any]) -> Any:
    kind, at = step
    if kind == "attr":
        return dict(_fields(obj))[at]
    if kind == "item":
        return obj[at]
    return list(obj.items())[at][1] if kind == "value" else list(obj)[at]


def _set(obj: Any, step: tuple[str, Any], value: Any, rename: bool) -> None:
    kind, at = step
    if kind == "attr":
        state = dict(_fields(obj))
        if rename:
            state[at + "_"] = state.pop(at)
        else:
            state[at] = value
        if hasattr(type(obj), "__setstate__"):
            obj.__setstate__(tuple(state.values()) if isinstance(obj.__getstate__(), tuple) else state)
        else:
            obj.__dict__.clear()
            obj.__dict__.update(state)
    elif kind == "item":
        obj[at] = value
    else:
        items = list(obj.items())
        k, v = items[at]
        key = value if isinstance(value, Hashable) else str(value)
        items[at] = (key, v) if kind == "key" else (k, value)
        obj.clear()
        obj.update(items)


def mutate(md: Any, path: tuple[Any, ...], value: Any, rename: bool) -> Any:
    md = copy.deepcopy(md)
    target = md
    for step in path[:-1]:
        target = _get(target, step)
    _set(target, path[-1], value, rename)
    return md


def read_everything(root: Path) -> None:
    """What export, verify and audit read of a checkpoint's metadata: the listing, every tensor, every object."""
    ckpt = inspect_torch_dist(root)
    reader = DcpReader(root)
    for name in reader.names():
        reader.read(name)
        reader.byte_extents(name, 0, 0)
    for key in ckpt.objects:
        read_bytes_entry(root / RELEASE, key)


@given(data=st.data())
@fuzz(60)
def test_a_malformed_metadata_object_is_one_checkpoint_error(small: Path, data: st.DataObject) -> None:
    md = safe_load(small / RELEASE / DCP_METADATA_NAME)
    path = data.draw(st.sampled_from(list(places(md))), label="place")
    rename = path[-1][0] == "attr" and data.draw(st.booleans(), label="rename")
    value = data.draw(st.sampled_from(HOSTILE), label="value")
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "ck"
        shutil.copytree(small, root)
        (root / RELEASE / DCP_METADATA_NAME).write_bytes(pickle.dumps(mutate(md, path, value, rename)))
        try:
            read_everything(root)
        except CheckpointError as exc:
            assert "\n" not in str(exc)


@pytest.mark.parametrize("case", ["storage_data a list", "storage offset None", "relative_path renamed",
                                  "chunk sizes a string", "dtype a string"])


def test_the_reported_malformations_name_metadata(case: str, small: Path, tmp_path: Path) -> None:
    md = safe_load(small / RELEASE / DCP_METADATA_NAME)
    info = next(iter(md.storage_data.values()))
    entry = md.state_dict_metadata["a.weight"]
    if case == "storage_data a list":
        md.storage_data = list(md.storage_data.values())
    elif case == "storage offset None":
        info.offset = None
    elif case == "relative_path renamed":
        info.__dict__["relative_pat"] = info.__dict__.pop("relative_path")
    elif case == "chunk sizes a string":
        object.__setattr__(entry.chunks[0], "sizes", "43")
    else:
        entry.properties.dtype = "bfloat16"
    root = tmp_path / "ck"
    shutil.copytree(small, root)
    (root / RELEASE / DCP_METADATA_NAME).write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"^\.metadata: "):
        read_everything(root)

"""Damage a trainer's torch.load rejects is refused by verify and export (issue 25, #7).

One-bit flips in a converted checkpoint's stored objects (`_extra_state` entries, the common state) and in the
non-data bytes of a tensor archive export copies unread: wherever the load a Megatron trainer makes fails,
verify and export refuse (exit 2, one line naming the entry and its data file), never "equal bit for bit".
The oracle is the trainer's own load (DCP: `torch.load(weights_only=False)` for objects, weights-only for
tensors), run with an unpickler that builds only the globals the undamaged archive holds.
"""

from __future__ import annotations

import fractions
import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

import glmconv
from glmconv.errors import GlmconvError
from glmconv.io.file_names import COMMON_STATE_KEY, CONFIG_NAME
from glmconv.io.torch_dist.common_state import read_common_state
from glmconv.io.torch_dist.reader import DcpReader, locate_tensor_data, read_bytes_entry, read_metadata
from glmconv.io.torch_dist.stored_objects import check_object
from glmconv.io.torch_dist.writer import DcpWriter
from glmconv.rules import names

pytestmark = pytest.mark.filterwarnings("ignore")
FLIPS = 10  # flips the trainer's load rejects, per stored item (a deterministic spread over its bytes)


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    mc = tmp_path_factory.mktemp("objects") / "mc"
    glmconv.convert(tiny_ckpt, mc)
    return tiny_ckpt, mc


class _Allowed(pickle.Unpickler):
    """The real unpickler, resolving only the globals the undamaged objects (tensor lists, the common state) name."""

    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"), ("torch", "ByteStorage"),
               ("torch", "BFloat16Storage"), ("torch", "FloatStorage"), ("argparse", "Namespace")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


class _AllowedModule:
    Unpickler = _Allowed
    __name__ = "pickle"


def trainer_loads(data: bytes, *, tensor: bool) -> bool:
    """Whether DCP's load of this item (as a Megatron trainer runs it) succeeds."""
    try:
        if tensor:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        else:
            torch.load(io.BytesIO(data), weights_only=False, pickle_module=_AllowedModule)
    except Exception:
        return False
    return True


def _item(mc: Path, pick: Any) -> tuple[Path, int, int, Any]:
    md = read_metadata(mc / "release")
    key = next(k for k in md.storage_data if pick(k.fqn, md.state_dict_metadata[k.fqn]))
    info = md.storage_data[key]
    return mc / "release" / info.relative_path, int(info.offset), int(info.length), md.state_dict_metadata[key.fqn]


def _flip(src: Path, dst: Path, file: Path, at: int) -> bytes:
    shutil.copytree(src, dst)
    target = dst / file.relative_to(src)
    data = bytearray(target.read_bytes())
    data[at // 8] ^= 1 << (at % 8)
    target.write_bytes(bytes(data))
    return bytes(data)


def _rejected_flips(data: bytes, bits: range, tensor: bool, skip: range = range(0)) -> list[int]:
    """Up to FLIPS bit positions in `bits` whose flip the trainer's load rejects, spread over the range."""
    candidates = [b for b in bits if b // 8 not in skip]
    found = []
    for bit in candidates[::max(1, len(candidates) // 400)]:
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        if not trainer_loads(bytes(flipped), tensor=tensor):
            found.append(bit)
    return found[:: max(1, len(found) // FLIPS)][:FLIPS]


def _refused(hf: Path, mc: Path, out: Path) -> list[str]:
    errors = []
    for run in (lambda: glmconv.verify(hf, mc), lambda: glmconv.export(mc, out)):
        with pytest.raises(GlmconvError) as caught:
            run()
        errors.append(str(caught.value))
    assert not out.exists()
    return errors


def test_an_extra_state_flip_the_trainer_cannot_load_is_refused_by_verify_and_export(
        converted: tuple[Path, Path], tmp_path: Path) -> None:
    hf, mc = converted
    file, offset, length, _ = _item(mc, lambda k, e: names.is_extra_state(k) and isinstance(e, BytesStorageMetadata))
    data = file.read_bytes()[offset:offset + length]
    flips = _rejected_flips(data, range(length * 8), tensor=False)
    assert len(flips) == FLIPS
    for bit in flips:
        case = tmp_path / f"bit{bit}"
        _flip(mc, case / "mc", file, offset * 8 + bit)
        for message in _refused(hf, case / "mc", case / "out"):
            assert file.name in message and "_extra_state" in message and "not loadable" in message, message


def test_the_common_state_flipped_where_the_trainer_cannot_load_it_is_refused(
        converted: tuple[Path, Path], tmp_path: Path) -> None:
    hf, mc = converted
    file, offset, length, _ = _item(mc, lambda k, e: k.startswith("common_state"))
    data = file.read_bytes()[offset:offset + length]
    for bit in _rejected_flips(data, range(length * 8), tensor=False)[:4]:
        case = tmp_path / f"bit{bit}"
        _flip(mc, case / "mc", file, offset * 8 + bit)
        _refused(hf, case / "mc", case / "out")


def test_a_tensor_archive_flip_outside_the_copied_bytes_is_refused_by_export(
        converted: tuple[Path, Path], tmp_path: Path) -> None:
    """Export copies a tensor's data record unread (zero-copy): the rest of its archive is what torch checks."""
    _, mc = converted
    file, offset, length, entry = _item(mc, lambda k, e: k.endswith("linear_fc2.weight")
                                        and isinstance(e, TensorStorageMetadata))
    sizes = tuple(int(s) for s in entry.chunks[0].sizes)
    data = file.read_bytes()[offset:offset + length]
    extent = locate_tensor_data(file, offset, length, entry.properties.dtype, sizes)
    assert extent is not None
    copied = range(extent.offset - offset, extent.offset - offset + extent.length)
    flips = _rejected_flips(data, range(length * 8), tensor=True, skip=copied)
    assert len(flips) == FLIPS
    for bit in flips:
        case = tmp_path / f"bit{bit}"
        _flip(mc, case / "mc", file, offset * 8 + bit)
        with pytest.raises(GlmconvError, match=file.name):
            glmconv.export(case / "mc", case / "out")
        assert not (case / "out").exists()


def test_flips_the_trainer_loads_still_verify_equal(converted: tuple[Path, Path], tmp_path: Path) -> None:
    """The checks refuse damage, not bytes torch ignores (the zip's padding)."""
    hf, mc = converted
    file, offset, length, _ = _item(mc, lambda k, e: names.is_extra_state(k) and isinstance(e, BytesStorageMetadata))
    data = file.read_bytes()[offset:offset + length]
    pad = data.index(b"ZZZZ")
    _flip(mc, tmp_path / "mc", file, (offset + pad) * 8)
    assert trainer_loads(_flip_bytes(data, pad * 8), tensor=False)
    assert glmconv.verify(hf, tmp_path / "mc")["equal"]


def _flip_bytes(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


# ---- what a Megatron trainer saves and loads: accepted as its own load accepts it -------------------------------

def _rng_state() -> list[dict[str, Any]]:
    """The `rng_state` ShardedObject a trainer saves unless --no-save-rng (megatron's get_rng_state)."""
    import random

    import numpy as np

    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {"model-parallel-rng": torch.Generator()
                                                                             .get_state()}}]


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("obj", [_rng_state(), torch.Generator(), io.BytesIO(b"te extra state")],
                         ids=["numpy-and-torch-rng-states", "torch-generator", "bytesio-extra-state"])
def test_objects_on_megatrons_allow_list_are_loadable(obj: Any) -> None:
    check_object(_saved(obj), "rng_state/shard_0.0_1.1")  # megatron-core's SAFE_GLOBALS: a trainer loads these


def test_an_object_outside_megatrons_allow_list_is_refused() -> None:
    with pytest.raises(GlmconvError, match=r"^x: stored object is not loadable by torch\.load \(.*fractions"):
        check_object(_saved(fractions.Fraction(1, 3)), "x")


def test_a_trainer_checkpoint_with_its_rng_state_exports_and_verifies(converted: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    hf, mc = converted
    saved = tmp_path / "saved"
    reader = DcpReader(mc)
    writer = DcpWriter(saved)
    writer.write({n: reader.read(n) for n in reader.names()})
    objects = {k: torch.load(io.BytesIO(read_bytes_entry(reader.iter_dir, k)), weights_only=True)[0]
               for k in reader.ckpt.objects if k != COMMON_STATE_KEY}
    writer.write_objects({**objects, "rng_state/shard_0.0_1.1": _rng_state()})
    writer.finish(read_common_state(reader.iter_dir))
    shutil.copyfile(mc / CONFIG_NAME, saved / CONFIG_NAME)
    assert "rng_state/shard_0.0_1.1" in DcpReader(saved).ckpt.objects
    assert glmconv.verify(hf, saved)["equal"]
    glmconv.export(saved, tmp_path / "hf", like=hf)
    assert glmconv.verify(tmp_path / "hf", mc)["equal"]

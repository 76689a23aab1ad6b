"""The bounds scan's short paths give the verdicts of a plain replay over `pickletools.genops` (the scan as it was
written first, kept here as the reference), on pickles of every protocol and on thousands of corruptions of them."""

from __future__ import annotations

import argparse
import pickle
import pickletools
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from glmconv.io.torch_dist.pickle_bounds import (
    CALL,
    DUP,
    GET,
    MARK,
    MEMOIZE,
    POP,
    PUT,
    SAME,
    TUPLE,
    PickleOutOfBounds,
    _scan_bounds,
    actions,
)

NESTING = 100
_ACTIONS = actions()


def reference_scan(pkl: bytes, nesting: int) -> None:
    """The scan opcode by opcode through `genops`, every opcode the same way."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[Any, int] = {}
    fence, most = 0, 2 * len(pkl) + 1024
    try:
        for op, arg, pos in pickletools.genops(pkl):
            action, marked, below, pushed = _ACTIONS[ord(op.code)]
            if action == MARK:
                marks.append(len(stack))
                fence = len(stack)
                continue
            if action == POP and marks and fence == len(stack):
                marks.pop()
                fence = marks[-1] if marks else 0
                continue
            if action in (PUT, MEMOIZE):
                if len(stack) <= fence:
                    raise pickle.UnpicklingError("memo put of an empty stack")
                index = arg if action == PUT and isinstance(arg, int) else len(memo)
                if not 0 <= index < most:
                    raise PickleOutOfBounds(f"puts memo entry {index:,} (at byte {pos}), past the {most:,} a "
                                            f"pickle of {len(pkl):,} bytes may use")
                memo[index] = stack[-1]
                continue
            if action == GET:
                if arg not in memo:
                    raise pickle.UnpicklingError(f"memo key {arg} is missing")
                stack.append(memo[arg])
                continue
            inputs: list[int] = []
            if marked:
                if not marks:
                    raise pickle.UnpicklingError("could not find MARK")
                inputs = stack[marks[-1]:]
                del stack[marks.pop():]
                fence = marks[-1] if marks else 0
            if below:
                if len(stack) - below < fence:
                    raise pickle.UnpicklingError("unpickling stack underflow")
                inputs = stack[-below:] + inputs
                del stack[-below:]
            if action == TUPLE:
                depth = 1 + max(inputs, default=0)
                if depth > nesting:
                    raise PickleOutOfBounds(f"nests tuples more than {nesting} deep (at byte {pos})")
                stack.append(depth)
            elif action in (SAME, CALL):
                stack.append(inputs[0] if action == SAME else max(inputs, default=0))
            elif action == DUP:
                stack += inputs * 2
            elif pushed:
                stack.append(0)
    except (ValueError, IndexError, KeyError) as exc:
        raise pickle.UnpicklingError(str(exc) or type(exc).__name__) from None


def verdict(scan: Any, pkl: bytes) -> tuple[str, str]:
    """passed; out of bounds, with the message; malformed (the unpickler's to name)."""
    try:
        scan(pkl, NESTING)
    except PickleOutOfBounds as exc:
        return "out of bounds", str(exc)
    except pickle.UnpicklingError:
        return "malformed", ""
    return "passed", ""


def _nested(n: int) -> Any:
    t: Any = ()
    for _ in range(n):
        t = (t,)
    return t


class _Obj:
    def __init__(self) -> None:
        self.a, self.b = (1, (2, (3,))), {"x": [1, 2]}


VALUES = [None, True, -5, 300, 70000, 2**70, -2**200, 1.5, "h\u00e9llo\u20ac", "x" * 300, b"bytes", b"y" * 300,
          bytearray(b"ba"), (1, 2), (1, 2, 3, 4), [1, [2, [3]]], {(1, 2): {3: (4,)}}, {1, 2}, frozenset({(1,), (2,)}),
          OrderedDict(a=(1,)), argparse.Namespace(x=_nested(5)), [_nested(99)], {_nested(99): 1},
          {(_nested(99),): 1}, _Obj(), [_Obj(), _Obj()], list(range(300)), {str(i): (i, str(i)) for i in range(40)}]
BASES = [pickle.dumps(v, protocol=p) for p in range(6) for v in [*VALUES, VALUES]]
BASES += [b"\x80\x02r" + (10**8).to_bytes(4, "little") + b".",  # a memo bomb
          b"\x80\x02}" + b"(" * 5 + b")" + b"\x85" * 200 + b"K\x01s.", b"(((((((t", b"", b".", b"\x80\x05\x95"]


EDGES = [b"(K\x01u.", b"}(K\x01K\x02u.", b"](K\x01e.", b"(e.", b"]((K\x01e.", b"(t.", b")0.", b"K\x010.",
         b"(0.", b"(1.", b"K\x01(1.", b"K\x01\x94.", b"\x94.", b"(\x94.", b"K\x01q\x00h\x00.", b"h\x00.", b"K\x012.",
         b"(2.", b"K\x01\x85\x85\x85.", b"(K\x01\x85.", b"(\x85.", b"(K\x01K\x02\x86.", b"K\x01(K\x02\x86.",
         b"K\x01K\x02(b.", b"K\x01K\x02b.", b"K\x01(K\x02b.", b"(K\x01K\x02t\x85\x85.", b"K\x01", b"\x8c\x05ab",
         b"\x8c\x02\xff\xfe.", b"X\xff\xff\xff\xff.", b"T\xff\xff\xff\xff.", b"\x8a\x02\x01.", b"I12\n.", b"I12.",
         b"p1\n.", b"K\x01p1\ng1\n.", b"K\x01p99999999999\n.", b"cos\nsystem\n.",
         b"\x95\x01\x00\x00\x00\x00\x00\x00\x00N."]
EDGES += [b"(K\x01uK\x01.", b"K\x01(\x94t0.", b"K\x01(\x85t0.", b"K\x01(K\x02\x86t0.", b"K\x01(b0K\x01.",
          b"K\x01(1K\x01.", b"K\x01(0t0."]  # a refusal with a well-formed rest: a late one would pass
BASES += EDGES


def _corrupted(base: bytes, rng: random.Random) -> bytes:
    """`base` with a byte changed, inserted or removed, its tail cut, or a few bytes changed."""
    x = bytearray(base or b".")
    i, kind = rng.randrange(len(x)), rng.randrange(5)
    if kind == 0:
        x[i] = rng.randrange(256)
    elif kind == 1:
        del x[i:]
    elif kind == 2:
        x.insert(i, rng.randrange(256))
    elif kind == 3:
        del x[i]
    else:
        for _ in range(rng.randrange(1, 6)):
            x[rng.randrange(len(x))] = rng.randrange(256)
    return bytes(x)


@pytest.mark.parametrize("protocol", range(6))
def test_every_protocols_pickles_get_the_references_verdict(protocol: int) -> None:
    for value in [*VALUES, VALUES]:
        pkl = pickle.dumps(value, protocol=protocol)
        assert verdict(_scan_bounds, pkl) == verdict(reference_scan, pkl), (protocol, value)


@pytest.mark.parametrize("pkl", EDGES)
def test_hand_made_edges_get_the_references_verdict(pkl: bytes) -> None:
    assert verdict(_scan_bounds, pkl) == verdict(reference_scan, pkl)


def test_a_dcp_metadata_passes_as_the_reference_passes_it(mc_ckpt: Path) -> None:
    pkl = (mc_ckpt / "release" / ".metadata").read_bytes()
    assert verdict(_scan_bounds, pkl) == verdict(reference_scan, pkl) == ("passed", "")


def test_thousands_of_corrupted_pickles_get_the_references_verdicts(mc_ckpt: Path) -> None:
    rng = random.Random(0)
    bases = [*BASES, (mc_ckpt / "release" / ".metadata").read_bytes()]
    seen: dict[str, int] = {}
    for base in bases:
        for _ in range(40):
            pkl = _corrupted(base, rng)
            want = verdict(reference_scan, pkl)
            assert verdict(_scan_bounds, pkl) == want, pkl[:80]
            seen[want[0]] = seen.get(want[0], 0) + 1
    assert seen["passed"] > 300 and seen["out of bounds"] > 100 and seen["malformed"] > 3000, seen

"""A pickle's bounds, checked before anything unpickles it: no tuple nested past the C stack, no memo bomb.

The scan replays the unpickler's stack with each item's tuple depth only, opcode by opcode. It is the one pass
over a Megatron `.metadata` that grows with its tensors (230,000 opcodes on the 3 GB bench), so the opcodes most
pickles are made of (a value pushed, the memo's, MARK, a call or a small tuple) take a short path, the rest the
general one; tests/io/test_pickle_bounds.py holds it to the verdicts of a plain replay over `pickletools.genops`.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import pickletools
from typing import Any

from glmconv.io.torch_dist.passed import Passed

MAX_TUPLE_NESTING = 100  # a Megatron checkpoint's pickles nest tuples a few levels deep
_MEMO_SLACK = 1024  # memo indices a pickle may skip past its own size (pickle's own writers number them 0, 1, 2, ...)


class PickleOutOfBounds(pickle.UnpicklingError):
    """A pickle that glmconv does not unpickle: a tuple nested too deep, a memo index past what its size allows."""


VALUE, TUPLE, SAME, CALL, PUT, MEMOIZE, GET, MARK, POP, DUP = range(10)


def actions() -> dict[int, tuple[int, bool, int, int]]:
    """Opcode byte -> (action, pops to a mark, items it pops below the mark or from the stack, items it pushes)."""

    named = {"EMPTY_TUPLE": TUPLE, "TUPLE": TUPLE, "TUPLE1": TUPLE, "TUPLE2": TUPLE, "TUPLE3": TUPLE,
             **dict.fromkeys(("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD", "READONLY_BUFFER"),
                             SAME),
             **dict.fromkeys(("REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST", "BINPERSID", "STACK_GLOBAL"), CALL),
             "PUT": PUT, "BINPUT": PUT, "LONG_BINPUT": PUT, "MEMOIZE": MEMOIZE, "GET": GET, "BINGET": GET,
             "LONG_BINGET": GET, "MARK": MARK, "POP": POP, "DUP": DUP}
    out = {}
    for op in pickletools.opcodes:
        before = op.stack_before
        marked = pickletools.markobject in before
        below = before.index(pickletools.markobject) if marked else len(before)
        out[ord(op.code)] = (named.get(op.name, VALUE), marked, below, len(op.stack_after))
    return out


# ---- each opcode's argument: its layout ---------------------------------------------------------------------------

_FIXED, _COUNTED, _TEXT = range(3)  # n bytes; a count of n bytes, then that many; a line or two (protocols 0, 1)
_COUNTS = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
           pickletools.TAKEN_FROM_ARGUMENT4U: (4, False), pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}
_UTF8 = frozenset(ord(c) for c in (pickle.SHORT_BINUNICODE, pickle.BINUNICODE, pickle.BINUNICODE8))
_INDEXED = frozenset(ord(c) for c in (pickle.BINPUT, pickle.LONG_BINPUT, pickle.BINGET, pickle.LONG_BINGET))
_STOP, _MARK_CODE, _MEMOIZE_CODE = ord(pickle.STOP), ord(pickle.MARK), ord(pickle.MEMOIZE)
_BINGET, _LONG_BINGET, _EMPTY_TUPLE = ord(pickle.BINGET), ord(pickle.LONG_BINGET), ord(pickle.EMPTY_TUPLE)
_INTO_CONTAINER = frozenset(ord(c) for c in (pickle.SETITEMS, pickle.APPENDS, pickle.ADDITEMS))

Step = tuple[int, bool, int, int, int, int, bool, Any]  # actions()' four; the argument's layout, size, sign, reader


def _steps() -> list[Step | None]:
    """Opcode byte -> its `Step`; None for a byte that is no opcode."""
    table: list[Step | None] = [None] * 256
    ops = {ord(op.code): op for op in pickletools.opcodes}
    for code, (action, marked, below, pushed) in actions().items():
        arg = ops[code].arg
        if arg is None or arg.n >= 0:
            table[code] = (action, marked, below, pushed, _FIXED, arg.n if arg else 0, False, None)
        elif arg.n in _COUNTS:
            table[code] = (action, marked, below, pushed, _COUNTED, *_COUNTS[arg.n], None)
        else:
            table[code] = (action, marked, below, pushed, _TEXT, 0, False, arg.reader)
    return table


_STEPS = _steps()
_PUSHES = [1 + s[5] if s and s[:4] == (VALUE, False, 0, 1) and s[4] == _FIXED else 0  # a value pushed: bytes to skip
           for s in _STEPS]
_FOLDS = [(s[0], s[2]) if s and s[0] in (SAME, CALL, TUPLE) and not s[1] and s[2] and s[3] == 1 and s[4] == _FIXED
          and s[5] == 0 else None for s in _STEPS]  # k items popped, one pushed: (action, k)


# ---- the scan -----------------------------------------------------------------------------------------------------

_PASSED = Passed()  # (SHA-256, nesting) of the pickles the scan passed


def check_pickle_bounds(pkl: bytes, nesting: int = MAX_TUPLE_NESTING) -> None:
    """Refuse (`PickleOutOfBounds`) a pickle whose unpickling alone would exhaust the process, before any unpickler
    runs: (1) a tuple nested more than `nesting` tuples deep: hashing a tuple (a dict key, a set member, as
    unpickling builds them) recurses in C with no recursion guard, so one nested ~10^5 deep (a few hundred KB of
    pickle) kills the interpreter with SIGSEGV; (2) a memo index past the pickle's size: C's unpickler sizes its
    memo array by the largest index, so 12 bytes (`LONG_BINPUT 10^8`) take 1.5 GB.

    The scan replays the unpickler's stack, marks and memo with each item's tuple depth only: a tuple's depth is
    fixed when it is built (tuples are immutable); a list, dict or set resets it (a list or dict is unhashable, a
    frozenset caches its hash); a call (REDUCE, NEWOBJ, ...) is given the deepest of its inputs. Malformed
    opcodes, stack underflow and a missing memo entry are `pickle.UnpicklingError`, as the unpickler would say.
    Linear in the pickle's size: about 0.25 s a million opcodes. A pickle passed once is not scanned again in this
    process (by its SHA-256): a checkpoint's chunks of one shape carry the same pickle byte for byte, and a run
    reads the same `.metadata` more than once."""
    _PASSED.once((hashlib.sha256(pkl).digest(), nesting), lambda: _scan_bounds(pkl, nesting))


class _Replay:
    """The unpickler's stack (each item's tuple depth), its marks and memo, as the scan replays them."""

    def __init__(self, pkl: bytes, nesting: int) -> None:
        self.pkl, self.nesting = pkl, nesting
        self.stack: list[int] = []
        self.marks: list[int] = []  # the stack's height at each open MARK
        self.memo: dict[Any, int] = {}
        self.fence = 0  # the innermost mark's height: nothing below it may be popped until it is closed
        self.most = 2 * len(pkl) + _MEMO_SLACK
        self.text: io.BytesIO | None = None


def _scan_bounds(pkl: bytes, nesting: int) -> None:
    """`check_pickle_bounds`' scan: the frequent opcodes inline (a value pushed, the memo's, MARK, an opcode that
    pops k items and pushes one), the others by `_step`."""
    r = _Replay(pkl, nesting)
    stack, memo, marks = r.stack, r.memo, r.marks
    push, size, pos, fence = stack.append, len(pkl), 0, 0
    pushes, folds, into_container = _PUSHES, _FOLDS, _INTO_CONTAINER  # locals: the loop's lookups are the cost
    memoize, binget, long_binget, mark, empty_tuple = _MEMOIZE_CODE, _BINGET, _LONG_BINGET, _MARK_CODE, _EMPTY_TUPLE
    try:
        while pos < size:
            code = pkl[pos]
            skip = pushes[code]
            if skip:
                if pos + skip > size:
                    raise pickle.UnpicklingError(f"at position {pos}: the argument runs past the end")
                push(0)
                pos += skip
            elif code == memoize:
                if len(stack) <= fence:
                    raise pickle.UnpicklingError("memo put of an empty stack")
                memo[len(memo)] = stack[-1]  # an index under the count of opcodes: within bounds
                pos += 1
            elif code == binget or code == long_binget:
                end = pos + (2 if code == binget else 5)
                if end > size:
                    raise pickle.UnpicklingError(f"at position {pos}: the argument runs past the end")
                key = int.from_bytes(pkl[pos + 1:end], "little")
                if key not in memo:
                    raise pickle.UnpicklingError(f"memo key {key} is missing")
                push(memo[key])
                pos = end
            elif code == mark:
                fence = len(stack)
                marks.append(fence)
                pos += 1
            elif code in into_container:  # SETITEMS, APPENDS, ADDITEMS: the items above the mark go into the
                if not marks:  # container below it, whose depth stays
                    raise pickle.UnpicklingError("could not find MARK")
                del stack[marks.pop():]
                fence = marks[-1] if marks else 0
                if len(stack) - 1 < fence:
                    raise pickle.UnpicklingError("unpickling stack underflow")
                pos += 1
            elif code == empty_tuple:
                if nesting < 1:
                    raise PickleOutOfBounds(f"nests tuples more than {nesting} deep (at byte {pos})")
                push(1)
                pos += 1
            elif (fold := folds[code]) is not None:  # k items popped, one pushed: a call, a BUILD, a small tuple
                action, k = fold
                if len(stack) - k < fence:
                    raise pickle.UnpicklingError("unpickling stack underflow")
                depth = stack[-k] if action == SAME else max(stack[-k:])
                if action == TUPLE:
                    depth += 1
                    if depth > nesting:
                        raise PickleOutOfBounds(f"nests tuples more than {nesting} deep (at byte {pos})")
                del stack[-k:]
                push(depth)
                pos += 1
            else:
                r.fence = fence
                at, pos = pos, _step(r, pos)
                fence = r.fence
                if code == _STOP:
                    return
                assert pos > at
    except (ValueError, IndexError, KeyError) as exc:  # an argument that does not parse, an empty stack popped
        raise pickle.UnpicklingError(str(exc) or type(exc).__name__) from None
    raise pickle.UnpicklingError("pickle exhausted before seeing STOP")


def _step(r: _Replay, pos: int) -> int:
    """Any opcode at `pos`, replayed; where the next one starts."""
    step = _STEPS[r.pkl[pos]]
    if step is None:
        raise pickle.UnpicklingError(f"at position {pos}, opcode {r.pkl[pos:pos + 1]!r} unknown")
    action, marked, below, pushed, layout, n, signed, reader = step
    arg, end = _argument(r, pos, layout, n, signed, reader)
    if action == PUT or action == MEMOIZE:
        if len(r.stack) <= r.fence:
            raise pickle.UnpicklingError("memo put of an empty stack")
        index = arg if action == PUT and isinstance(arg, int) else len(r.memo)
        if not 0 <= index < r.most:
            raise PickleOutOfBounds(f"puts memo entry {index:,} (at byte {pos}), past the {r.most:,} a "
                                    f"pickle of {len(r.pkl):,} bytes may use")
        r.memo[index] = r.stack[-1]
    elif action == GET:
        if arg not in r.memo:
            raise pickle.UnpicklingError(f"memo key {arg} is missing")
        r.stack.append(r.memo[arg])
    elif action == MARK:
        r.fence = len(r.stack)
        r.marks.append(r.fence)
    elif action == POP and r.marks and r.fence == len(r.stack):
        r.marks.pop()
        r.fence = r.marks[-1] if r.marks else 0
    else:
        _replay(r, pos, action, marked, below, pushed)
    return end


def _replay(r: _Replay, pos: int, action: int, marked: bool, below: int, pushed: int) -> None:
    """An opcode's pops (to its mark, then `below` items) and its push, with the depth its action gives."""
    stack, inputs = r.stack, []
    if marked:
        if not r.marks:
            raise pickle.UnpicklingError("could not find MARK")
        inputs = stack[r.marks[-1]:]
        del stack[r.marks.pop():]
        r.fence = r.marks[-1] if r.marks else 0
    if below:
        if len(stack) - below < r.fence:
            raise pickle.UnpicklingError("unpickling stack underflow")
        inputs = stack[-below:] + inputs  # in stack order: a container below its mark comes first
        del stack[-below:]
    if action == TUPLE:
        depth = 1 + max(inputs, default=0)
        if depth > r.nesting:
            raise PickleOutOfBounds(f"nests tuples more than {r.nesting} deep (at byte {pos})")
        stack.append(depth)
    elif action == SAME or action == CALL:
        stack.append(inputs[0] if action == SAME else max(inputs, default=0))
    elif action == DUP:
        stack += inputs * 2
    elif pushed:
        stack.append(0)


def _argument(r: _Replay, pos: int, layout: int, n: int, signed: bool, reader: Any) -> tuple[Any, int]:
    """The argument of the opcode at `pos` as the scan needs it (a memo index, a text opcode's value, else None),
    and where it ends; one that does not parse is refused as `pickletools.genops` refuses it."""
    pkl, start = r.pkl, pos + 1
    if layout == _FIXED:
        end = start + n
        if end > len(pkl):
            raise pickle.UnpicklingError(f"at position {pos}: the argument runs past the end")
        return (int.from_bytes(pkl[start:end], "little") if pkl[pos] in _INDEXED else None), end
    if layout == _COUNTED:
        if start + n > len(pkl):
            raise pickle.UnpicklingError(f"at position {pos}: the argument's count runs past the end")
        count = int.from_bytes(pkl[start:start + n], "little", signed=signed)
        end = start + n + count
        if count < 0 or end > len(pkl):
            raise pickle.UnpicklingError(f"at position {pos}: {count} bytes counted, {len(pkl) - start - n} left")
        if pkl[pos] in _UTF8:
            pkl[start + n:end].decode("utf-8", "surrogatepass")  # UnicodeDecodeError: a ValueError
        return None, end
    r.text = r.text or io.BytesIO(pkl)
    r.text.seek(start)
    return reader(r.text), r.text.tell()

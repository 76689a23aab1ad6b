"""How much of a divergence each differing train switch explains, measured: Shapley shares over the switches.

At the first divergent sub-block parity reruns that one sub-block on its serve-side input, on the fp32 torch
references, with every subset of the differing switches set to the train side's values (the rest to serve's).
v(A) is the train-vs-serve rel err with subset A on; a switch's share is its Shapley value, so the shares add up
to v(all) - v(none) exactly, and v(none) is what the weights (and the run's numerics) leave: `rest`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import combinations
from typing import Any

Evaluate = Callable[[frozenset[str]], float]
MAX_SWITCHES = 6  # 64 reruns of one sub-block; there are six switches in all


def shapley(switches: list[str], evaluate: Evaluate) -> dict[str, Any]:
    """Each switch's share of v(all) - v(none), plus v(all) (`total`) and v(none) (`rest`)."""
    n = len(switches)
    if n > MAX_SWITCHES:
        raise ValueError(f"{n} switches: at most {MAX_SWITCHES} are attributed")
    values = {frozenset(a): evaluate(frozenset(a)) for k in range(n + 1) for a in combinations(switches, k)}
    shares = {}
    for s in switches:
        others = [x for x in switches if x != s]
        total = 0.0
        for k in range(n):
            weight = math.factorial(k) * math.factorial(n - k - 1) / math.factorial(n)
            total += sum(weight * (values[frozenset(a) | {s}] - values[frozenset(a)]) for a in combinations(others, k))
        shares[s] = total
    return {"shares": shares, "total": values[frozenset(switches)], "rest": values[frozenset()]}


def attribution_line(att: dict[str, Any]) -> str:
    """`proj_rms=megatron 0.061 (95%), hc_mix=bf16 0.0031 (5%)` of a total, in the report's words."""
    total = att["total"]
    parts = [f"{s} {v:.3g} ({_pct(v, total)})" for s, v in sorted(att["shares"].items(), key=lambda kv: -kv[1])]
    if att["rest"] > 0:
        parts.append(f"weights and numerics {att['rest']:.3g} ({_pct(att['rest'], total)})")
    return (f"measured attribution at layer {att['layer']} {att['sub_block']} (rel err {total:.3g} on the fp32 "
            f"references): " + ", ".join(parts))


def _pct(v: float, total: float) -> str:
    return f"{100 * v / total:.0f}%" if total > 0 else "-"

"""Where a command's threads spend their time: the glmconv CLI run in this process under yappi (every thread), then
each thread's totals and busiest functions. For the GPU export's readers, which read at half the page cache's rate
inside an export (benchmarks/RESULTS.md, issue 38): the wall clock shows their waits, the CPU clock their work.

Usage: python benchmarks/export_profile.py OUT.txt [wall|cpu] -- export SRC OUT --like LIKE --fp8 --device cuda --json
(yappi: `pip install yappi`; on the GPU machine it comes with .whl-z3, scripts/stage-wheels.sh)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

TOP = 25  # functions listed a thread


def main() -> None:
    split = sys.argv.index("--")
    out, clock = Path(sys.argv[1]), (sys.argv[2:split] or ["wall"])[0]
    import yappi

    yappi.set_clock_type(clock)
    yappi.start(builtins=False, profile_threads=True)
    sys.argv = ["glmconv", *sys.argv[split + 1:]]
    from glmconv_cli.main import main as cli

    code: Any = 0
    try:
        cli()
    except SystemExit as done:  # the CLI's end: its own exit handler then leaves without the teardown
        code = done.code
    yappi.stop()
    out.write_text(report(yappi, clock))
    sys.exit(code)


def report(yappi: Any, clock: str) -> str:
    """Each thread: its total, then its functions by time spent in them (tsub) and under them (ttot)."""
    lines = [f"clock: {clock}"]
    for thread in sorted(yappi.get_thread_stats(), key=lambda t: -t.ttot):
        stats = yappi.get_func_stats(filter={"ctx_id": thread.id})
        lines += ["", f"== thread {thread.name} (id {thread.id}): {thread.ttot:.3f} s, {thread.sched_count} switches",
                  f"{'tsub':>8} {'ttot':>8} {'calls':>8}  function"]
        for f in sorted(stats, key=lambda f: -f.tsub)[:TOP]:
            lines.append(f"{f.tsub:8.3f} {f.ttot:8.3f} {f.ncall:8d}  {f.module}:{f.lineno} {f.name}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

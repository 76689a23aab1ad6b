"""Run glmconv commands in this process under an address-space limit: `python tests/helpers/bounded_cli.py RUNS.json`.

RUNS.json: {"address_space": bytes, "runs": [{"case": name, "command": name, "args": [...]}]}. Each run goes
through the in-process CLI runner, as the tests' own runs do. Before a run a line `{"start": case, "args": args}`
is printed and flushed, so that a parent that kills this process on a timeout (or sees it die) knows which run it
was; after it, one line with its exit code, seconds, this process's peak RSS so far, stdout and stderr. A run past
the address-space limit fails as Python's MemoryError does (exit 3), never as the host's OOM killer.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    limit = int(spec["address_space"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    from click.testing import CliRunner

    from glmconv_cli.main import cli

    for run in spec["runs"]:
        print(json.dumps({"start": run["case"], "args": run["args"]}), flush=True)
        start = time.monotonic()
        res = CliRunner().invoke(cli, run["args"])
        seconds = time.monotonic() - start
        rss_kb = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        print(json.dumps({"case": run["case"], "command": run.get("command"), "args": run["args"],
                          "code": res.exit_code, "seconds": seconds,
                          "rss_mb": rss_kb // 1024, "stdout": res.stdout, "stderr": res.stderr,
                          "exception": None if res.exception is None or isinstance(res.exception, SystemExit)
                          else repr(res.exception)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

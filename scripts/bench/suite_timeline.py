"""Where the test suite's wall time goes: runs pytest (by default the README's test command), logs when each test
starts and ends on which worker, measures how busy the CPUs were, and prints each test file's span per worker.

    python scripts/bench/suite_timeline.py                    # the README's command, the whole suite
    python scripts/bench/suite_timeline.py -- tests/test_e2e.py -n 2 --dist loadfile

docs/testing.md's per-file table ("The suite on two cores") was measured this way, with the same plugin outside the
repository, before this script held it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

README_COMMAND = ["-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]
LOG = "SUITE_TIMELINE_LOG"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Plugin side (loaded in pytest and its workers with ``-p suite_timeline``): one line per test."""
    start = time.time()
    yield
    with open(os.environ[LOG], "a") as log:
        log.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": item.nodeid,
                              "start": start, "end": time.time()}) + "\n")  # fmt: skip


def cpu_busy_and_total() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the README's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "timeline.jsonl"
        path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, LOG: str(log), "PYTHONPATH": path}
        busy0, total0 = cpu_busy_and_total()
        started = time.time()
        code = subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_timeline",
                                *(args.pytest_args or README_COMMAND)], env=env)  # fmt: skip
        wall = time.time() - started
        busy1, total1 = cpu_busy_and_total()
        tests = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    spans: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [float("inf"), 0.0, 0.0])
    for test in tests:
        span = spans[(test["test"].split("::")[0], test["worker"])]
        span[0], span[1] = min(span[0], test["start"]), max(span[1], test["end"])
        span[2] += test["end"] - test["start"]
    busy = (busy1 - busy0) / (total1 - total0)
    print(f"pytest exit {code}: {wall:.0f} s wall, {len(tests)} tests, CPUs {busy:.0%} busy")
    print(f"{'worker':>6} {'from s':>7} {'to s':>7} {'tests s':>8}  file")
    for (file, worker), (first, last, in_tests) in sorted(spans.items(), key=lambda item: item[1][0]):
        if in_tests >= 10:
            print(f"{worker:>6} {first - started:7.0f} {last - started:7.0f} {in_tests:8.0f}  {file}")
    for worker in sorted({w for _, w in spans}):
        print(f"worker {worker} ends at {max(s[1] for (_, w), s in spans.items() if w == worker) - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())

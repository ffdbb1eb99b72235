"""Seconds until the command line answers: ``lit-gmc --help``, ``export --help``, ``fit --help`` and a typo's error.

Each command runs as a fresh ``python -m lit_gmc`` process (what the console script runs), alternating with
``python -c "import lightning"``, the floor ``fit`` cannot go below, so that both see the same load. Prints the
median and the range of ``--repeats`` runs each, and for ``fit`` the excess over ``import lightning``::

    python scripts/bench/bench_startup.py [--repeats 5]

The targets (issue 35): ``--help`` and ``export --help`` at most 1 s; ``fit --help`` and an argument error at most
1 s more than ``import lightning``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

FLOOR = ("import lightning", ["-c", "import lightning"])
COMMANDS = (
    ("lit-gmc --help", ["-m", "lit_gmc", "--help"]),
    ("lit-gmc export --help", ["-m", "lit_gmc", "export", "--help"]),
    ("lit-gmc fit --help", ["-m", "lit_gmc", "fit", "--help"]),
    ("lit-gmc fit --trainer.max_step 7 (typo)", ["-m", "lit_gmc", "fit", "--trainer.max_step", "7"]),
)


def seconds(args: list[str]) -> float:
    """Wall-clock seconds of ``python args`` to its exit, its output discarded.

    Run in an empty folder: where abbreviations are taken (before issue 35), the typo starts a run, which writes
    ``runs/`` into the working folder.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                       cwd=folder, env=env, timeout=600)  # fmt: skip
        return time.perf_counter() - start


def shown(times: list[float]) -> str:
    """``median s (min-max)``."""
    return f"{statistics.median(times):6.2f} s ({min(times):.2f}-{max(times):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command")
    args = parser.parse_args()
    floor: list[float] = []
    times: dict[str, list[float]] = {name: [] for name, _ in COMMANDS}
    excess: dict[str, list[float]] = {name: [] for name, _ in COMMANDS}
    for _ in range(args.repeats):
        for name, command in COMMANDS:
            floor.append(seconds(FLOOR[1]))  # beside each command, so both see the same load
            times[name].append(seconds(command))
            excess[name].append(times[name][-1] - floor[-1])
    print(f"{args.repeats} runs each, median (range)")
    print(f"{FLOOR[0]:42s} {shown(floor)}")
    for name, _ in COMMANDS:
        print(f"{name:42s} {shown(times[name])}   minus import lightning beside it: {shown(excess[name])}")


if __name__ == "__main__":
    main()

"""Time ``lit-gmc estimate`` on the embedded default, as a user runs it: the whole grid from a fresh folder.

    python scripts/bench/bench_lab.py                  # the default grid (trains theta_tau first), prints the table
    python scripts/bench/bench_lab.py -- --delays 0 8  # any lit-gmc estimate options after --

One process, as the command line starts it (bytecode written, as after an install); prints its wall time, CPU time,
peak memory and the phases the lab records in ``lab.json`` (training the policies, choosing the prompts, each delay).
The tiny actor's warm start is cached as usual (``LIT_GMC_CACHE``); the policies are trained anew.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="keep the results here (default: a temporary folder)")
    parser.add_argument("options", nargs="*", help="lit-gmc estimate options (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.out or scratch) / "lab"
        env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        command = [sys.executable, "-m", "lit_gmc", "estimate", "--out", str(out), *args.options]
        started = time.time()
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        wall = time.time() - started
        if done.returncode != 0:
            sys.exit(f"lit-gmc estimate failed ({done.returncode}):\n{done.stderr[-3000:]}")
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        meta = json.loads((out / "lab.json").read_text())["meta"]
        cells = len(json.loads((out / "lab.json").read_text())["cells"])
    print(f"lit-gmc estimate {' '.join(args.options) or '(defaults)'}: {cells} measurements")
    print(f"wall {wall:.1f} s | CPU {usage.ru_utime + usage.ru_stime:.1f} s | peak memory "
          f"{usage.ru_maxrss / 2**20:.2f} GiB | {os.cpu_count()} CPUs")  # fmt: skip
    print("| phase | s |\n|---|---|")
    for phase, seconds in meta["phases"].items():
        print(f"| {phase} | {seconds} |")


if __name__ == "__main__":
    main()

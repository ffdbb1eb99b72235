"""CPU time per update of every thread of a tiny ``fit``: what runs beside the training loop, and what it costs.

Runs ``fit`` in this process on the embedded default with ``--data.schedule Sync`` and one torch thread (as
``configs/tiny.yaml``), and reads each thread's CPU time from ``/proc/self/task`` (Linux) at update ``--warmup`` and
at the end. Process CPU time counts every thread: a progress bar's refresh thread or a tokenizer's worker pool is
part of an update's cost even when it runs on the other core. ``--fit-args`` adds ``fit`` options, e.g. the bar's
refresh rate::

    python scripts/bench/bench_threads.py [--steps 200] [--warmup 10] [--fit-args "..."]
    python scripts/bench/bench_threads.py --fit-args \
        "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar --trainer.callbacks.refresh_rate=100"
    script -qc "python scripts/bench/bench_threads.py" /dev/null   # with a terminal, where the bar is drawn
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import threading
import time

import lightning.pytorch as pl

from lit_gmc.cli import GMCCLI


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # the name, in brackets, may hold spaces
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return seconds


class ThreadClock(pl.Callback):
    """Reads every thread's CPU time at update ``warmup`` and when training ends; prints ms per update."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: dict[int, float] = {}
        self.process_start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step == self.warmup:
            self.start, self.process_start = thread_cpu_seconds(), time.process_time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        updates = trainer.global_step - self.warmup
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        lines = [f"{updates} updates: process {(time.process_time() - self.process_start) / updates * 1e3:.3f} "
                 "CPU ms per update; by thread:"]  # fmt: skip
        for tid, seconds in sorted(thread_cpu_seconds().items()):
            used = seconds - self.start.get(tid, 0.0)
            name = names.get(tid, "(not a Python thread: torch, tokenizers, ...)")
            lines.append(f"  {tid:>8} {name:<48} {used / updates * 1e3:8.3f} ms")
        print("\n".join(lines), file=sys.__stdout__, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--fit-args", default="", help="more fit options, one shell-quoted string")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        fit = ["fit", "--data.schedule", "Sync", "--torch_num_threads", "1",
               "--trainer.max_steps", str(args.steps), "--trainer.logger.init_args.save_dir", workdir,
               "--trainer.default_root_dir", workdir, *shlex.split(args.fit_args)]  # fmt: skip
        GMCCLI(args=fit, trainer_defaults={"callbacks": [ThreadClock(args.warmup)]})


if __name__ == "__main__":
    main()

"""Data-parallel scaling benchmark: updates/s and response tokens/s of ``lit_gmc fit`` on 1 vs N learner processes.

Each run is a real ``python -m lit_gmc fit`` in a subprocess (so DDP and FSDP2 launch their processes exactly as
from the shell), logging to a temporary folder. The figures come from the run's own TensorBoard records: the
wall time of the events that rank 0 writes at the end of each update, from the end of update ``warmup - 1`` to
the end of the last one, so start-up (imports, model load, process-group set-up) is left out. Tokens are the
response tokens trained in those updates: ``diag/response_length/mean`` (the Diagnostics callback) times the
rows per update (``data.batch_prompts * data.group_size`` from the run's saved ``config.yaml``).

What N processes parallelise: the learner's forward and backward (each rank trains B/N whole groups). Rollouts
are not parallelised: global rank 0 generates every group with the one engine, as a single process would, and
scatters them; the other ranks wait meanwhile. With the tiny model on CPU, generation is a large part of a step,
so the ratio measures that whole loop, not the learner alone.

    python scripts/bench/bench_scaling.py                             # tiny, CPU: 1 process, then ddp and fsdp2 on 2
    python scripts/bench/bench_scaling.py --steps 12 --devices 1 2 --strategies ddp
    python scripts/bench/bench_scaling.py --accelerator gpu --devices 1 2 4 -- --trainer.precision bf16-mixed
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[2]
STEP_TAG = "train/reward"  # logged by rank 0 at the end of every update
LENGTH_TAG = "diag/response_length/mean"


@dataclass(frozen=True)
class Result:
    """One run's figures over its measured updates."""

    label: str
    processes: int
    updates: int
    seconds: float
    tokens: float
    total_seconds: float  # the subprocess, start-up included

    @property
    def updates_per_s(self) -> float:
        return self.updates / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def fit_command(args: argparse.Namespace, devices: int, strategy: str | None, save_dir: Path) -> list[str]:
    """The ``lit_gmc fit`` command line of one run (checkpoints off: they are not part of a step)."""
    command = [sys.executable, "-m", "lit_gmc", "fit"]
    for config in args.config:
        command += ["--config", config]
    command += [
        "--trainer.max_steps", str(args.steps), "--trainer.accelerator", args.accelerator,
        "--trainer.devices", str(devices), "--trainer.num_nodes", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(save_dir),
        "--checkpoint.every_n_train_steps", "0", "--checkpoint.save_last", "false", "--checkpoint.save_top_k", "0",
        "--data.batch_prompts", str(args.batch_prompts), "--data.group_size", str(args.group_size),
    ]  # fmt: skip
    if args.threads is not None:
        command += ["--torch_num_threads", str(args.threads)]
    if strategy is not None:
        command += ["--trainer.strategy", strategy]
    return command + args.extra


def events(save_dir: Path, tag: str) -> list:
    """Every event of ``tag`` under ``save_dir`` (one run: one event file), in step order."""
    files = sorted(save_dir.rglob("events.out.tfevents.*"))
    if len(files) != 1:
        raise RuntimeError(f"expected one event file under {save_dir}, found {len(files)}")
    acc = EventAccumulator(str(files[0]), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        raise RuntimeError(f"{save_dir} has no {tag!r} scalars (is the Diagnostics callback in the config?)")
    return sorted(acc.Scalars(tag), key=lambda e: e.step)


def rows_per_update(save_dir: Path) -> int:
    """``batch_prompts * group_size`` from the config the run saved beside its events."""
    (path,) = save_dir.rglob("config.yaml")
    data = yaml.safe_load(path.read_text())["data"]
    return int(data["batch_prompts"]) * int(data["group_size"])


def measure(label: str, processes: int, save_dir: Path, warmup: int, total_seconds: float) -> Result:
    """Figures over the updates after the first ``warmup`` (timed from the end of update ``warmup - 1``)."""
    ends = events(save_dir, STEP_TAG)
    lengths = {e.step: e.value for e in events(save_dir, LENGTH_TAG)}
    if len(ends) <= warmup:
        raise RuntimeError(f"{label}: {len(ends)} updates logged, need more than --warmup {warmup}")
    start, kept = ends[warmup - 1], ends[warmup:]
    rows = rows_per_update(save_dir)
    tokens = sum(lengths[e.step] * rows for e in kept)
    return Result(label, processes, len(kept), kept[-1].wall_time - start.wall_time, tokens, total_seconds)


def run(args: argparse.Namespace, devices: int, strategy: str | None, root: Path) -> Result:
    """One ``lit_gmc fit`` subprocess, then its figures; stops the benchmark with the run's stderr on failure."""
    label = f"{devices} x {strategy or 'single'}"
    save_dir = root / f"{strategy or 'single'}_{devices}"
    command = fit_command(args, devices, strategy, save_dir)
    print(f"running {label}: {' '.join(command[1:])}", flush=True)
    began = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    total = time.monotonic() - began
    if done.returncode != 0:
        sys.exit(f"{label} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return measure(label, devices, save_dir, args.warmup, total)


def table(results: list[Result]) -> str:
    """A Markdown table, each run against the single-process one."""
    base = next((r for r in results if r.processes == 1), None)
    lines = [
        "| run | processes | updates timed | seconds | updates/s | response tokens/s | ratio vs 1 process "
        "| whole run, s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = f"{r.updates_per_s / base.updates_per_s:.2f}" if base else "-"
        lines.append(f"| {r.label} | {r.processes} | {r.updates} | {r.seconds:.1f} | {r.updates_per_s:.3f} | "
                     f"{r.tokens_per_s:.0f} | {ratio} | {r.total_seconds:.0f} |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", default=["configs/tiny.yaml"], help="config files, in order")
    parser.add_argument("--steps", type=int, default=40, help="updates per run (--trainer.max_steps)")
    parser.add_argument("--warmup", type=int, default=2, help="first updates left out of the timing (>= 1)")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="processes per run (1: no strategy)")
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp2"], help="for the runs with devices > 1")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="--torch_num_threads per process (0: config's)")
    parser.add_argument("--batch-prompts", type=int, default=8, help="B (divisible by every --devices)")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("extra", nargs="*", help="after --: more lit_gmc fit arguments, passed to every run")
    args = parser.parse_args(argv)
    problems = [f"--batch-prompts {args.batch_prompts} is not divisible by --devices {d}"
                for d in args.devices if args.batch_prompts % d]  # fmt: skip
    if args.warmup < 1 or args.steps <= args.warmup + 1:
        problems.append(f"need 1 <= --warmup ({args.warmup}) < --steps - 1 ({args.steps - 1})")
    if problems:
        parser.error("; ".join(problems))
    args.threads = args.threads or None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"{' + '.join(args.config)}, B={args.batch_prompts} x G={args.group_size}, {args.steps} updates per run "
          f"(first {args.warmup} not timed), accelerator {args.accelerator}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPU cores, torch threads per process: {args.threads or 'config'}", flush=True)  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        for devices in args.devices:
            for strategy in [None] if devices == 1 else args.strategies:
                results.append(run(args, devices, strategy, Path(tmp)))
    print()
    print(table(results))


if __name__ == "__main__":
    main()

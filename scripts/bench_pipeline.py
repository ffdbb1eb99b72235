"""Pipeline benchmark: optimizer steps per second of ``Sync`` vs ``Live`` on the tiny model.

``Sync`` (K = 1) generates a batch, then learns on it: a step costs generation + learning. ``Live`` runs a rollout
worker thread beside the learner, so a step costs about max(generation, learning). The overlap ratio
live/sync is therefore at most 2, reached when the two costs are equal; the script first balances them, without
changing what is computed, by how the work is split: rows per ``generate`` call (``--data.engine.batch_rows
n``: fewer rows, more calls, slower generation) or groups per forward/backward pass
(``--model.micro_batch_groups``: fewer groups, more passes, slower learning). It then measures both schedules
with the most balanced split.

Each thread gets one core for its torch ops (``torch.set_num_threads(1)`` by default), standing in for the
paper's separate generation and learning devices; ``sync`` then uses one core, ``live`` two.

    python scripts/bench_pipeline.py [--steps 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import lightning.pytorch as pl
import torch

from lit_gmc.callbacks.weight_sync import WeightSync
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.data.engines import HFEngine
from lit_gmc.data.live import Live
from lit_gmc.data.schedules import Sync
from lit_gmc.data.tasks import Addition
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


def run(schedule: str, steps: int, skip: int, split: tuple[int, int], seed: int) -> dict[str, float]:
    """Train ``steps`` updates; figures over the steps after the first ``skip`` (start-up excluded)."""
    pl.seed_everything(seed, verbose=False)
    groups, rows = split
    chosen = Sync() if schedule == "sync" else Live()
    data = RolloutDataModule(Addition(), HFEngine(batch_rows=rows), chosen, total_updates=steps, seed=seed)
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
    return {"steps_per_s": 1.0 / period, "period_s": period, "learn_s": learn_s, "other_s": period - learn_s}


def balance(steps: int, skip: int, seed: int) -> tuple[tuple[int, int], dict[str, float]]:
    """The split whose learning time in ``sync`` is closest to the rest of the step (generation, mostly)."""
    best = None
    for split in SPLITS:
        figures = run("sync", steps, skip, split, seed)
        gap = abs(figures["learn_s"] - figures["other_s"]) / figures["period_s"]
        print(f"  micro_batch_groups={split[0]}, batch_rows={split[1]:3d}: learn {figures['learn_s']:.3f} s, "
              f"generate+rest {figures['other_s']:.3f} s per step")  # fmt: skip
        if best is None or gap < best[0]:
            best = (gap, split, figures)
    return best[1], best[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="updates per measured run")
    parser.add_argument("--skip", type=int, default=5, help="first updates left out of the figures (start-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (per thread of ours)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    print(f"tiny model, B=8 x G=8, {args.steps} updates per run, {args.threads} torch thread(s) per thread")
    print("balancing generation and learning (sync, K=1):")
    split, _ = balance(max(12, args.skip + 6), args.skip, args.seed)
    print(f"chosen micro_batch_groups={split[0]}, batch_rows={split[1]}")
    sync = run("sync", args.steps, args.skip, split, args.seed)
    live = run("live", args.steps, args.skip, split, args.seed)
    for name, figures in (("sync", sync), ("live", live)):
        print(f"{name:5s} {figures['steps_per_s']:6.2f} steps/s  ({figures['period_s']:.3f} s per step, "
              f"learn {figures['learn_s']:.3f} s)")  # fmt: skip
    print(f"overlap ratio live/sync: {live['steps_per_s'] / sync['steps_per_s']:.2f} (ideal for balanced costs: 2)")


if __name__ == "__main__":
    main()

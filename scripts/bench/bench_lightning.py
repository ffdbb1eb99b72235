"""Lightning's own cost per update: a ``fit`` whose training step does nothing but an optimizer step on 6 numbers.

What is left of an update when the work is taken out: Lightning's loop (fetch, hooks, progress tracking), the
progress bar (Lightning's ``TQDMProgressBar``) and a ``ModelCheckpoint``, with a ``RolloutBatch`` of the tiny job's
shape as the batch and a dict of 21 small tensors as the step's output (as ``GMCModule`` returns its statistics),
plus ``--extra-callbacks`` callbacks that do nothing: each one is dispatched on every hook of every update, which is
what a callback costs before it does any work. The counts alternate over ``--repeats`` fits; prints, for each
count, the median over fits of each fit's median process CPU us per update.

    python scripts/bench/bench_lightning.py [--steps 2000] [--repeats 7] [--extra-callbacks 0 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from torch.utils.data import DataLoader, IterableDataset

from lit_gmc.batch import RolloutBatch, RolloutGroup, collate_groups

B, G, T = 8, 8, 6  # configs/tiny.yaml


def tiny_batch() -> RolloutBatch:
    """A collated batch of the tiny job's shape (B groups of G responses of T tokens)."""
    gen = torch.Generator().manual_seed(0)
    groups = [
        RolloutGroup(
            prompt_id=b,
            prompt="1+2=",
            answer="3",
            prompt_ids=torch.tensor([5, 6, 7, 8]),
            response_ids=torch.randint(3, 30, (G, T), generator=gen),
            response_mask=torch.ones(G, T, dtype=torch.bool),
            behavior_logprobs=-torch.rand(G, T, generator=gen),
            finish_reasons=["length"] * G,
            rewards=torch.zeros(G),
            version=0,
        )  # fmt: skip
        for b in range(B)
    ]
    return collate_groups(groups, pad_id=0, info={"queue_depth": 0})


class Repeat(IterableDataset):
    """The same batch forever."""

    def __init__(self, batch: RolloutBatch) -> None:
        self.batch = batch

    def __iter__(self):
        while True:
            yield self.batch


class Idle(pl.LightningModule):
    """Manual optimization, one SGD step on a 2x2 layer per update; records the CPU clock at each step."""

    def __init__(self, batch: RolloutBatch) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.automatic_optimization = False
        self.batch = batch
        self.clock: list[float] = []

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> dict[str, torch.Tensor]:
        self.clock.append(time.process_time())
        self.optimizers().step()
        return {"loss": torch.zeros(()), **{f"stat{k}": torch.zeros(B * G) for k in range(20)}}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Repeat(self.batch), batch_size=None)


def us_per_update(steps: int, extra_callbacks: int) -> float:
    """Median process CPU microseconds between consecutive training steps, after 100 updates of warm-up."""
    module = Idle(tiny_batch())
    with tempfile.TemporaryDirectory() as folder:
        callbacks = [ModelCheckpoint(dirpath=folder, every_n_train_steps=steps), TQDMProgressBar()]
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", logger=False, enable_model_summary=False, log_every_n_steps=1,
            callbacks=callbacks + [pl.Callback() for _ in range(extra_callbacks)],
        )  # fmt: skip
        trainer.fit(module)
    gaps = [b - a for a, b in zip(module.clock[100:], module.clock[101:], strict=False)]
    return statistics.median(gaps) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--extra-callbacks", type=int, nargs="+", default=[0, 5])
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures: dict[int, list[float]] = {count: [] for count in args.extra_callbacks}
    for _ in range(args.repeats):
        for count in figures:
            figures[count].append(us_per_update(args.steps, count))
    for count, fits in figures.items():
        each = ", ".join(f"{us:.0f}" for us in fits)
        print(f"ModelCheckpoint, progress bar and {count} callbacks that do nothing: "
              f"{statistics.median(fits):.0f} CPU us per update (fits: {each})")  # fmt: skip


if __name__ == "__main__":
    main()

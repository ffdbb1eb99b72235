"""A TensorBoard logger whose step records survive ``kill -9``.

The learner and ``DelayAccounting`` hand a step's scalars to the loggers before that step's checkpoint is
written (in ``training_step`` and ``on_train_batch_end``; ``ModelCheckpoint`` runs after every other callback).
TensorBoard's writer would still hold them in memory for up to two minutes, so a run killed after the
checkpoint and resumed from it (the resumed run starts after that step) could lose them for good. Flushing
after every ``log_metrics`` call puts each record on disk before training goes on.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override


class DurableTensorBoardLogger(TensorBoardLogger):
    """``TensorBoardLogger`` that flushes its event file after every ``log_metrics`` call (same arguments)."""

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        self.experiment.flush()

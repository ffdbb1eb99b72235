"""A TensorBoard logger whose step records survive ``kill -9``.

Lightning writes a step's scalars to the logger right after the step's ``on_train_batch_end`` hooks, where
``ModelCheckpoint`` saves; TensorBoard's writer then holds them in memory for up to two minutes. A run killed
in that time and resumed from its last checkpoint would never log those steps again (the resumed run starts
after them), leaving holes in its curves. Flushing after every logged step closes the gap to the few
microseconds between the checkpoint write and the log call.
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

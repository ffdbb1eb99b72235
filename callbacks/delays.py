"""Delay accounting: the delay distribution of every update and the paper's averaged delay moments.

Reusable in any Lightning project whose ``training_step`` returns the per-trajectory delays ``tau = n - s``
of the batch it trained on (``outputs["delays"]``). Logs, per update:

* ``delay/histogram``: the delays of the batch's trajectories (TensorBoard histogram, when the logger has one);
* ``delay/tau_bar_2``, ``delay/tau_bar_4``: the running averaged moments ``(1/n) sum_k tau_k^p`` (eq. 11),
  which the convergence bound depends on; ``delay/running_mean``, the same average for ``p = 1``;
* ``delay/predicted_mean``: only when the batch's ``info`` carries ``delay_per_length`` (the virtual clock's
  ``lam / (c_gen + c_update)``): that factor times the running mean completion length ``E[L]``, the
  steady-state delay the clock predicts, to read next to ``delay/running_mean``.

(The per-update mean and max are logged by the learner itself as ``delay/mean`` and ``delay/max``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lit_gmc.delays import RunningDelayMoments


class DelayAccounting(pl.Callback):
    """Log each update's delay histogram and the running delay moments; checkpointable.

    Args:
        histogram_every_n_steps: Period of the delay histogram, in optimizer steps.
    """

    def __init__(self, histogram_every_n_steps: int = 1) -> None:
        if histogram_every_n_steps < 1:
            raise ValueError(f"histogram_every_n_steps must be >= 1, got {histogram_every_n_steps}")
        self.histogram_every_n_steps = histogram_every_n_steps
        self.moments = RunningDelayMoments()
        self.length_sum = 0.0  # completion tokens of the consumed trajectories (virtual clock only)
        self.length_count = 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(outputs, Mapping) or "delays" not in outputs:
            keys = sorted(outputs) if isinstance(outputs, Mapping) else None
            raise KeyError(
                "DelayAccounting needs training_step to return a dict with 'delays' (the (N,) delays of the batch's "
                f"trajectories); got {type(outputs).__name__} with keys {keys}"
            )
        delays = outputs["delays"].detach()  # (N,)
        self.moments.update(delays)
        scalars = {
            "delay/tau_bar_2": self.moments.tau2,
            "delay/tau_bar_4": self.moments.tau4,
            "delay/running_mean": self.moments.tau1,
        }
        per_length = getattr(batch, "info", {}).get("delay_per_length")
        if per_length is not None:
            lengths = outputs["response_lengths"].detach().double()  # (N,)
            self.length_sum += float(lengths.sum())
            self.length_count += lengths.numel()
            scalars["delay/predicted_mean"] = per_length * self.length_sum / self.length_count
        step = trainer.global_step - 1  # the update just taken
        # Straight to the loggers, at the update's index: on disk before this step's checkpoint is written (with a
        # write-through logger, lit_gmc.loggers.DurableTensorBoardLogger), so a run killed right after a checkpoint
        # still has this step's record.
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)
        if step % self.histogram_every_n_steps == 0:
            self._histogram(trainer, delays, step)

    @staticmethod
    def _histogram(trainer: pl.Trainer, delays: torch.Tensor, step: int) -> None:
        for logger in trainer.loggers:
            add_histogram = getattr(getattr(logger, "experiment", None), "add_histogram", None)
            if add_histogram is not None:
                add_histogram("delay/histogram", delays.float().flatten(), global_step=step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "moments": self.moments.state_dict(), "length_sum": self.length_sum, "length_count": self.length_count,
        }  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.moments.load_state_dict(state_dict["moments"])
        self.length_sum, self.length_count = state_dict["length_sum"], state_dict["length_count"]

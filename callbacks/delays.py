"""Delay accounting: the delay distribution of every update and the paper's averaged delay moments.

Reusable in any Lightning project whose ``training_step`` returns the batch's per-trajectory delays ``tau = n - s``
(``outputs["delays"]``). Logs once per optimizer update, at ``trainer.global_step - 1``, ``delay/tau_bar_2``,
``delay/tau_bar_4``, ``delay/running_mean`` (eq. 11), ``delay/predicted_mean`` (the virtual clock's steady state)
and ``delay/histogram``; the full contract is in ``docs/callbacks.md``.
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
        # Batches since the last optimizer step. Not checkpointed: Lightning saves no half-accumulated gradients
        # either, and its checkpoints are written after the step, when this is empty.
        self.pending: list[torch.Tensor] = []
        self.per_length: float | None = None
        self.step_at_batch_start: int | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.pending, self.per_length = [], None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.step_at_batch_start = trainer.global_step

    @staticmethod
    def batch_delays(outputs: Any) -> torch.Tensor:
        """The ``(N,)`` delays in ``training_step``'s outputs.

        Raises:
            KeyError: If the outputs are not a dict with ``delays``.
            TypeError: If ``delays`` is not a tensor.
        """
        if not isinstance(outputs, Mapping) or "delays" not in outputs:
            keys = sorted(outputs) if isinstance(outputs, Mapping) else None
            raise KeyError(
                "DelayAccounting needs training_step to return a dict with 'delays' (the (N,) delays of the batch's "
                f"trajectories); got {type(outputs).__name__} with keys {keys}"
            )
        if not isinstance(outputs["delays"], torch.Tensor):
            raise TypeError(f"DelayAccounting needs outputs['delays'] to be a tensor, got {type(outputs['delays'])}")
        return outputs["delays"].detach()  # (N,)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.pending.append(self.batch_delays(outputs))
        per_length = getattr(batch, "info", {}).get("delay_per_length")
        if per_length is not None:
            if "response_lengths" not in outputs:
                raise KeyError(
                    "DelayAccounting needs training_step to return 'response_lengths' (N,) when the batch's info "
                    f"has 'delay_per_length'; got keys {sorted(outputs)}"
                )
            lengths = outputs["response_lengths"].detach().double()  # (N,)
            self.length_sum += float(lengths.sum())
            self.length_count += lengths.numel()
            self.per_length = per_length
        if trainer.global_step == self.step_at_batch_start:
            return  # no optimizer step in this batch (gradient accumulation): the update goes on
        delays = self.pending[0] if len(self.pending) == 1 else torch.cat([d.flatten() for d in self.pending])  # (N,)
        self.pending = []
        self.moments.update(delays)
        scalars = {
            "delay/tau_bar_2": self.moments.tau2,
            "delay/tau_bar_4": self.moments.tau4,
            "delay/running_mean": self.moments.tau1,
        }
        if self.per_length is not None:
            scalars["delay/predicted_mean"] = self.per_length * self.length_sum / self.length_count
            self.per_length = None
        step = trainer.global_step - 1  # the update just taken
        # Straight to the loggers, at the update's index: the record is in them before the step's checkpoint flushes
        # them, so a run killed right after a checkpoint still has it.
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)
        if step % self.histogram_every_n_steps == 0:
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

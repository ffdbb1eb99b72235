"""Progress for logs: one plain line every few updates where a live bar cannot be drawn (a file, a pipe, SLURM, CI).

A Lightning ``ProgressBar``, so the trainer takes it as its progress bar and adds no other. It reads what the module
shows on the bar (``self.log(..., prog_bar=True)``): ``reward``, ``delay`` and ``queue`` when they are there.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar
from typing_extensions import override


def default_every(max_steps: int) -> int:
    """About 1% of the run, at least 1: a hundred lines for a whole run."""
    return max(1, max_steps // 100)


def duration(seconds: float) -> str:
    """``1h 02m``, ``3m 05s`` or ``42s``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def progress_line(step: int, total: int, means: dict[str, float], last: dict[str, float], rate: float) -> str:
    """``update 40/2000 (2%) | reward 0.231 | delay 8.0 | queue 7 | 1.52 updates/s | ETA 21m 29s``.

    ``means``: figures averaged over the window (reward, delay); ``last``: figures as they stand (queue depth).
    """
    parts = [f"update {step}/{total} ({100 * step // max(total, 1)}%)"]
    parts += [f"{name} {value:.3f}" if name == "reward" else f"{name} {value:.1f}" for name, value in means.items()]
    parts += [f"{name} {value:g}" for name, value in last.items()]
    if rate > 0:
        parts += [f"{rate:.2f} updates/s", f"ETA {duration((total - step) / rate)}"]
    return " | ".join(parts)


class ProgressLines(ProgressBar):
    """Prints one line every ``every_n_updates`` optimizer updates, and at the last, to ``stream`` (stdout).

    Reward, delay and the rate behind the time left are averaged since the previous line. Global rank 0 only.

    Args:
        every_n_updates: Updates between lines; ``None``: about 1% of ``max_steps`` (at least 1).
        stream: Where the lines go (``None``: ``sys.stdout`` as it is when training starts).
    """

    AVERAGED = ("reward", "delay")
    AS_IS = ("queue",)

    def __init__(self, every_n_updates: int | None = None, stream: TextIO | None = None) -> None:
        super().__init__()
        if every_n_updates is not None and every_n_updates < 1:
            raise ValueError(f"ProgressLines: every_n_updates={every_n_updates} must be >= 1 (or null: 1% of the run)")
        self.every_n_updates = every_n_updates
        self.stream = stream
        self._enabled = True
        self._window: dict[str, list[float]] = {}
        self._window_start = (0.0, 0)  # (time, update) where the window began

    @property
    def is_enabled(self) -> bool:
        """Whether lines are printed (not on ranks other than 0, nor while Lightning disables the bar)."""
        return self._enabled

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, file=self.stream or sys.stdout, flush=True, **kwargs)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window = {}
        self._window_start = (time.perf_counter(), trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._enabled:
            return
        step = trainer.global_step
        total = trainer.max_steps if trainer.max_steps > 0 else int(trainer.estimated_stepping_batches)
        metrics = self.get_metrics(trainer, pl_module)
        for name in self.AVERAGED:
            if isinstance(metrics.get(name), (int, float)):
                self._window.setdefault(name, []).append(float(metrics[name]))
        every = self.every_n_updates or default_every(total)
        if step % every and step != total:
            return
        now, (start_time, start_step) = time.perf_counter(), self._window_start
        rate = (step - start_step) / (now - start_time) if now > start_time and step > start_step else 0.0
        means = {name: sum(values) / len(values) for name, values in self._window.items() if values}
        last = {name: float(metrics[name]) for name in self.AS_IS if isinstance(metrics.get(name), (int, float))}
        self.print(progress_line(step, total, means, last, rate))
        self._window = {}
        self._window_start = (now, step)

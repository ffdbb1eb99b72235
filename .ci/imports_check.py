"""CI's type check: mypy resolves ``lit_gmc.data`` and ``lit_gmc.callbacks`` and reads the types they declare.

The two folders sit at the top level and are installed under ``lit_gmc``; ``lit_gmc/data`` and ``lit_gmc/callbacks``
link to them, so type checkers and editors follow the imports in a clone, whatever the install mode. Third-party
libraries are skipped (``[tool.mypy]`` in pyproject.toml), so classes deriving from theirs (the DataModule, the
callbacks) are opaque here; the checks below use lit_gmc's own types.
"""

from collections.abc import Iterable

from torch import Tensor

from lit_gmc.callbacks.weight_sync import WeightSink
from lit_gmc.data.schedules.base import DelaySchedule, FixedDelay, Sync
from lit_gmc.data.schedules.live import Live
from lit_gmc.data.schedules.virtual_clock import VirtualClock


class RecordingSink:
    """A sink as a user writes one: structurally a ``WeightSink``."""

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Take the weights."""


def sink() -> WeightSink:
    """Any class with ``load_weights`` is a sink."""
    return RecordingSink()


def schedules() -> list[DelaySchedule]:
    """Every schedule is a ``DelaySchedule`` component."""
    return [Sync(inner_steps=1), FixedDelay(delay=2), VirtualClock(overlap=False), Live(workers=1)]


def running(schedule: DelaySchedule) -> bool:
    """The protocol every schedule has (DESIGN.md §4)."""
    with schedule.paused():
        schedule.close()
    return schedule.running

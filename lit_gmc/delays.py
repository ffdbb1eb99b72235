"""Running delay moments: the paper's averaged moments ``tau_bar_p = (1/n) sum_{k<n} tau_k^p`` (eq. 11).

An update whose groups have different delays (the live schedule) contributes the mean of ``tau^p`` over its
trajectories. ``tau_bar_4`` is what the convergence bound and Corollary 1's threshold depend on.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor


class RunningDelayMoments:
    """Accumulates ``tau_bar_2`` and ``tau_bar_4`` over updates; checkpointable."""

    def __init__(self) -> None:
        self.updates = 0
        self.sum_p1 = 0.0
        self.sum_p2 = 0.0
        self.sum_p4 = 0.0

    def update(self, delays: Tensor) -> None:
        """Add one update whose trajectories have ``delays`` (any shape, non-negative).

        Correctly rounded Python sums (``math.fsum``; docs/performance.md): integer delays give exact means.
        """
        values = [float(v) for v in delays.detach().flatten().tolist()]
        if not values:
            raise ValueError("an update needs at least one delay")
        if any(v < 0 for v in values):
            raise ValueError(f"delays must be >= 0, got min {min(values)}")
        squares = [v * v for v in values]
        self.updates += 1
        self.sum_p1 += math.fsum(values) / len(values)
        self.sum_p2 += math.fsum(squares) / len(values)
        self.sum_p4 += math.fsum([s * s for s in squares]) / len(values)

    @property
    def tau1(self) -> float:
        """Running mean delay, ``(1/n) sum_k tau_k`` (``p = 1``)."""
        return self.sum_p1 / self.updates if self.updates else 0.0

    @property
    def tau2(self) -> float:
        """``tau_bar_2``, the mean over updates of the mean squared delay (0 before any update)."""
        return self.sum_p2 / self.updates if self.updates else 0.0

    @property
    def tau4(self) -> float:
        """``tau_bar_4``, the mean over updates of the mean fourth-power delay (0 before any update)."""
        return self.sum_p4 / self.updates if self.updates else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: update count and the two running sums."""
        return {"updates": self.updates, "sum_p1": self.sum_p1, "sum_p2": self.sum_p2, "sum_p4": self.sum_p4}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.updates, self.sum_p1 = state["updates"], state["sum_p1"]
        self.sum_p2, self.sum_p4 = state["sum_p2"], state["sum_p4"]

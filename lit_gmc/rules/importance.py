"""Unclipped trajectory importance sampling (eq. 2): the unstable reference."""

from __future__ import annotations

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction


class IS(Correction):
    """IS: coefficient ``rho_i`` (eq. 2), unbounded, with leave-one-out advantages; no threshold, unstable.

    The base class's defaults are exactly this estimator; the class names it and its one option.

    Args:
        aggregation: Loss aggregation; ``null``: the paper's ``seq_sum_over_T`` (``1/(T B G)``).
    """

    def __init__(self, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation)

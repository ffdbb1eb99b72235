"""Sequence-level truncated importance sampling (verl's ``rollout_is: sequence``, threshold 2)."""

from __future__ import annotations

import math

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.rules._sequence_ratio import SequenceRatio


class SeqTIS(SequenceRatio):
    """SeqTIS: ``-sg(min(rho_i, C) A_i) log pi_theta(y_i)``, the trajectory ratio truncated at ``C``.

    Group-centred advantages; ``seq_tis/truncated_fraction``: the share of trajectories with ``rho_i > C``.

    Args:
        C: Cap of the trajectory ratio (verl's default 2.0).
        aggregation: Loss aggregation; ``null``: verl's ``token_mean``.
    """

    threshold_option = "C"
    changed_metric = "seq_tis/truncated_fraction"

    def __init__(self, C: float = 2.0, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, C=C)

    @override
    def weigh(self, log_ratio: Tensor) -> tuple[Tensor, Tensor]:
        return O.truncated_coefficients(log_ratio, self.C), log_ratio > math.log(self.C)

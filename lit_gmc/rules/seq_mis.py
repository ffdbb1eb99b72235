"""Sequence-level masked importance sampling (verl's Seq-MIS: rejection outside a band of the trajectory ratio)."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.rules._sequence_ratio import SequenceRatio


class SeqMIS(SequenceRatio):
    """SeqMIS: ``-sg(rho_i 1{low <= rho_i <= high} A_i) log pi_theta(y_i)``: a trajectory outside the band is rejected.

    verl's ``decoupled_seq_is_rs`` preset (IS weights truncated at 2, rejection of ``rho`` outside ``[0.5, 2]``:
    inside the band the weight is ``rho_i``), SkyRL's product mask. Group-centred advantages;
    ``seq_mis/masked_fraction``: the share of trajectories rejected.

    Args:
        low: Lower bound of the kept trajectory ratio (0.5).
        high: Upper bound of the kept trajectory ratio (2.0).
        aggregation: Loss aggregation; ``null``: verl's ``token_mean``.
    """

    threshold_option = "high"
    positive_options = ("low",)
    changed_metric = "seq_mis/masked_fraction"

    def __init__(self, low: float = 0.5, high: float = 2.0, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, low=low, high=high)

    @override
    def weigh(self, log_ratio: Tensor) -> tuple[Tensor, Tensor]:
        weights, kept = O.band_ratio(log_ratio, self.low, self.high)
        return weights, ~kept

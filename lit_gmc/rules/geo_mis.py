"""Rejection on the geometric-mean sequence ratio (verl's Geo-RS, ``seq_mean_k1``)."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.rules._sequence_ratio import SequenceRatio


class GeoMIS(SequenceRatio):
    """GeoMIS: ``-sg(1{low <= g_i <= high} A_i) log pi_theta(y_i)``, ``g_i = exp(mean_t log r_t)``.

    Rejection sampling on the geometric-mean ratio (verl's ``bypass_pg_geo_rs`` preset, SkyRL's geometric sequence
    mask): an accepted trajectory is trained with weight 1, a rejected one not at all. verl's band ``[0.999, 1.001]``
    is meant for the engine/trainer mismatch; stale rollouts leave it at once (SkyRL suggests ``[0.99, 1.01]``).
    Group-centred advantages; ``geo_mis/masked_fraction``: the share of trajectories rejected.

    Args:
        low: Lower bound of the kept geometric-mean ratio (verl's 0.999).
        high: Upper bound of the kept geometric-mean ratio (verl's 1.001).
        aggregation: Loss aggregation; ``null``: verl's ``token_mean``.
    """

    threshold_option = "high"
    positive_options = ("low",)
    geometric = True
    changed_metric = "geo_mis/masked_fraction"

    def __init__(self, low: float = 0.999, high: float = 1.001, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, low=low, high=high)

    @override
    def weigh(self, log_ratio: Tensor) -> tuple[Tensor, Tensor]:
        _, kept = O.band_ratio(log_ratio, self.low, self.high)
        return kept.to(log_ratio.dtype), ~kept

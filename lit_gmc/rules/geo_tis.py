"""Truncated importance sampling on the geometric-mean sequence ratio (slime's ``tis_level: geometric``)."""

from __future__ import annotations

import math

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.rules._sequence_ratio import SequenceRatio


class GeoTIS(SequenceRatio):
    """GeoTIS: ``-sg(min(g_i, C) A_i) log pi_theta(y_i)``, ``g_i = exp(mean_t log r_t)`` the geometric-mean ratio.

    ``g_i`` is a length-normalised proxy of ``rho_i``, not an importance weight (``E_b[g] != 1``); group-centred
    advantages. ``geo_tis/truncated_fraction``: the share of trajectories with ``g_i > C``.

    Args:
        C: Cap of the geometric-mean ratio (slime's truncation bound 2.0).
        aggregation: Loss aggregation; ``null``: ``token_mean``.
    """

    threshold_option = "C"
    geometric = True
    changed_metric = "geo_tis/truncated_fraction"

    def __init__(self, C: float = 2.0, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, C=C)

    @override
    def weigh(self, log_ratio: Tensor) -> tuple[Tensor, Tensor]:
        return O.truncated_coefficients(log_ratio, self.C), log_ratio > math.log(self.C)

"""TIC-GRPO as the seed paper states it (eq. 35, Remark 1)."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction, PolicyTerms


class TIC(Correction):
    """TIC-GRPO: ``w_i = 1{rho_i <= 1 + cap}`` (eq. 35), whatever the advantage's sign; leave-one-out advantages.

    Args:
        cap: ``eps`` of the ``1 + eps`` cap on each trajectory's ratio (the paper's 0.28).
        aggregation: Loss aggregation; ``null``: the paper's ``seq_sum_over_T`` (``1/(T B G)``).
    """

    threshold_option = "cap"

    def __init__(self, cap: float = 0.28, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, cap=cap)

    @override
    def coefficients(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return O.tic_coefficients(log_rho, self.cap)

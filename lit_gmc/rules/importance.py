"""Unclipped trajectory importance sampling (eq. 2): the unstable reference."""

from __future__ import annotations

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction, CorrectionOutput, PolicyTerms, trajectory_output
from lit_gmc.options import check_options


class IS(Correction):
    """Unclipped trajectory importance sampling (eq. 2), leave-one-out advantages. No threshold; unstable.

    Args:
        aggregation: Loss aggregation; ``null``: the paper's ``seq_sum_over_T`` (``1/(T B G)``).
    """

    def __init__(self, aggregation: O.Aggregation | None = None) -> None:
        check_options("IS", self.option_problems(aggregation))
        super().__init__(aggregation or "seq_sum_over_T")

    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        """Coefficients ``rho_i``, unbounded."""
        log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask)  # (n,)
        coef = O.is_coefficients(log_rho)  # (n,)
        adv = O.leave_one_out_advantages(terms.rewards, terms.group_size)  # (n,)
        return trajectory_output(terms, coef, adv, log_rho)

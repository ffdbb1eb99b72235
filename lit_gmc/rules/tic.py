"""TIC-GRPO as the seed paper states it (eq. 35, Remark 1)."""

from __future__ import annotations

from lit_gmc import objectives as O
from lit_gmc.corrections import (
    Correction,
    CorrectionOutput,
    PolicyTerms,
    aggregation_problem,
    positive_problem,
    trajectory_output,
)
from lit_gmc.options import check_options


class TIC(Correction):
    """TIC-GRPO: drop trajectories with ``rho_i > 1 + cap`` (eq. 35), whatever the advantage's sign.

    ``w_i = 1{rho_i <= 1 + cap}``, leave-one-out advantages, surrogate ``-sg(w_i rho_i A_i) log pi_theta(y_i)``.

    Args:
        cap: ``eps`` of the ``1 + eps`` cap on each trajectory's ratio (the paper's 0.28).
        aggregation: Loss aggregation; ``null``: the paper's ``seq_sum_over_T`` (``1/(T B G)``).
    """

    threshold_option = "cap"

    def __init__(self, cap: float = 0.28, aggregation: O.Aggregation | None = None) -> None:
        check_options("TIC", self.option_problems(cap, aggregation))
        super().__init__(aggregation or "seq_sum_over_T")
        self.cap = cap

    @staticmethod
    def option_problems(cap: float, aggregation: str | None) -> list[str]:
        """Every problem with TIC's options, one line each."""
        return positive_problem("cap", cap) + aggregation_problem(aggregation)

    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        """TIC's indicator coefficients."""
        log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask)  # (n,)
        coef = O.tic_coefficients(log_rho, self.cap)  # (n,)
        adv = O.leave_one_out_advantages(terms.rewards, terms.group_size)  # (n,)
        return trajectory_output(terms, coef, adv, log_rho)

"""CISPO (MiniMax-M1, Chen et al. 2025)."""

from __future__ import annotations

from lit_gmc import objectives as O
from lit_gmc.baselines import group_normalized_advantages
from lit_gmc.corrections import Correction, CorrectionOutput, PolicyTerms, aggregation_problem, positive_problem
from lit_gmc.options import check_options
from lit_gmc.rules.tis import truncated_ratio_output


class CISPO(Correction):
    """CISPO: ``-sg(min(r_t, 1 + eps_high) A_i) log pi_theta(y_t)`` per token.

    No lower bound on the weight (the authors set ``eps_low`` out of reach), advantages ``(r_i - mean) / std`` per
    group (population std, skipped on ties).

    Args:
        eps_high: The token ratio is capped at ``1 + eps_high`` (0.28).
        aggregation: Loss aggregation; ``null``: the authors' ``token_mean``.
    """

    threshold_option = "eps_high"

    def __init__(self, eps_high: float = 0.28, aggregation: O.Aggregation | None = None) -> None:
        check_options("CISPO", self.option_problems(eps_high, aggregation))
        super().__init__(aggregation or "token_mean")
        self.eps_high = eps_high

    @staticmethod
    def option_problems(eps_high: float, aggregation: str | None) -> list[str]:
        """Every problem with CISPO's options, one line each."""
        return positive_problem("eps_high", eps_high) + aggregation_problem(aggregation)

    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        """Truncated token ratios with group-normalised advantages."""
        r = O.per_group(terms.rewards, terms.group_size, "rewards")  # (k, G)
        adv = group_normalized_advantages(terms.rewards, r.mean(-1), terms.group_size)  # (n,)
        return truncated_ratio_output(terms, 1.0 + self.eps_high, adv, "cispo")

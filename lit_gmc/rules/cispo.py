"""CISPO (MiniMax-M1, Chen et al. 2025)."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.rules._token_level import TokenLevel


class CISPO(TokenLevel):
    """CISPO: ``-sg(min(r_t, 1 + eps_high) A_i) log pi_theta(y_t)`` per token.

    No lower bound on the weight (the authors set ``eps_low`` out of reach); advantages ``(r_i - mean) / std`` per
    group (population std, skipped on ties).

    Args:
        eps_high: The token ratio is capped at ``1 + eps_high`` (0.28).
        aggregation: Loss aggregation; ``null``: the authors' ``token_mean``.
    """

    threshold_option = "eps_high"
    default_aggregation = "token_mean"

    def __init__(self, eps_high: float = 0.28, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, eps_high=eps_high)

    @override
    def advantages(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return O.group_standardized_advantages(terms.rewards, terms.group_size)

    @override
    def token_loss(self, terms: PolicyTerms, coefficients: Tensor, advantages: Tensor) -> tuple[Tensor, dict]:
        """Truncated token ratios, and the share of real tokens truncated."""
        loss, truncated = O.truncated_token_ratio_loss(
            terms.token_logprobs, terms.behavior_logprobs, terms.mask, advantages, 1.0 + self.eps_high
        )  # (n, L), (n, L)
        return loss, {"cispo/truncated_fraction": O.token_fraction(truncated, terms.mask)}

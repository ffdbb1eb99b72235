"""Truncated importance sampling (Yao et al. 2025) for the engine/trainer mismatch."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.rules._token_level import TokenLevel


class TIS(TokenLevel):
    """TIS: ``-sg(min(pi_theta(y_t) / pi_engine(y_t), C) A_i) log pi_theta(y_t)`` per token.

    The policy-gradient form, with the current policy as the trainer side.

    Args:
        C: Cap of the token ratio (2).
        aggregation: Loss aggregation; ``null``: ``token_mean``.
    """

    threshold_option = "C"
    default_aggregation = "token_mean"

    def __init__(self, C: float = 2.0, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, C=C)

    @override
    def token_loss(self, terms: PolicyTerms, coefficients: Tensor, advantages: Tensor) -> tuple[Tensor, dict]:
        """Truncated token ratios, and the share of real tokens truncated."""
        loss, truncated = O.truncated_token_ratio_loss(
            terms.token_logprobs, terms.behavior_logprobs, terms.mask, advantages, self.C
        )  # (n, L), (n, L)
        return loss, {"tis/truncated_fraction": O.token_fraction(truncated, terms.mask)}

"""GSPO (Zheng et al. 2025, arXiv 2507.18071): PPO's clip on the geometric-mean sequence ratio."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.rules._token_level import TokenLevel


class GSPO(TokenLevel):
    """GSPO: ``loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``, ``s_i = exp(mean_t log r_t)``.

    ``s_i`` is the geometric mean of the sequence's token ratios ``pi_theta / pi_b``, so one clip decision per
    sequence; the gradient flows through ``s_i`` (written in the token form verl and TRL's ``sequence_token`` use,
    equal in value and gradient under ``seq_mean_token_mean``). Advantages ``(r_i - mean) / std`` per group, as the
    paper's (population std, 0 on ties). ``gspo/clip_fraction``: the share of sequences outside the band.

    Args:
        eps_low: Lower clip ``1 - eps_low`` of the sequence ratio (the paper's 3e-4).
        eps_high: Upper clip ``1 + eps_high`` of the sequence ratio (the paper's 4e-4).
        aggregation: Loss aggregation; ``null``: ``seq_mean_token_mean`` (the paper's mean over sequences; verl
            uses it whatever ``loss_agg_mode`` says).
    """

    threshold_option = "eps_high"
    positive_options = ("eps_low",)
    default_aggregation = "seq_mean_token_mean"

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, eps_low=eps_low, eps_high=eps_high)

    @override
    def advantages(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return O.group_standardized_advantages(terms.rewards, terms.group_size)

    @override
    def token_loss(self, terms: PolicyTerms, coefficients: Tensor, advantages: Tensor) -> tuple[Tensor, dict]:
        """The clipped sequence-ratio loss on every token of the sequence, and the share of sequences clipped."""
        loss, outside = O.gspo_token_loss(
            terms.token_logprobs, terms.behavior_logprobs, terms.mask, advantages, self.eps_low, self.eps_high
        )  # (n, L), (n,)
        return loss, {"gspo/clip_fraction": outside.float().mean()}

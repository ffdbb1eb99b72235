"""DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv 2602.04879): prime-rl's default token mask."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.rules._token_level import TokenLevel


class DPPO(TokenLevel):
    """DPPO (Binary-TV): ``-sg(M_t r_t A_i) log pi_theta(y_t)``, ``M_t`` a trust region on ``pi_theta - pi_b``.

    :func:`~lit_gmc.objectives.dppo_keep_mask`: a token of positive advantage is dropped once its probability rose
    more than ``eps_high`` above the behaviour's, any other once it fell more than ``eps_low`` below; kept tokens get
    the plain ratio ``r_t = pi_theta / pi_b`` (anchored on the behaviour policy, no truncation: prime-rl's
    ``dppo_mask_low/high``). Dropped tokens still count in ``token_mean``'s denominator, as prime-rl divides by every
    loss token. prime-rl adds a ``1e-3 (log r)^2`` penalty to this; the paper's loss, here, has none.
    ``dppo/masked_up_fraction``, ``dppo/masked_down_fraction``: the shares of real tokens dropped on each side.

    Args:
        eps_low: Fall of ``pi_theta(y_t)`` below ``pi_b(y_t)`` past which a token of non-positive advantage is
            dropped (0.2, prime-rl and SkyRL).
        eps_high: Rise of ``pi_theta(y_t)`` above ``pi_b(y_t)`` past which a token of positive advantage is dropped
            (0.2, prime-rl and SkyRL).
        aggregation: Loss aggregation; ``null``: prime-rl's ``token_mean``.
    """

    threshold_option = "eps_high"
    positive_options = ("eps_low",)
    default_aggregation = "token_mean"

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, eps_low=eps_low, eps_high=eps_high)

    @override
    def token_loss(self, terms: PolicyTerms, coefficients: Tensor, advantages: Tensor) -> tuple[Tensor, dict]:
        """The kept token ratios as weights, and the shares dropped on each side of the trust region."""
        mask = terms.mask
        keep, dropped = O.dppo_keep_mask(
            terms.token_logprobs, terms.behavior_logprobs, mask, advantages, self.eps_low, self.eps_high
        )  # (n, L), (n, L)
        log_r = O.token_log_ratio(terms.token_logprobs, terms.behavior_logprobs, mask)  # (n, L)
        loss = O.token_policy_gradient_loss(O.kept_ratio(log_r, keep), advantages, terms.token_logprobs, mask)
        up = advantages.detach()[:, None] > 0  # (n, 1)
        extra = {
            "dppo/masked_up_fraction": O.token_fraction(dropped & up, mask),
            "dppo/masked_down_fraction": O.token_fraction(dropped & ~up, mask),
        }
        return loss, extra

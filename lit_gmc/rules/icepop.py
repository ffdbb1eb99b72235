"""IcePop (Ring-1T, inclusionAI 2025, arXiv 2510.18855): token ratios outside a band get no gradient."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.rules._token_level import TokenLevel


class IcePop(TokenLevel):
    """IcePop: ``-sg(r_t 1{low <= r_t <= high} A_i) log pi_theta(y_t)`` per token, ``r_t = pi_theta / pi_b``.

    Token-level masked importance sampling: a token whose ratio leaves the band is dropped (not clipped), the others
    keep their ratio as weight; dropped tokens still count in ``token_mean``'s denominator (as in verl, slime,
    SkyRL and TRL). With one update per batch the trainer's recomputed ``pi_old`` is the current policy, so the
    paper's ``pi_old / pi_infer`` calibration ratio is this ``r_t`` (verl's bypass and prime-rl's form have the same
    gradient). ``icepop/masked_fraction``: the share of real tokens outside the band.

    Args:
        low: Lower bound ``alpha`` of the kept band (0.5, verl's IcePop preset).
        high: Upper bound ``beta`` of the kept band (5.0, verl's IcePop preset).
        aggregation: Loss aggregation; ``null``: ``token_mean``.
    """

    threshold_option = "high"
    positive_options = ("low",)
    default_aggregation = "token_mean"

    def __init__(self, low: float = 0.5, high: float = 5.0, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, low=low, high=high)

    @override
    def token_loss(self, terms: PolicyTerms, coefficients: Tensor, advantages: Tensor) -> tuple[Tensor, dict]:
        """The band-masked token ratios as weights, and the share of real tokens masked."""
        log_r = O.token_log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask)  # (n, L)
        weights, kept = O.band_ratio(log_r, self.low, self.high)  # (n, L), (n, L)
        loss = O.token_policy_gradient_loss(weights, advantages, terms.token_logprobs, terms.mask)  # (n, L)
        return loss, {"icepop/masked_fraction": O.token_fraction(terms.mask & ~kept, terms.mask)}


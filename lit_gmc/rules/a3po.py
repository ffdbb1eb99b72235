"""A-3PO (Li et al. 2025), as in AReaL's decoupled loss with the ``loglinear`` proximal policy."""

from __future__ import annotations

import math

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms, aggregation_problem, positive_problem
from lit_gmc.rules.grpo import GRPO


class A3PO(GRPO):
    """A-3PO: GRPO's PPO clip against a proximal policy, times ``pi_prox / pi_b`` (by default NOT clipped).

    Per token, ``log pi_prox = alpha l + (1 - alpha) sg(log pi_theta)`` with ``alpha = 1 / max(1, tau)`` (``tau``
    the group's delay), ``r = exp(log pi_theta - log pi_prox)`` and

        ``loss_t = -sg(pi_prox / pi_b) min(r A, clip(r, 1 - clip, 1 + clip) A)``.

    Its gradient on an unclipped token carries the full, unbounded token ratio ``pi_theta / pi_b``, which the seed
    paper blames for A-3PO's collapse at 8B; GRPO's loss exactly when ``tau <= 1``. ``a3po/over_cap_fraction``:
    the share of tokens with ``pi_prox / pi_b`` above ``behavior_cap`` (5 when unset, only reported).

    Args:
        clip: Two-sided PPO clip of the ratio to the proximal policy (0.2).
        behavior_cap: ``null`` (the seed paper's A-3PO) or AReaL's ``behav_imp_weight_cap`` (AReaL uses 5): tokens
            with ``pi_prox / pi_b`` above it get no loss (masked, not clamped) but still count in the
            ``token_mean`` denominator.
        aggregation: Loss aggregation; ``null``: AReaL's ``token_mean``.
    """

    default_aggregation = "token_mean"

    def __init__(
        self, clip: float = 0.2, behavior_cap: float | None = None, aggregation: O.Aggregation | None = None
    ) -> None:
        super().__init__(clip, aggregation, behavior_cap=behavior_cap)

    @classmethod
    def option_problems(  # type: ignore[override]
        cls, clip: float, behavior_cap: float | None, aggregation: str | None
    ) -> list[str]:
        """Every problem with A-3PO's options, one line each."""
        capped = positive_problem("behavior_cap", behavior_cap) if behavior_cap is not None else []
        return positive_problem("clip", clip) + capped + aggregation_problem(aggregation)

    @override
    def token_loss(self, terms: PolicyTerms, coefficients: Tensor, advantages: Tensor) -> tuple[Tensor, dict]:
        """The PPO-clip loss against the proximal policy, weighted by ``pi_prox / pi_b``."""
        mask, clip = terms.mask, self.clip
        alpha = O.a3po_alpha(terms.delays)  # (n,)
        log_prox = O.loglinear_proximal_logprobs(terms.token_logprobs, terms.behavior_logprobs, alpha)  # (n, L)
        log_weight = (log_prox - terms.behavior_logprobs).masked_fill(~mask, 0.0)  # (n, L), detached
        weight, kept = O.a3po_behavior_weight(log_weight, mask, self.behavior_cap)  # (n, L), (n, L)
        loss = weight * O.ppo_clip_token_loss(terms.token_logprobs, log_prox, mask, advantages, clip)  # (n, L)
        log_r = (terms.token_logprobs.detach() - log_prox).masked_fill(~mask, 0.0)  # (n, L)
        floor = math.log1p(-clip) if clip < 1 else -math.inf  # a clip of 1 or more has no lower side
        clipped = ((log_r < floor) | (log_r > math.log1p(clip))) & kept  # (n, L)
        reported_cap = O.A3PO_BEHAVIOR_CAP if self.behavior_cap is None else self.behavior_cap
        over_cap = mask & (log_weight > math.log(reported_cap))  # (n, L): masked when behavior_cap is set
        extra = {
            "a3po/over_cap_fraction": O.token_fraction(over_cap, mask),
            "a3po/clip_fraction": O.token_fraction(clipped, mask),
            "a3po/alpha_mean": alpha.mean(),
        }
        return loss, extra

"""The parent of the token-level rules (GRPO, TIS, CISPO): not a rule itself, so the registry skips this module."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction, PolicyTerms


class TokenLevel(Correction):
    """A rule that weights tokens: group-centred advantages; its coefficient is the unclipped trajectory ratio."""

    @override
    def advantages(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return O.group_centered_advantages(terms.rewards, terms.group_size)

    @override
    def coefficients(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return O.trajectory_ratio(log_rho)

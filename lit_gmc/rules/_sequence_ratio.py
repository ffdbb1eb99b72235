"""The parent of the sequence-ratio corrections (SeqTIS, SeqMIS, GeoTIS, GeoMIS): not a rule itself."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction, CorrectionOutput, PolicyTerms


class SequenceRatio(Correction):
    """Weights each trajectory by a truncated or masked sequence ratio: verl's rollout correction family.

    The ratio is the trajectory's ``rho_i = exp(sum_t log r_t)`` or, with ``geometric``, the geometric mean of its
    token ratios ``exp(mean_t log r_t)``; the weight (:meth:`weigh`) is detached and multiplies GRPO's policy
    gradient, ``-sg(w_i A_i) log pi_theta(y_i)`` with group-centred advantages, as verl applies it to one update per
    batch (its recomputed ``pi_old`` is then the current policy). A subclass names the ratio and the weight, and the
    metric that counts the trajectories the weight changed.
    """

    geometric: ClassVar[bool] = False
    """Weigh the geometric mean of the token ratios instead of the trajectory ratio."""

    changed_metric: ClassVar[str] = ""
    """The logged share of trajectories whose weight is not their ratio (truncated or masked)."""

    default_aggregation = "token_mean"  # verl's loss_agg_mode default

    def weigh(self, log_ratio: Tensor) -> tuple[Tensor, Tensor]:
        """``(n,)`` weights from ``(n,)`` log-ratios, and the ``(n,)`` mask of those it changed."""
        raise NotImplementedError

    def sequence_log_ratio(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        """``(n,)`` ``log rho_i``, or the mean token log-ratio when :attr:`geometric`."""
        if not self.geometric:
            return log_rho
        return O.geometric_log_ratio(terms.token_logprobs.detach(), terms.behavior_logprobs, terms.mask)

    @override
    def advantages(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return O.group_centered_advantages(terms.rewards, terms.group_size)

    @override
    def coefficients(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return self.weigh(self.sequence_log_ratio(terms, log_rho))[0]

    @override
    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        """The weighted surrogate, and the share of trajectories the weight changed."""
        out = super().__call__(terms)
        _, changed = self.weigh(self.sequence_log_ratio(terms, out.log_rho))  # (n,): cheap to form again
        out.extra[self.changed_metric] = changed.float().mean()
        return out

"""Truncated importance sampling (Yao et al. 2025) for the engine/trainer mismatch."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_gmc import objectives as O
from lit_gmc.baselines import truncated_token_ratio_loss
from lit_gmc.corrections import Correction, CorrectionOutput, PolicyTerms, aggregation_problem, positive_problem
from lit_gmc.options import check_options


def truncated_ratio_output(terms: PolicyTerms, cap: float, adv: Tensor, name: str) -> CorrectionOutput:
    """The output of a truncated token-ratio rule (TIS, CISPO), logging ``<name>/truncated_fraction``."""
    loss, truncated = truncated_token_ratio_loss(terms.token_logprobs, terms.behavior_logprobs, terms.mask, adv, cap)
    log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask).detach()  # (n,)
    extra = {f"{name}/truncated_fraction": truncated.sum() / terms.mask.sum().clamp(min=1)}
    return CorrectionOutput(loss, log_rho, torch.exp(log_rho.clamp(max=80.0)), adv.detach(), extra)


class TIS(Correction):
    """TIS: ``-sg(min(pi_theta(y_t) / pi_engine(y_t), C) A_i) log pi_theta(y_t)`` per token.

    The policy-gradient form, with the current policy as the trainer side; group-centred advantages.

    Args:
        C: Cap of the token ratio (2).
        aggregation: Loss aggregation; ``null``: ``token_mean``.
    """

    threshold_option = "C"

    def __init__(self, C: float = 2.0, aggregation: O.Aggregation | None = None) -> None:
        check_options("TIS", self.option_problems(C, aggregation))
        super().__init__(aggregation or "token_mean")
        self.C = C

    @staticmethod
    def option_problems(C: float, aggregation: str | None) -> list[str]:
        """Every problem with TIS's options, one line each."""
        return positive_problem("C", C) + aggregation_problem(aggregation)

    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        """Truncated token ratios with group-centred advantages."""
        adv = O.group_centered_advantages(terms.rewards, terms.group_size)  # (n,)
        return truncated_ratio_output(terms, self.C, adv, "tis")

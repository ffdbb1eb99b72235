"""Vanilla GRPO (Shao et al. 2024): token-level two-sided PPO clip."""

from __future__ import annotations

import torch

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction, CorrectionOutput, PolicyTerms, aggregation_problem, positive_problem
from lit_gmc.options import check_options


def grpo_output(terms: PolicyTerms, clip: float) -> CorrectionOutput:
    """GRPO's PPO-clip token loss with group-centred advantages (shared by :class:`GRPO` and GAC).

    Dual clip off. The reported coefficient is the unclipped trajectory ratio, since the token clip has no
    trajectory weight of its own.
    """
    log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask).detach()  # (n,)
    adv = O.group_centered_advantages(terms.rewards, terms.group_size)  # (n,)
    loss = O.ppo_clip_token_loss(terms.token_logprobs, terms.behavior_logprobs, terms.mask, adv, clip)  # (n, L)
    ratio = torch.exp((terms.token_logprobs.detach() - terms.behavior_logprobs).clamp(max=80.0))  # (n, L)
    clipped = ((ratio < 1.0 - clip) | (ratio > 1.0 + clip)) & terms.mask  # (n, L)
    frac = clipped.sum() / terms.mask.sum().clamp(min=1)
    return CorrectionOutput(
        loss, log_rho, torch.exp(log_rho.clamp(max=80.0)), adv.detach(), {"grpo/clip_fraction": frac}
    )


class GRPO(Correction):
    """Vanilla GRPO: ``loss_t = -min(r_t A, clip(r_t, 1 - clip, 1 + clip) A)``, advantage ``r_i - mean(r)``.

    Args:
        clip: Two-sided PPO clip of the token ratio (Shao et al.'s 0.2).
        aggregation: Loss aggregation; ``null``: the authors' ``seq_mean_token_mean``.
    """

    threshold_option = "clip"

    def __init__(self, clip: float = 0.2, aggregation: O.Aggregation | None = None) -> None:
        check_options("GRPO", GRPO.option_problems(clip, aggregation))
        super().__init__(aggregation or "seq_mean_token_mean")
        self.clip = clip

    @staticmethod
    def option_problems(clip: float, aggregation: str | None) -> list[str]:
        """Every problem with the options, one line each."""
        return positive_problem("clip", clip) + aggregation_problem(aggregation)

    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        """The PPO-clip token loss."""
        return grpo_output(terms, self.clip)

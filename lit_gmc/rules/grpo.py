"""Vanilla GRPO (Shao et al. 2024): token-level two-sided PPO clip."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.rules._token_level import TokenLevel


class GRPO(TokenLevel):
    """Vanilla GRPO: ``loss_t = -min(r_t A, clip(r_t, 1 - clip, 1 + clip) A)``, advantage ``r_i - mean(r)``.

    Dual clip off.

    Args:
        clip: Two-sided PPO clip of the token ratio (Shao et al.'s 0.2).
        aggregation: Loss aggregation; ``null``: the authors' ``seq_mean_token_mean``.
    """

    threshold_option = "clip"
    default_aggregation = "seq_mean_token_mean"

    def __init__(self, clip: float = 0.2, aggregation: O.Aggregation | None = None, **options: Any) -> None:
        super().__init__(aggregation, clip=clip, **options)  # options: a subclass's own (GAC's cosines)

    @override
    def token_loss(self, terms: PolicyTerms, coefficients: Tensor, advantages: Tensor) -> tuple[Tensor, dict]:
        """The PPO-clip token loss, and the share of real tokens whose ratio is outside the clip."""
        clip, mask = self.clip, terms.mask
        loss = O.ppo_clip_token_loss(terms.token_logprobs, terms.behavior_logprobs, mask, advantages, clip)  # (n, L)
        log_r = (terms.token_logprobs.detach() - terms.behavior_logprobs).clamp(max=O.LOG_RATIO_LIMIT)  # (n, L)
        ratio = torch.exp(log_r)  # (n, L)
        clipped = ((ratio < 1.0 - clip) | (ratio > 1.0 + clip)) & mask  # (n, L)
        return loss, {"grpo/clip_fraction": O.token_fraction(clipped, mask)}

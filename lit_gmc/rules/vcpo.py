"""VCPO (Huang et al. 2026; reference code mit-han-lab/vcpo)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from lit_gmc import objectives as O
from lit_gmc.baselines import ess_step_factor, group_normalized_advantages, vcpo_baseline
from lit_gmc.corrections import Correction, CorrectionOutput, PolicyTerms, aggregation_problem, positive_problem
from lit_gmc.options import check_options


class VCPO(Correction):
    """VCPO: truncated sequence ratio, off-policy minimum-variance baseline, and an ESS-scaled step size.

    ``w_i = exp(sum_t (log pi_theta - l))``, coefficient ``min(w_i, c)`` (detached), advantage
    ``(r_i - b*) / sigma_group`` with :func:`~lit_gmc.baselines.vcpo_baseline`, surrogate
    ``-sg(min(w_i, c) A_i) log pi_theta(y_i)``. Needs each trajectory's gradient norm (the module computes it,
    one backward per trajectory). Step rule: this step's learning rate is ``lr * sqrt(min(1, ESS / n))`` over the
    update's ``n`` trajectories (unclipped ``w``), restored after the step.

    Args:
        c: Truncation of the sequence ratio (the authors' 8).
        aggregation: Loss aggregation; ``null``: the authors' ``seq_mean_token_mean``.
    """

    threshold_option = "c"
    needs_grad_norms: ClassVar[bool] = True

    def __init__(self, c: float = 8.0, aggregation: O.Aggregation | None = None) -> None:
        check_options("VCPO", self.option_problems(c, aggregation))
        super().__init__(aggregation or "seq_mean_token_mean")
        self.c = c
        self._saved_lrs: list[Any] | None = None

    @staticmethod
    def option_problems(c: float, aggregation: str | None) -> list[str]:
        """Every problem with VCPO's options, one line each."""
        return positive_problem("c", c) + aggregation_problem(aggregation)

    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        """Truncated coefficients with the VCPO baseline."""
        if terms.grad_norms_sq is None:
            raise ValueError("VCPO needs PolicyTerms.grad_norms_sq (filled for rules with needs_grad_norms)")
        log_w = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask).detach()  # (n,)
        truncated = torch.exp(log_w.clamp(max=math.log(self.c)))  # (n,) min(w, c)
        baseline = vcpo_baseline(log_w, terms.grad_norms_sq, terms.rewards, terms.group_size)  # (k,)
        adv = group_normalized_advantages(terms.rewards, baseline, terms.group_size)  # (n,)
        loss = O.surrogate_token_loss(truncated * adv, terms.token_logprobs, terms.mask)  # (n, L)
        extra = {
            "vcpo/truncated_fraction": (log_w > math.log(self.c)).float().mean(),
            "vcpo/baseline_mean": baseline.mean(),
            "vcpo/trajectory_grad_norm_mean": terms.grad_norms_sq.detach().sqrt().mean(),
        }
        return CorrectionOutput(loss, log_w, truncated, adv.detach(), extra)

    def before_step(
        self, parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, stats: dict[str, Tensor]
    ) -> dict[str, float]:
        """Scale every param group's lr by the ESS factor of ``stats["log_rho"]``; returns it and the ESS fraction."""
        factor = float(ess_step_factor(stats["log_rho"]))
        self._saved_lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        return {"vcpo/lr_factor": factor, "vcpo/ess_fraction": factor * factor}

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Put back the learning rates saved by :meth:`before_step`."""
        if self._saved_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._saved_lrs, strict=True):
                group["lr"] = lr
            self._saved_lrs = None

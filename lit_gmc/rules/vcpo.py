"""VCPO (Huang et al. 2026; reference code mit-han-lab/vcpo)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction, CorrectionOutput, PolicyTerms


class VCPO(Correction):
    """VCPO: truncated sequence ratio, off-policy minimum-variance baseline, and an ESS-scaled step size.

    Coefficient ``min(w_i, c)`` of ``w_i = exp(sum_t (log pi_theta - l))``, advantage ``(r_i - b*) / sigma_group``
    with :func:`~lit_gmc.objectives.vcpo_baseline` (which needs each trajectory's gradient norm: the module runs one
    backward per trajectory), the surrogate loss. Step rule: this step's learning rate is
    ``lr * sqrt(min(1, ESS / n))`` over the update's ``n`` trajectories (unclipped ``w``), restored after the step.

    Args:
        c: Truncation of the sequence ratio (the authors' 8).
        aggregation: Loss aggregation; ``null``: the authors' ``seq_mean_token_mean``.
    """

    threshold_option = "c"
    default_aggregation = "seq_mean_token_mean"
    needs_grad_norms: ClassVar[bool] = True

    def __init__(self, c: float = 8.0, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, c=c)
        self._saved_lrs: list[Any] | None = None

    def baseline(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        """The ``(k,)`` per-group baseline ``b*``."""
        if terms.grad_norms_sq is None:
            raise ValueError("VCPO needs PolicyTerms.grad_norms_sq (filled for rules with needs_grad_norms)")
        return O.vcpo_baseline(log_rho, terms.grad_norms_sq, terms.rewards, terms.group_size)

    @override
    def advantages(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return O.group_normalized_advantages(terms.rewards, self.baseline(terms, log_rho), terms.group_size)

    @override
    def coefficients(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return O.truncated_coefficients(log_rho, self.c)

    @override
    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        """The surrogate loss, logging the share of truncated ratios, the mean baseline and trajectory gradient norm."""
        out = super().__call__(terms)
        out.extra["vcpo/truncated_fraction"] = (out.log_rho > math.log(self.c)).float().mean()
        out.extra["vcpo/baseline_mean"] = self.baseline(terms, out.log_rho).mean()  # (k,): cheap to form again
        out.extra["vcpo/trajectory_grad_norm_mean"] = terms.grad_norms_sq.detach().sqrt().mean()  # type: ignore[union-attr]
        return out

    @override
    def before_step(
        self, parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, stats: dict[str, Tensor]
    ) -> dict[str, float]:
        """Scale every param group's lr by the ESS factor of ``stats["log_rho"]``; returns it and the ESS fraction."""
        factor = float(O.ess_step_factor(stats["log_rho"]))
        self._saved_lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        return {"vcpo/lr_factor": factor, "vcpo/ess_fraction": factor * factor}

    @override
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Put back the learning rates saved by :meth:`before_step`."""
        if self._saved_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._saved_lrs, strict=True):
                group["lr"] = lr
            self._saved_lrs = None

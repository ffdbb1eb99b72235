"""The registry of off-policy corrections: one function per rule, one entry per name.

A rule maps the policy terms of a micro-batch of whole groups to a per-token loss (aggregated by the
caller with the batch-wide normaliser) plus detached diagnostics. Adding a rule is one function and one
``register`` call; :class:`lit_gmc.module.GMCModule` never branches on the name.

Rules that also change the optimizer step (VCPO's step size, GAC's gradient projection) attach a
:class:`StepRule` to their entry; the module calls its hooks around ``optimizer.step``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lit_gmc import objectives as O
from lit_gmc.objectives import Aggregation


@dataclass(frozen=True)
class PolicyTerms:
    """What a correction sees for a micro-batch of ``n = k * G`` rows (``k`` whole groups).

    Attributes:
        token_logprobs: ``(n, L)`` current-policy log-probs of the response tokens, with gradient.
        behavior_logprobs: ``(n, L)`` behaviour log-probs ``l`` from the engine.
        mask: ``(n, L)`` True on real response tokens.
        rewards: ``(n,)`` rewards.
        delays: ``(n,)`` delay ``tau = n_step - s`` of each row (long).
        group_size: ``G``.
        grad_norms_sq: ``(n,)`` exact ``||grad_theta log pi_theta(y_i)||^2`` per row, filled only for rules whose
            entry sets ``needs_grad_norms`` (VCPO's baseline); ``None`` otherwise.
    """

    token_logprobs: Tensor
    behavior_logprobs: Tensor
    mask: Tensor
    rewards: Tensor
    delays: Tensor
    group_size: int
    grad_norms_sq: Tensor | None = None


@dataclass
class CorrectionOutput:
    """Per-token loss (zeros on padding) and detached per-row tensors for diagnostics.

    Attributes:
        token_loss: ``(n, L)`` loss contributions, with gradient.
        log_rho: ``(n,)`` trajectory log-ratios.
        coefficients: ``(n,)`` effective trajectory weight ``w_i rho_i`` (for token-level rules, the
            ratio the rule would weight the whole trajectory with; used for removed mass).
        advantages: ``(n,)`` advantages used.
        extra: Further detached tensors a rule wants logged, keyed by metric name.
    """

    token_loss: Tensor
    log_rho: Tensor
    coefficients: Tensor
    advantages: Tensor
    extra: dict[str, Tensor] = field(default_factory=dict)


class StepRule(Protocol):
    """Optional per-step rule of a correction, called by the module around the optimizer step."""

    def before_step(
        self, parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, stats: dict[str, Tensor]
    ) -> dict[str, float]:
        """Adjust gradients or step size before clipping and the step; returns scalars to log."""

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Undo any temporary change (e.g. restore the learning rate)."""

    def state_dict(self) -> dict[str, Any]:
        """The rule's checkpointable state."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""


CorrectionFn = Callable[[PolicyTerms, float], CorrectionOutput]


@dataclass(frozen=True)
class Correction:
    """A registry entry.

    Attributes:
        fn: The rule ``(terms, eps) -> CorrectionOutput``.
        default_eps: Threshold used when the config leaves ``eps`` unset.
        aggregation: The loss aggregation its authors used (overridable in the config).
        step_rule: Factory of the optional :class:`StepRule` (one instance per module).
        needs_grad_norms: The rule reads ``PolicyTerms.grad_norms_sq``; the module then computes them (costly:
            one extra backward per trajectory), so only rules that need them ask.
    """

    fn: CorrectionFn
    default_eps: float
    aggregation: Aggregation
    step_rule: Callable[[], StepRule] | None = None
    needs_grad_norms: bool = False


CORRECTIONS: dict[str, Correction] = {}


def register(name: str, correction: Correction) -> None:
    """Add ``correction`` to :data:`CORRECTIONS` under ``name``; a name can be registered only once."""
    if name in CORRECTIONS:
        raise ValueError(f"correction {name!r} is already registered")
    CORRECTIONS[name] = correction


def _trajectory_rule(terms: PolicyTerms, coefficients: Tensor, advantages: Tensor, log_rho: Tensor) -> CorrectionOutput:
    loss = O.surrogate_token_loss(coefficients * advantages, terms.token_logprobs, terms.mask)  # (n, L)
    return CorrectionOutput(loss, log_rho.detach(), coefficients.detach(), advantages.detach())


def gmc(terms: PolicyTerms, eps: float) -> CorrectionOutput:
    """GMC-GRPO (the paper, eq. 9 and 12): cap each group's mean ratio at ``1 + eps`` by one shared factor.

    ``rho_hat_i = rho_i / max(1, rho_bar / (1 + eps))`` with the factor treated as a constant, leave-one-out
    advantages, surrogate ``-sg(rho_hat_i A_i) log pi_theta(y_i)``.
    """
    log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask)  # (n,)
    coef = O.gmc_coefficients(log_rho, terms.group_size, eps)  # (n,)
    adv = O.leave_one_out_advantages(terms.rewards, terms.group_size)  # (n,)
    return _trajectory_rule(terms, coef, adv, log_rho)


def tic(terms: PolicyTerms, eps: float) -> CorrectionOutput:
    """TIC-GRPO as the paper states it (eq. 35, Remark 1): drop trajectories with ``rho_i > 1 + eps``.

    ``w_i = 1{rho_i <= 1 + eps}`` regardless of the advantage's sign; leave-one-out advantages.
    """
    log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask)  # (n,)
    coef = O.tic_coefficients(log_rho, eps)  # (n,)
    adv = O.leave_one_out_advantages(terms.rewards, terms.group_size)  # (n,)
    return _trajectory_rule(terms, coef, adv, log_rho)


def importance_sampling(terms: PolicyTerms, eps: float) -> CorrectionOutput:
    """Unclipped trajectory importance sampling (eq. 2); ``eps`` is unused. Unstable: a reference only."""
    del eps
    log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask)  # (n,)
    coef = O.is_coefficients(log_rho)  # (n,)
    adv = O.leave_one_out_advantages(terms.rewards, terms.group_size)  # (n,)
    return _trajectory_rule(terms, coef, adv, log_rho)


def grpo(terms: PolicyTerms, eps: float) -> CorrectionOutput:
    """Vanilla GRPO (Shao et al. 2024): token-level two-sided PPO clip, group-centred advantages.

    Dual clip off. The reported coefficient is the unclipped trajectory ratio, since the token clip has no
    trajectory weight of its own.
    """
    log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask).detach()  # (n,)
    adv = O.group_centered_advantages(terms.rewards, terms.group_size)  # (n,)
    loss = O.ppo_clip_token_loss(terms.token_logprobs, terms.behavior_logprobs, terms.mask, adv, eps)  # (n, L)
    ratio = torch.exp((terms.token_logprobs.detach() - terms.behavior_logprobs).clamp(max=80.0))  # (n, L)
    clipped = ((ratio < 1.0 - eps) | (ratio > 1.0 + eps)) & terms.mask  # (n, L)
    frac = clipped.sum() / terms.mask.sum().clamp(min=1)
    return CorrectionOutput(
        loss, log_rho, torch.exp(log_rho.clamp(max=80.0)), adv.detach(), {"grpo/clip_fraction": frac}
    )


register("gmc", Correction(gmc, default_eps=0.28, aggregation="seq_sum_over_T"))
register("tic", Correction(tic, default_eps=0.28, aggregation="seq_sum_over_T"))
register("is", Correction(importance_sampling, default_eps=0.28, aggregation="seq_sum_over_T"))
register("grpo", Correction(grpo, default_eps=0.2, aggregation="seq_mean_token_mean"))

# The baselines (VCPO, GAC, A-3PO, CISPO, TIS) register themselves; imported last because they build on the above.
import lit_gmc.baselines  # noqa: E402, F401

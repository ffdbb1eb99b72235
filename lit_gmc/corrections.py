"""The off-policy rule as a component: the :class:`Correction` base class and what a rule sees and returns.

Every rule is a subclass of :class:`Correction` in its own file under :mod:`lit_gmc.rules`, owning its
threshold(s) under its own name (GMC's ``cap``, GRPO's ``clip``, VCPO's ``c``, ...) and its loss ``aggregation``.
LightningCLI builds it from ``class_path`` + ``init_args`` like a delay schedule, so ``--model.correction GRPO
--model.correction.clip 0.25`` works and an option of one rule cannot be given to another. The registry is the set
of subclasses, which jsonargparse resolves by short name; :class:`lit_gmc.module.GMCModule` never branches on the
rule.

A rule maps the policy terms of a micro-batch of whole groups to a per-token loss (aggregated by the module with
the batch-wide normaliser) plus detached diagnostics. Rules that change the optimizer step (VCPO's step size,
GAC's gradient projection) override :meth:`Correction.before_step` / :meth:`Correction.after_step`, and rules with
state across updates (GAC's previous gradient, GMC's running delay moments) :meth:`Correction.state_dict`; the
module checkpoints it. The math lives in :mod:`lit_gmc.objectives` and :mod:`lit_gmc.baselines`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_args

import torch
from torch import Tensor

from lit_gmc import objectives as O

AGGREGATIONS = get_args(O.Aggregation)  # ("seq_sum_over_T", "token_mean", "seq_mean_token_mean")


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
        grad_norms_sq: ``(n,)`` exact ``||grad_theta log pi_theta(y_i)||^2`` per row, filled only for rules that
            set ``needs_grad_norms`` (VCPO's baseline); ``None`` otherwise.
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


def positive_problem(name: str, value: float) -> list[str]:
    """``["name=value must be finite and > 0"]`` unless it is; the check every threshold shares."""
    return [] if value > 0 and math.isfinite(value) else [f"{name}={value} must be finite and > 0"]


def aggregation_problem(aggregation: str | None) -> list[str]:
    """A problem line unless ``aggregation`` is one of :data:`AGGREGATIONS` (or None: the rule's own)."""
    if aggregation is None or aggregation in AGGREGATIONS:
        return []
    return [f"aggregation={aggregation!r} is not one of {', '.join(AGGREGATIONS)}"]


class Correction(ABC):
    """Base of the off-policy rules; a subclass is one rule (``--model.correction <ClassName>``).

    A subclass takes only its own options, each documented in its docstring's ``Args`` (that becomes ``--help``),
    checks them in a static ``option_problems`` named like its init args (the CLI reports every bad option of a run
    at once through it) and calls ``super().__init__(aggregation or <its authors' aggregation>)``. A rule's
    ``aggregation`` option defaults to ``None`` rather than its value: jsonargparse carries the options a new
    ``--model.correction`` shares with the previous one over to it, and a default written out would then replace
    the new rule's own. A rule with one threshold names it in ``threshold_option``, and it is logged every update.

    Args:
        aggregation: ``seq_sum_over_T`` (the paper's ``1/(T B G)``), ``token_mean`` or ``seq_mean_token_mean``.
    """

    needs_grad_norms: ClassVar[bool] = False
    """The rule reads ``PolicyTerms.grad_norms_sq``; the module then computes them (costly: one extra backward per
    trajectory), so only rules that need them ask."""

    threshold_option: ClassVar[str | None] = None
    """The option logged as ``correction/eps`` at every update (``"clip"``, ``"c"``...); None for a rule without."""

    def __init__(self, aggregation: O.Aggregation) -> None:
        self.aggregation = aggregation

    def __repr__(self) -> str:
        """``GMC(cap=0.28, aggregation='seq_sum_over_T')``: the class and its plain options (how hparams show it)."""
        options = {k: v for k, v in vars(self).items() if not k.startswith("_") and isinstance(v, (int, float, str))}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in options.items())})"

    @abstractmethod
    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        """The per-token loss and diagnostics of one micro-batch."""

    @property
    def threshold(self) -> float | None:
        """This update's threshold, logged as ``correction/eps``: the value of :attr:`threshold_option`."""
        return None if self.threshold_option is None else getattr(self, self.threshold_option)

    def begin_update(self, delays: Tensor, total_updates: int) -> None:
        """Called once per update, in order, before its loss, with the ``(n,)`` delays of the whole batch.

        ``total_updates`` is the planned number of updates (``--trainer.max_steps``).
        """
        del delays, total_updates

    def before_step(
        self, parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, stats: dict[str, Tensor]
    ) -> dict[str, float]:
        """Adjust gradients or step size before clipping and the optimizer step; returns scalars to log."""
        del parameters, optimizer, stats
        return {}

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Undo any temporary change of :meth:`before_step` (e.g. restore the learning rate)."""
        del optimizer

    def state_dict(self) -> dict[str, Any]:
        """State carried across updates, saved in checkpoints (plain containers and tensors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        del state

    @staticmethod
    def option_problems(aggregation: str | None) -> list[str]:
        """Every problem with the options, one line each, named like the init args."""
        return aggregation_problem(aggregation)


def trajectory_output(
    terms: PolicyTerms, coefficients: Tensor, advantages: Tensor, log_rho: Tensor
) -> CorrectionOutput:
    """The output of a trajectory-level rule: surrogate ``-sg(c_i A_i) log pi_theta(y_i)`` per token."""
    loss = O.surrogate_token_loss(coefficients * advantages, terms.token_logprobs, terms.mask)  # (n, L)
    return CorrectionOutput(loss, log_rho.detach(), coefficients.detach(), advantages.detach())

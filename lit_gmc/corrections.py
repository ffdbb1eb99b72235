"""The off-policy rule as a component: the :class:`Correction` base class and what a rule sees and returns.

A rule is one class in one file of :mod:`lit_gmc.rules`: its choice of advantages, coefficients and token loss from
:mod:`lit_gmc.objectives`, its one threshold option, its authors' aggregation, and the step hooks it needs.
:class:`lit_gmc.module.GMCModule` never branches on the rule, and checkpoints its :meth:`Correction.state_dict`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_args

import torch
from torch import Tensor

from lit_gmc import objectives as O
from lit_gmc.options import check_options

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


class Correction:
    """Base of the off-policy rules; a subclass is one rule (``--model.correction <ClassName>``).

    Its defaults are the paper's plain estimator (eq. 2): coefficients ``rho_i``, leave-one-out advantages, the
    surrogate token loss; a rule overrides the ones it changes (or ``__call__`` as a whole).

    A rule's ``__init__`` takes only its own options (its ``Args`` become ``--help``) and passes them here, to be
    checked at once (:meth:`option_problems`) and set as attributes. Its ``aggregation`` defaults to ``None``
    (:attr:`default_aggregation`): jsonargparse carries shared options over to a new ``--model.correction``, and a
    default written out would replace the new rule's own.

    Args:
        aggregation: ``seq_sum_over_T`` (the paper's ``1/(T B G)``), ``token_mean`` or ``seq_mean_token_mean``;
            ``null``: the rule's authors' own.
    """

    threshold_option: ClassVar[str | None] = None
    """The rule's one threshold (``"cap"``, ``"clip"``, ``"c"``...): checked finite and > 0, logged as
    ``correction/eps`` at every update; None for a rule without."""

    positive_options: ClassVar[tuple[str, ...]] = ()
    """Its other options that must be finite and > 0 (GSPO's ``eps_low``); a rule with both ``low`` and ``high``
    keeps ratios in that band, so ``low < high`` is checked too."""

    default_aggregation: ClassVar[O.Aggregation] = "seq_sum_over_T"
    """The aggregation its authors use, taken when ``aggregation`` is None."""

    couples_groups: ClassVar[bool] = False
    """The loss of a call is not the sum of its groups' own losses (a mask or normaliser over the whole call, as
    M2PO's): the estimator lab then calls the rule once per group, its unit of one update."""

    needs_grad_norms: ClassVar[bool] = False
    """The rule reads ``PolicyTerms.grad_norms_sq``; the module then computes them (costly: one extra backward per
    trajectory), so only rules that need them ask."""

    def __init__(self, aggregation: O.Aggregation | None = None, **options: Any) -> None:
        own = inspect.signature(type(self)).parameters  # a rule passing **options on (GRPO) still names its own
        foreign = [f"{name} is not an option of {type(self).__name__}" for name in options if name not in own]
        check_options(type(self).__name__, foreign + self.option_problems(aggregation=aggregation, **options))
        self.aggregation = aggregation or self.default_aggregation
        for name, value in options.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        """``GMC(aggregation='seq_sum_over_T', cap=0.28)``: the class and its plain options (how hparams show it)."""
        options = {k: v for k, v in vars(self).items() if not k.startswith("_") and isinstance(v, (int, float, str))}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in options.items())})"

    @classmethod
    def option_problems(cls, aggregation: str | None = None, **options: Any) -> list[str]:
        """Every problem with the options, one line each, named like the init args.

        The threshold and :attr:`positive_options` finite and > 0, a band ``low < high``, one of :data:`AGGREGATIONS`;
        a rule with further options extends this.
        """
        names = [name for name in dict.fromkeys((cls.threshold_option, *cls.positive_options)) if name is not None]
        problems = [line for name in names if options.get(name) is not None
                    for line in positive_problem(name, options[name])]  # fmt: skip
        if not problems and {"low", "high"} <= set(options) and not options["low"] < options["high"]:
            problems.append(f"low={options['low']} must be < high={options['high']}")
        return problems + aggregation_problem(aggregation)

    @property
    def threshold(self) -> float | None:
        """This update's threshold, logged as ``correction/eps``: the value of :attr:`threshold_option`."""
        return None if self.threshold_option is None else getattr(self, self.threshold_option)

    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        """The per-token loss and diagnostics of one micro-batch, from the rule's three choices below."""
        log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask).detach()  # (n,)
        advantages = self.advantages(terms, log_rho).detach()  # (n,)
        coefficients = self.coefficients(terms, log_rho).detach()  # (n,)
        token_loss, extra = self.token_loss(terms, coefficients, advantages)  # (n, L)
        return CorrectionOutput(token_loss, log_rho, coefficients, advantages, extra)

    def advantages(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        """``(n,)`` advantages: leave-one-out (the paper's, for TIC and GMC) unless the rule chooses others."""
        del log_rho
        return O.leave_one_out_advantages(terms.rewards, terms.group_size)

    def coefficients(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        """``(n,)`` per-trajectory coefficients ``c_i`` (a token-level rule's: the ratio it reports); ``rho_i`` here."""
        del terms
        return O.is_coefficients(log_rho)

    def token_loss(
        self, terms: PolicyTerms, coefficients: Tensor, advantages: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(n, L)`` loss and detached extras to log: the surrogate ``-sg(c_i A_i) log pi_theta(y_i)`` by default."""
        return O.surrogate_token_loss(coefficients * advantages, terms.token_logprobs, terms.mask), {}

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

"""GMC-GRPO, the paper's rule (eq. 9 and 12), with its optional Corollary-1 cap schedule."""

from __future__ import annotations

import math
from typing import Any, Literal

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction, PolicyTerms, aggregation_problem, positive_problem
from lit_gmc.delays import RunningDelayMoments


class GMC(Correction):
    """GMC-GRPO: ``rho_hat_i = rho_i / max(1, rho_bar / (1 + cap))``, one constant factor per group (Remark 7).

    Leave-one-out advantages, the surrogate ``-sg(rho_hat_i A_i) log pi_theta(y_i)``.

    Args:
        cap: ``eps`` of the ``1 + eps`` cap on each group's mean ratio (the paper's 0.28); unused with
            ``cap_schedule: corollary1``.
        cap_schedule: ``constant`` (``cap`` at every update, as in the paper's experiments) or ``corollary1``
            (:func:`~lit_gmc.objectives.corollary1_eps`): ``eps_n = clip(cap_scale * tau_bar_4^(1/7) * N^(-3/14),
            cap_min, cap_max)``, ``N = --trainer.max_steps``.
        cap_scale: ``c`` of ``corollary1``; 0.375 gives the paper's 0.28 at the tiny default (delay 8, 1,000 updates).
        cap_min: Lower clip of ``corollary1`` (on-policy data would otherwise get ``eps = 0``).
        cap_max: Upper clip of ``corollary1``.
        aggregation: Loss aggregation; ``null``: the paper's ``seq_sum_over_T`` (``1/(T B G)``).
    """

    threshold_option = "cap"

    def __init__(
        self,
        cap: float = 0.28,
        cap_schedule: Literal["constant", "corollary1"] = "constant",
        cap_scale: float = 0.375,
        cap_min: float = 0.05,
        cap_max: float = 2.0,
        aggregation: O.Aggregation | None = None,
    ) -> None:
        super().__init__(aggregation, cap=cap, cap_schedule=cap_schedule, cap_scale=cap_scale, cap_min=cap_min,
                         cap_max=cap_max)  # fmt: skip
        self.moments = RunningDelayMoments() if cap_schedule == "corollary1" else None
        self._current = cap  # this update's cap: `cap`, or corollary1's value set by begin_update

    @staticmethod
    def option_problems(  # type: ignore[override]
        cap: float, cap_schedule: str, cap_scale: float, cap_min: float, cap_max: float, aggregation: str | None
    ) -> list[str]:
        """Every problem with GMC's options, one line each."""
        problems = [f"{problem} (an infinite cap turns GMC into plain IS)" for problem in positive_problem("cap", cap)]
        if cap_schedule not in ("constant", "corollary1"):
            problems.append(f"cap_schedule={cap_schedule!r} is not one of constant, corollary1")
        problems += positive_problem("cap_scale", cap_scale)
        if not cap_min > 0:
            problems.append(f"cap_min={cap_min} must be > 0")
        if not (cap_max >= cap_min and math.isfinite(cap_max)):
            problems.append(f"cap_max={cap_max} must be finite and >= cap_min={cap_min}")
        return problems + aggregation_problem(aggregation)

    @property
    def threshold(self) -> float:
        """This update's cap."""
        return self._current

    @override
    def begin_update(self, delays: Tensor, total_updates: int) -> None:
        """With ``corollary1``: add this update's delays to the running moments, then set its cap."""
        if self.moments is None:
            return
        if total_updates < 1:
            raise ValueError(f"--model.correction.cap_schedule=corollary1 needs the planned number of updates N: "
                             f"set --trainer.max_steps (got {total_updates})")  # fmt: skip
        self.moments.update(delays)
        self._current = O.corollary1_eps(self.moments.tau4, total_updates, self.cap_scale, self.cap_min, self.cap_max)

    @override
    def coefficients(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return O.gmc_coefficients(log_rho, terms.group_size, self._current)

    @override
    def state_dict(self) -> dict[str, Any]:
        """``corollary1``'s running delay moments (nothing for a constant cap)."""
        return {} if self.moments is None else {"moments": self.moments.state_dict()}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if self.moments is not None and "moments" in state:
            self.moments.load_state_dict(state["moments"])

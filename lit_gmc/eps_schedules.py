"""Schedules of the correction threshold ``eps`` (the ``1 + eps`` cap of GMC; ``constant`` serves every rule).

``constant`` keeps the configured ``eps`` (the paper's 0.28). ``corollary1`` goes beyond the paper's
experiments and follows its theory instead: Corollary 1 gives the best threshold as
``eps* = Theta(tau_bar_4^(1/7) N^(-3/14))``, where ``tau_bar_4`` is the averaged fourth delay moment
(eq. 11) and ``N`` the planned number of updates. The schedule plugs the running estimate of
``tau_bar_4`` into that rate with a constant ``c`` and clips the result to ``[eps_min, eps_max]``:

    eps_n = clip(c * tau_bar_4(n)^(1/7) * N^(-3/14), eps_min, eps_max)

``tau_bar_4(n)`` averages the updates ``0..n`` (the current one included), so the first update of a
run with a filled delay queue already sees its own delay.

``corollary1`` is for GMC only, and ``lit_gmc.module.validate_model_args`` refuses it for every other
``--model.correction``, TIC included. The rate minimises the paper's convergence bound for GMC, and the
bias term in that bound is the mass the group cap removes,

    (1/G) sum_i (rho_i - rho_hat_i) = max(0, rho_bar - (1 + eps)),

the excess of the group's mean ratio over ``1 + eps``. TIC removes a different mass,
``(1/G) sum_i rho_i 1{rho_i > 1 + eps}``: whole ratios of single trajectories above the cap, not the
excess of a group mean. It is not bounded by the group-mass term, so the exponents ``1/7`` and ``-3/14``
obtained from that term need not hold for TIC, and this project has not derived the rate the TIC analysis
would give. Rather than drive TIC with a schedule that has no theory behind it, the option is refused
with a message naming ``--model.eps_schedule`` and ``--model.correction``.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from torch import Tensor

from lit_gmc.delays import RunningDelayMoments

EPS_SCHEDULES = ("constant", "corollary1")


def corollary1_eps(tau4: float, total_updates: int, c: float, eps_min: float, eps_max: float) -> float:
    """``clip(c * tau4^(1/7) * N^(-3/14), eps_min, eps_max)`` with ``N = total_updates``.

    Args:
        tau4: Averaged fourth delay moment ``tau_bar_4 >= 0``.
        total_updates: Planned number of optimizer updates ``N >= 1``.
        c: Constant of the ``Theta`` (> 0).
        eps_min: Lower clip (> 0): on-policy data (``tau4 = 0``) would otherwise give ``eps = 0``.
        eps_max: Upper clip (>= eps_min).
    """
    if tau4 < 0:
        raise ValueError(f"tau4 must be >= 0, got {tau4}")
    if total_updates < 1:
        raise ValueError(f"total_updates must be >= 1, got {total_updates}")
    problems = validate_eps_schedule_args(eps_schedule="corollary1", eps_scale=c, eps_min=eps_min, eps_max=eps_max)
    if problems:
        raise ValueError("; ".join(problems))
    raw = c * tau4 ** (1.0 / 7.0) * total_updates ** (-3.0 / 14.0)
    return min(max(raw, eps_min), eps_max)


def validate_eps_schedule_args(*, eps_schedule: str, eps_scale: float, eps_min: float, eps_max: float) -> list[str]:
    """Every problem with the threshold-schedule options, one line each, named by their CLI flags."""
    problems = []
    if eps_schedule not in EPS_SCHEDULES:
        problems.append(f"--model.eps_schedule={eps_schedule!r} is not one of {', '.join(EPS_SCHEDULES)}")
    if not (eps_scale > 0 and math.isfinite(eps_scale)):
        problems.append(f"--model.eps_scale={eps_scale} must be finite and > 0")
    if not eps_min > 0:
        problems.append(f"--model.eps_min={eps_min} must be > 0")
    if not (eps_max >= eps_min and math.isfinite(eps_max)):
        problems.append(f"--model.eps_max={eps_max} must be finite and >= --model.eps_min={eps_min}")
    return problems


class EpsSchedule(Protocol):
    """Gives the threshold of each update from the delays of the batch it consumes."""

    def next_eps(self, delays: Tensor, total_updates: int) -> float:
        """Threshold for the update whose trajectories have ``delays``; called once per update, in order."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


class ConstantEps:
    """The configured ``eps`` at every update."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def next_eps(self, delays: Tensor, total_updates: int) -> float:
        """The configured ``eps``, whatever the delays."""
        return self.eps

    def state_dict(self) -> dict[str, Any]:
        """Nothing to keep."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


class Corollary1Eps:
    """``eps_n`` from the running ``tau_bar_4`` (see the module docstring); the moments are checkpointed.

    Args:
        c: Constant of the ``Theta`` in Corollary 1.
        eps_min: Lower clip.
        eps_max: Upper clip.
    """

    def __init__(self, c: float, eps_min: float, eps_max: float) -> None:
        problems = validate_eps_schedule_args(eps_schedule="corollary1", eps_scale=c, eps_min=eps_min, eps_max=eps_max)
        if problems:
            raise ValueError("; ".join(problems))
        self.c, self.eps_min, self.eps_max = c, eps_min, eps_max
        self.moments = RunningDelayMoments()

    def next_eps(self, delays: Tensor, total_updates: int) -> float:
        """Add this update's delays to the running moments, then ``eps_n`` from ``tau_bar_4`` and ``N``."""
        if total_updates < 1:
            raise ValueError(f"--model.eps_schedule=corollary1 needs the planned number of updates N: set "
                             f"--trainer.max_steps (got {total_updates})")  # fmt: skip
        self.moments.update(delays)
        return corollary1_eps(self.moments.tau4, total_updates, self.c, self.eps_min, self.eps_max)

    def state_dict(self) -> dict[str, Any]:
        """The running delay moments."""
        return {"moments": self.moments.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.moments.load_state_dict(state["moments"])


def build_eps_schedule(name: str, *, eps: float, eps_scale: float, eps_min: float, eps_max: float) -> EpsSchedule:
    """The schedule called ``name`` (one of :data:`EPS_SCHEDULES`)."""
    if name == "constant":
        return ConstantEps(eps)
    if name == "corollary1":
        return Corollary1Eps(eps_scale, eps_min, eps_max)
    raise ValueError(f"unknown eps schedule {name!r}; expected one of {', '.join(EPS_SCHEDULES)}")

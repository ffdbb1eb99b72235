"""Corollary 1's threshold schedule for GMC's cap (``--model.correction.cap_schedule corollary1``).

The paper's experiments keep the cap constant (0.28); ``corollary1`` plugs the running averaged fourth delay moment
(eq. 11, this update included) into the optimal rate: ``eps_n = clip(c * tau_bar_4(n)^(1/7) * N^(-3/14), cap_min,
cap_max)``. GMC's alone: the rate comes from a bound whose bias term is the mass the group cap removes, which does
not bound what TIC's cap removes, and the other rules' thresholds are not this cap at all.
"""

from __future__ import annotations

import math

from lit_gmc.corrections import positive_problem


def corollary1_problems(cap_scale: float, cap_min: float, cap_max: float) -> list[str]:
    """Every problem with the schedule's options, one line each, named like GMC's init args."""
    problems = positive_problem("cap_scale", cap_scale)
    if not cap_min > 0:
        problems.append(f"cap_min={cap_min} must be > 0")
    if not (cap_max >= cap_min and math.isfinite(cap_max)):
        problems.append(f"cap_max={cap_max} must be finite and >= cap_min={cap_min}")
    return problems


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
    problems = corollary1_problems(c, eps_min, eps_max)
    if problems:
        raise ValueError("; ".join(problems))
    raw = c * tau4 ** (1.0 / 7.0) * total_updates ** (-3.0 / 14.0)
    return min(max(raw, eps_min), eps_max)

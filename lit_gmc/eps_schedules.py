"""Corollary 1's threshold schedule for GMC's cap (``--model.correction.cap_schedule corollary1``).

The paper's experiments keep the cap constant (0.28). ``corollary1`` follows its theory instead: Corollary 1 gives
the best threshold as ``eps* = Theta(tau_bar_4^(1/7) N^(-3/14))``, where ``tau_bar_4`` is the averaged fourth delay
moment (eq. 11) and ``N`` the planned number of updates. The schedule plugs the running estimate of ``tau_bar_4``
into that rate with a constant ``c`` and clips the result to ``[cap_min, cap_max]``:

    eps_n = clip(c * tau_bar_4(n)^(1/7) * N^(-3/14), cap_min, cap_max)

``tau_bar_4(n)`` averages the updates ``0..n`` (the current one included), so the first update of a run with a
filled delay queue already sees its own delay.

It is an option of :class:`lit_gmc.rules.GMC` only. The rate minimises the paper's convergence bound for GMC, and
the bias term in that bound is the mass the group cap removes,

    (1/G) sum_i (rho_i - rho_hat_i) = max(0, rho_bar - (1 + eps)),

the excess of the group's mean ratio over ``1 + eps``. TIC removes a different mass,
``(1/G) sum_i rho_i 1{rho_i > 1 + eps}``: whole ratios of single trajectories above the cap, not the excess of a
group mean. It is not bounded by the group-mass term, so the exponents ``1/7`` and ``-3/14`` obtained from that
term need not hold for TIC, and this project has not derived the rate the TIC analysis would give; the other rules'
thresholds are not that cap at all. So no other rule has the option, and the CLI refuses it by name.
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

"""Math of the baselines beside GMC (DESIGN.md §8): small pure functions, each tested on hand-made tensors.

The rules themselves are classes in :mod:`lit_gmc.rules` (VCPO, GAC, A-3PO, CISPO, TIS); what they need beyond
:mod:`lit_gmc.objectives` lives here: the VCPO baseline and ESS factor, GAC's projection coefficient, A-3PO's
proximal log-probs and behaviour weight, and the truncated token-ratio loss of CISPO and TIS.

Where this code fills gaps the sources leave:
- GAC's projection is the reconstruction of DESIGN.md §8, not the authors' code (see :func:`gac_shift`).
- A-3PO and TIS use the group-centred advantage of this project's vanilla GRPO, so that each differs from
  GRPO only by its correction (A-3PO is then exactly GRPO whenever ``tau <= 1``).
- TIS is written in its policy-gradient form with the current policy as the trainer side, because the
  learner has no separate recompute of the behaviour version to put in a PPO ratio.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lit_gmc import objectives as O

MIN_REWARD_STD = 1e-8  # below this a group's rewards tie, and VCPO/CISPO skip the std division
A3PO_BEHAVIOR_CAP = 5.0  # AReaL's behav_imp_weight_cap: A-3PO reports (and, when asked, masks) tokens above it


def group_normalized_advantages(rewards: Tensor, baselines: Tensor, group_size: int) -> Tensor:
    """``A_i = (r_i - b_g) / sigma_g`` with the population std of the group's rewards. Returns ``(N,)``.

    A group whose rewards tie exactly gets exactly 0: its baseline (an average of the group's rewards, as in
    every rule here) is the tied value and ``sigma_g = 0``, but rounding can leave both a few ulps off, and the
    division would then blow ``~1e-8 / ~1e-8`` up to ``+-1`` (CISPO on eight rewards of 0.7, before this
    check). Where ``sigma_g <= 1e-8`` but the rewards differ, the division is skipped: ``r_i - b_g``, never NaN.
    """
    r = O.per_group(rewards, group_size, "rewards")  # (B, G)
    if baselines.shape != (r.shape[0],):
        raise ValueError(f"baselines must be ({r.shape[0]},), one per group, got {tuple(baselines.shape)}")
    std = r.std(-1, unbiased=False, keepdim=True)  # (B, 1)
    centred = r - baselines[:, None]  # (B, G)
    spread = std > MIN_REWARD_STD  # (B, 1)
    adv = torch.where(spread, centred / std.clamp(min=MIN_REWARD_STD), centred)  # (B, G)
    return adv.masked_fill(O.tied_groups(r), 0.0).reshape(-1)  # (N,)


def vcpo_baseline(log_w: Tensor, grad_norms_sq: Tensor, rewards: Tensor, group_size: int) -> Tensor:
    """VCPO's per-group off-policy minimum-variance baseline ``b* = sum_i W_i r_i / sum_i W_i``. Returns ``(B,)``.

    ``W_i = w_i^2 ||grad log pi_theta(y_i)||^2`` with the *unclipped* sequence ratio ``w_i = exp(log_w_i)``,
    normalised in log space so that a huge ratio cannot overflow. A group whose weights are all zero (every
    gradient norm zero) has no preferred response and falls back to the plain mean reward. A group whose
    rewards tie exactly gets that reward itself, so ``r_i - b* = 0`` exactly (the rounded weighted sum is
    generally a few ulps off it, even for rewards of 1).
    """
    lw = O.per_group(log_w.detach(), group_size, "log_w")  # (B, G)
    norms = O.per_group(grad_norms_sq.detach().to(lw.dtype), group_size, "grad_norms_sq")  # (B, G)
    if (norms < 0).any():
        raise ValueError(f"grad_norms_sq must be >= 0, got min {norms.min().item()}")
    log_weight = 2.0 * lw + torch.log(norms)  # (B, G), -inf where the norm is 0
    dead = torch.isneginf(log_weight).all(-1, keepdim=True)  # (B, 1)
    log_weight = torch.where(dead, torch.zeros_like(log_weight), log_weight)  # (B, G)
    r = O.per_group(rewards, group_size, "rewards").to(lw.dtype)  # (B, G)
    weighted = (torch.softmax(log_weight, dim=-1) * r).sum(-1)  # (B,)
    return torch.where(O.tied_groups(r)[:, 0], r[:, 0], weighted)  # (B,)


def ess_step_factor(log_w: Tensor) -> Tensor:
    """VCPO's step-size factor ``sqrt(min(1, ESS / n))`` with ``ESS = (sum w)^2 / sum w^2`` over all ``n`` rows.

    ``w`` is the unclipped sequence ratio, taken in log space (float64). Returns a 0-dim tensor in
    ``[1/sqrt(n), 1]``.
    """
    lw = log_w.detach().double().reshape(-1)  # (n,)
    if lw.numel() == 0:
        raise ValueError("ess_step_factor needs at least one log-ratio")
    ess = torch.exp(2.0 * torch.logsumexp(lw, 0) - torch.logsumexp(2.0 * lw, 0))
    return torch.sqrt((ess / lw.numel()).clamp(max=1.0))


def gac_shift(
    dot: float, norm_sq: float, prev_norm_sq: float, low: float = 0.05, high: float = 0.30
) -> tuple[float, float]:
    """GAC's projection as a multiple of the previous gradient, ``g' = g - shift * g_prev``: ``(cosine, shift)``.

    RECONSTRUCTION (DESIGN.md §8): the exact rule of Xu et al. 2026 was not public when the design was
    written. With ``c = cos(g, g_prev)``:
    - ``c <= low`` (0.05): unchanged (``shift = 0``);
    - ``low < c <= high`` (0.30): the component along ``g_prev`` shrinks until ``cos(g', g_prev) = low``,
      the orthogonal part untouched;
    - ``c > high``: the component along ``g_prev`` is removed (``cos(g', g_prev) = 0``).
    Inputs are the global ``g . g_prev``, ``||g||^2`` and ``||g_prev||^2``; a zero gradient is left alone.
    """
    if norm_sq <= 0.0 or prev_norm_sq <= 0.0:
        return 0.0, 0.0
    cosine = dot / math.sqrt(norm_sq * prev_norm_sq)
    if cosine <= low:
        return cosine, 0.0
    along = dot / prev_norm_sq  # g = along * g_prev + g_perp
    if cosine > high:
        return cosine, along
    perp = math.sqrt(max(norm_sq - dot * along, 0.0))  # ||g_perp||
    # Keep a component t * g_prev with t ||g_prev|| / sqrt(t^2 ||g_prev||^2 + perp^2) = low.
    kept = low * perp / math.sqrt((1.0 - low * low) * prev_norm_sq)
    return cosine, along - kept


def gradient_dot_and_norms(g: Tensor, prev: Tensor | None) -> Tensor:
    """``(g . prev, ||g||^2, ||prev||^2)`` of one tensor pair as float64; a missing ``prev`` counts as zero."""
    a = g.to(torch.promote_types(g.dtype, torch.float32))  # bf16 gradients are summed in float32
    if prev is None:
        zero = a.new_zeros(())
        return torch.stack([zero, a.square().sum(), zero]).double()
    b = prev.to(a.dtype)
    return torch.stack([(a * b).sum(), a.square().sum(), b.square().sum()]).double()


def a3po_alpha(delays: Tensor) -> Tensor:
    """A-3PO's interpolation weight ``alpha = 1 / max(1, tau)`` per row. Returns ``(n,)`` float64."""
    if (delays < 0).any():
        raise ValueError(f"delays must be >= 0, got min {int(delays.min())}")
    return 1.0 / delays.clamp(min=1).double()


def loglinear_proximal_logprobs(token_logprobs: Tensor, behavior_logprobs: Tensor, alpha: Tensor) -> Tensor:
    """``log pi_prox = alpha l + (1 - alpha) sg(log pi_theta)`` per token (AReaL's ``loglinear``). ``(n, L)``.

    With ``alpha = 1`` this is ``l`` exactly (``0 * x`` adds nothing), so A-3PO reduces to PPO-clip bit for bit.
    """
    a = alpha.to(token_logprobs.dtype)[:, None]  # (n, 1)
    return a * behavior_logprobs + (1.0 - a) * token_logprobs.detach()  # (n, L)


def a3po_behavior_weight(log_weight: Tensor, mask: Tensor, cap: float | None) -> tuple[Tensor, Tensor]:
    """A-3PO's outer factor ``pi_prox / pi_b`` per token, unclipped (``cap=None``) or AReaL-masked.

    ``log_weight`` is ``log pi_prox - l`` (detached). Unclipped, as the seed paper states A-3PO, the factor is
    ``exp(log_weight)``; its log is clamped at 80 only so that float32 cannot overflow to ``inf`` (``inf * 0``
    would turn a zero-advantage token into NaN), a bound of ``e^80 ~ 5.5e34`` that no cap would choose. With
    ``cap`` set, tokens whose factor exceeds it get weight 0 (AReaL's ``behav_imp_weight_cap``: masked, not
    clamped to the cap). Padding gets 0 either way.

    Returns:
        The ``(n, L)`` weights and the ``(n, L)`` mask of the real tokens kept.
    """
    if log_weight.shape != mask.shape or log_weight.dim() != 2:
        raise ValueError(f"log_weight must be (n, L) like mask, got {tuple(log_weight.shape)} and {tuple(mask.shape)}")
    if cap is not None and not cap > 0:
        raise ValueError(f"the behaviour-weight cap must be > 0, got {cap}")
    kept = mask if cap is None else mask & (log_weight <= math.log(cap))  # (n, L)
    weight = torch.exp(log_weight.clamp(max=80.0)).masked_fill(~kept, 0.0)  # (n, L)
    return weight, kept


def truncated_token_ratio_loss(
    token_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, advantages: Tensor, cap: float
) -> tuple[Tensor, Tensor]:
    """Per token ``-sg(min(r_t, cap) A_i) log pi_theta(y_t)`` with ``r_t = exp(log pi_theta(y_t) - l_t)``.

    The shared form of CISPO and TIS. Returns the ``(n, L)`` loss (zeros on padding) and the ``(n, L)``
    mask of real tokens whose ratio was truncated.
    """
    if not cap > 0:
        raise ValueError(f"the ratio cap must be > 0, got {cap}")
    log_r = (token_logprobs.detach() - behavior_logprobs).masked_fill(~mask, 0.0)  # (n, L)
    weight = torch.exp(log_r.clamp(max=math.log(cap)))  # (n, L) min(r, cap)
    coef = (weight * advantages.detach()[:, None]).detach()  # (n, L)
    return (-coef * token_logprobs).masked_fill(~mask, 0.0), (log_r > math.log(cap)) & mask

"""The rules' math as pure tensor functions, grouped by what they compute, whatever paper each comes from.

Ratios, advantages, per-sample and per-token coefficients, token losses, aggregation, step rules, diagnostics
(DESIGN.md §3 and §8). No modules, config objects, logging or device moves; shapes are checked here, thresholds by
each rule's ``option_problems``. Rows are group-major (row ``b * G + i`` is response ``i`` of group ``b``); token
tensors are ``(N, L)``, aligned with a boolean ``mask`` of real response tokens. ``log rho_i = sum_t (log
pi_theta(y_it) - l_it)`` is the trajectory log-ratio against the behaviour log-probs ``l`` the engine recorded;
``T`` is the configured maximum completion length.

Where this code departs from the papers or fills their gaps:
- Ratios are exponentiated only when bounded (GMC's is at most ``G (1 + eps)``); unclipped IS is the exception,
  kept exact because it is the unstable reference.
- The surrogate multiplies ``log pi_theta(y_i)`` by a detached coefficient, so its gradient is the estimator
  itself (eq. 4), not the gradient of a ratio objective.
- A group whose rewards tie gets advantages of exactly 0 (:func:`tied_groups`).
- GAC's projection is a reconstruction (:func:`gac_shift`), not the authors' code.
- A-3PO and TIS use vanilla GRPO's group-centred advantage, so each differs from GRPO only by its correction; TIS
  is written in its policy-gradient form, the current policy standing for the trainer side.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["seq_sum_over_T", "token_mean", "seq_mean_token_mean"]
MIN_REWARD_STD = 1e-8  # below this a group's rewards tie, and VCPO/CISPO skip the std division
A3PO_BEHAVIOR_CAP = 5.0  # AReaL's behav_imp_weight_cap: A-3PO reports (and, when asked, masks) tokens above it
LOG_RATIO_LIMIT = 80.0  # exp(80) ~ 5.5e34: a ratio reported or weighted past this bound stays finite in float32


def _check_tokens(name: str, x: Tensor, mask: Tensor) -> None:
    if x.shape != mask.shape or x.dim() != 2:
        raise ValueError(f"{name} must be (N, L) like mask, got {tuple(x.shape)} and mask {tuple(mask.shape)}")


# --- Ratios ------------------------------------------------------------------------------------------------------


def per_group(x: Tensor, group_size: int, name: str = "tensor") -> Tensor:
    """View ``(N,)`` as ``(B, G)``, naming the tensor when N is not a multiple of G."""
    if x.dim() != 1 or x.numel() % group_size != 0:
        raise ValueError(f"{name} must be (B*G,) with G={group_size}, got shape {tuple(x.shape)}")
    return x.view(-1, group_size)


def sequence_logprob(token_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``log pi(y|x) = sum_t log pi(y_t | x, y_<t)`` over real response tokens. Returns ``(N,)``."""
    _check_tokens("token_logprobs", token_logprobs, mask)
    return token_logprobs.masked_fill(~mask, 0.0).sum(-1)  # (N,)


def log_ratio(token_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Trajectory log-ratio ``log rho_i = sum_t (log pi_theta(y_it) - l_it)``. Returns ``(N,)``."""
    _check_tokens("behavior_logprobs", behavior_logprobs, mask)
    return sequence_logprob(token_logprobs, mask) - sequence_logprob(behavior_logprobs, mask)  # (N,)


def geometric_log_ratio(token_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token mean log-ratio ``(1/|y_i|) sum_t (log pi_theta(y_it) - l_it)``. Returns ``(N,)``.

    The log of the geometric mean of the token ratios (GSPO's sequence ratio, verl's ``seq_mean``); 0 for an empty
    response.
    """
    lengths = mask.sum(-1).clamp(min=1)  # (N,)
    return log_ratio(token_logprobs, behavior_logprobs, mask) / lengths  # (N,)


def group_log_mean_ratio(log_rho: Tensor, group_size: int) -> Tensor:
    """``log rho_bar_b = logsumexp_i(log rho_i) - log G``, overflow-free. Returns ``(B,)``."""
    return torch.logsumexp(per_group(log_rho, group_size, "log_rho"), dim=-1) - math.log(group_size)  # (B,)


# --- Advantages (constants: no gradient) -------------------------------------------------------------------------


def tied_groups(grouped: Tensor) -> Tensor:
    """``(B, 1)``: True where every entry of a ``(B, G)`` group equals its first exactly (NaN never ties).

    A tied group's rounded mean generally is not ``r`` (``(0.7 + 0.7 + 0.7) / 3 != 0.7`` in float32), so the
    advantage functions set tied groups to 0, lest an all-tied batch move the weights.
    """
    return (grouped == grouped[:, :1]).all(-1, keepdim=True)  # (B, 1)


def leave_one_out_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """``A_i = r_i - (1/(G-1)) sum_{j != i} r_j`` (TIC, GMC). Returns ``(N,)``; ties give exactly 0."""
    if group_size < 2:
        raise ValueError(f"leave-one-out advantages need G >= 2, got G={group_size}")
    r = per_group(rewards, group_size, "rewards")  # (B, G)
    others = (r.sum(-1, keepdim=True) - r) / (group_size - 1)  # (B, G)
    return (r - others).masked_fill(tied_groups(r), 0.0).reshape(-1)  # (N,)


def group_centered_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """``A_i = r_i - mean_j r_j`` (vanilla GRPO as the paper runs it: centred, not std-normalised). ``(N,)``."""
    r = per_group(rewards, group_size, "rewards")  # (B, G)
    return (r - r.mean(-1, keepdim=True)).masked_fill(tied_groups(r), 0.0).reshape(-1)  # (N,)


def group_normalized_advantages(rewards: Tensor, baselines: Tensor, group_size: int) -> Tensor:
    """``A_i = (r_i - b_g) / sigma_g`` with the population std of the group's rewards (VCPO, CISPO). ``(N,)``.

    A tied group gets exactly 0: rounding can leave ``b_g`` and ``sigma_g`` a few ulps off the tie, and the
    division would blow ``~1e-8 / ~1e-8`` up to ``+-1``. Where ``sigma_g <= 1e-8`` but the rewards differ, the
    division is skipped: ``r_i - b_g``, never NaN.
    """
    r = per_group(rewards, group_size, "rewards")  # (B, G)
    if baselines.shape != (r.shape[0],):
        raise ValueError(f"baselines must be ({r.shape[0]},), one per group, got {tuple(baselines.shape)}")
    std = r.std(-1, unbiased=False, keepdim=True)  # (B, 1)
    centred = r - baselines[:, None]  # (B, G)
    spread = std > MIN_REWARD_STD  # (B, 1)
    adv = torch.where(spread, centred / std.clamp(min=MIN_REWARD_STD), centred)  # (B, G)
    return adv.masked_fill(tied_groups(r), 0.0).reshape(-1)  # (N,)


def group_standardized_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """``A_i = (r_i - mean_g) / sigma_g`` (CISPO, GSPO): :func:`group_normalized_advantages` about the group's mean."""
    return group_normalized_advantages(rewards, per_group(rewards, group_size, "rewards").mean(-1), group_size)


def vcpo_baseline(log_w: Tensor, grad_norms_sq: Tensor, rewards: Tensor, group_size: int) -> Tensor:
    """VCPO's per-group off-policy minimum-variance baseline ``b* = sum_i W_i r_i / sum_i W_i``. Returns ``(B,)``.

    ``W_i = w_i^2 ||grad log pi_theta(y_i)||^2`` with the *unclipped* sequence ratio ``w_i = exp(log_w_i)``,
    normalised in log space so that a huge ratio cannot overflow. A group whose gradient norms are all zero falls
    back to its mean reward; a group whose rewards tie gets that reward, so ``r_i - b* = 0`` exactly.
    """
    lw = per_group(log_w.detach(), group_size, "log_w")  # (B, G)
    norms = per_group(grad_norms_sq.detach().to(lw.dtype), group_size, "grad_norms_sq")  # (B, G)
    if (norms < 0).any():
        raise ValueError(f"grad_norms_sq must be >= 0, got min {norms.min().item()}")
    log_weight = 2.0 * lw + torch.log(norms)  # (B, G), -inf where the norm is 0
    dead = torch.isneginf(log_weight).all(-1, keepdim=True)  # (B, 1)
    log_weight = torch.where(dead, torch.zeros_like(log_weight), log_weight)  # (B, G)
    r = per_group(rewards, group_size, "rewards").to(lw.dtype)  # (B, G)
    weighted = (torch.softmax(log_weight, dim=-1) * r).sum(-1)  # (B,)
    return torch.where(tied_groups(r)[:, 0], r[:, 0], weighted)  # (B,)


# --- Per-sample coefficients (detached) --------------------------------------------------------------------------


def gmc_coefficients(log_rho: Tensor, group_size: int, eps: float) -> Tensor:
    """Group-mass-capped ratios (eq. 9, 12): ``rho_hat_i = rho_i / max(1, rho_bar / (1 + eps))``. ``(N,)``.

    Formed as ``min(log rho_i, log_softmax_i(log rho) + log(G (1 + eps)))``, equal to ``log rho_i - max(0,
    log rho_bar - log(1 + eps))`` but never subtracting two huge numbers. Detached, because the group factor is a
    constant of the estimator (Remark 7); bounded by ``G (1 + eps)``; the group mean is ``min(rho_bar, 1 + eps)``.
    """
    log_rho = per_group(log_rho.detach(), group_size, "log_rho")  # (B, G)
    capped = torch.log_softmax(log_rho, dim=-1) + math.log(group_size * (1.0 + eps))  # (B, G)
    return torch.exp(torch.minimum(log_rho, capped)).reshape(-1)  # (N,)


def tic_coefficients(log_rho: Tensor, eps: float) -> Tensor:
    """Trajectory-level indicator clipping (eq. 35): ``rho_i * 1{rho_i <= 1 + eps}``. Returns ``(N,)``."""
    log_rho = log_rho.detach()
    cap = math.log1p(eps)
    kept = log_rho <= cap  # (N,)
    return torch.where(kept, torch.exp(log_rho.clamp(max=cap)), torch.zeros_like(log_rho))  # (N,)


def is_coefficients(log_rho: Tensor) -> Tensor:
    """Unclipped importance sampling (eq. 2): ``rho_i``. Unbounded and unstable; a reference only."""
    return torch.exp(log_rho.detach())  # (N,)


def truncated_coefficients(log_rho: Tensor, cap: float) -> Tensor:
    """Truncated trajectory ratios ``min(rho_i, cap)`` (VCPO's ``min(w_i, c)``). Returns ``(N,)``."""
    return torch.exp(log_rho.detach().clamp(max=math.log(cap)))  # (N,)


def trajectory_ratio(log_rho: Tensor) -> Tensor:
    """``rho_i`` as a token-level rule reports it (it has no trajectory weight of its own), finite in float32."""
    return torch.exp(log_rho.detach().clamp(max=LOG_RATIO_LIMIT))  # (N,)


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
    """A-3PO's per-token factor ``pi_prox / pi_b`` from ``log_weight = log pi_prox - l``: unclipped, or masked.

    Unclipped (``cap=None``, as the seed paper states A-3PO), its log is clamped at 80 only so that float32 cannot
    overflow (``inf * 0`` would turn a zero-advantage token into NaN). With ``cap``, tokens above it get weight 0
    (AReaL's ``behav_imp_weight_cap``: masked, not clamped). Padding gets 0 either way.

    Returns:
        The ``(n, L)`` weights and the ``(n, L)`` mask of the real tokens kept.
    """
    if log_weight.shape != mask.shape or log_weight.dim() != 2:
        raise ValueError(f"log_weight must be (n, L) like mask, got {tuple(log_weight.shape)} and {tuple(mask.shape)}")
    kept = mask if cap is None else mask & (log_weight <= math.log(cap))  # (n, L)
    weight = torch.exp(log_weight.clamp(max=LOG_RATIO_LIMIT)).masked_fill(~kept, 0.0)  # (n, L)
    return weight, kept


def band_ratio(log_ratio_values: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """A ratio kept where it lies inside ``[low, high]`` and 0 outside (masked IS, rejection), elementwise.

    IcePop per token, SeqMIS/GeoMIS per sequence; the bounds are inclusive. Takes log-ratios of any shape; returns
    the weights ``exp(log r) 1{low <= r <= high}`` and the boolean mask of the kept entries.
    """
    kept = (log_ratio_values >= math.log(low)) & (log_ratio_values <= math.log(high))
    weights = torch.exp(log_ratio_values.detach().clamp(max=math.log(high))).masked_fill(~kept, 0.0)
    return weights, kept


def kept_ratio(log_r: Tensor, keep: Tensor) -> Tensor:
    """``r_t = exp(log r_t)`` where ``keep``, 0 elsewhere (M2PO, DPPO); the log-ratio clamped at 80. ``(n, L)``."""
    return torch.exp(log_r.detach().clamp(max=LOG_RATIO_LIMIT)).masked_fill(~keep, 0.0)


def m2po_keep_mask(log_r: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """M2PO's token mask (Zheng et al. 2025, Algorithm 1): the real tokens kept, ``(n, L)``.

    The tokens kept once the ones of largest ``(log r)^2`` are dropped, one at a time, until the mean ``(log r)^2`` of
    those left is ``<= threshold``.

    Over every real token of the call (AReaL's set; the paper's "trust-region tokens"), largest first, ties in row
    order (the first of equal values goes first, as ``argmax``); all are dropped when no non-empty remainder meets
    the threshold. Computed with sorted suffix means in float64, not a loop.
    """
    _check_tokens("log_r", log_r, mask)
    second = log_r.detach().double()[mask].square()  # (m,)
    order = torch.sort(second, descending=True, stable=True).indices  # (m,)
    ranked = second[order]  # (m,) largest first
    tail_sums = ranked.flip(0).cumsum(0).flip(0)  # (m,) sum of ranked[k:], added smallest first
    tail_means = tail_sums / torch.arange(ranked.numel(), 0, -1, dtype=torch.float64)  # (m,)
    meets = (tail_means <= threshold).nonzero()
    dropped_count = int(meets[0]) if meets.numel() else ranked.numel()
    kept_tokens = torch.ones_like(second, dtype=torch.bool)
    kept_tokens[order[:dropped_count]] = False
    keep = torch.zeros_like(mask)
    keep[mask] = kept_tokens
    return keep  # (n, L)


def dppo_keep_mask(
    token_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, advantages: Tensor, eps_low: float,
    eps_high: float,
) -> tuple[Tensor, Tensor]:
    """DPPO's Binary-TV trust region (Qi et al. 2026; prime-rl's default loss): the masks of tokens kept and dropped.

    Tokens whose probability already moved past the band in the direction their advantage pushes get no gradient.

    With ``p = pi_theta(y_t)``, ``q = exp(l_t)``: a token of ``A > 0`` is dropped when ``p - q > eps_high``, any other
    when ``p - q < -eps_low`` (a probability difference, not a ratio). Returns the ``(n, L)`` mask of real tokens
    kept and the ``(n, L)`` mask of those dropped.
    """
    _check_tokens("behavior_logprobs", behavior_logprobs, mask)
    moved = torch.exp(token_logprobs.detach()) - torch.exp(behavior_logprobs)  # (n, L)
    pushed_up = advantages.detach()[:, None] > 0  # (n, 1)
    dropped = torch.where(pushed_up, moved > eps_high, moved < -eps_low) & mask  # (n, L)
    return mask & ~dropped, dropped


# --- Token losses ------------------------------------------------------------------------------------------------


def surrogate_token_loss(coef_times_adv: Tensor, token_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token surrogate ``-sg(c_i A_i) log pi_theta(y_it)``, ``(N, L)`` with zeros on padding.

    Summed over tokens, its gradient is ``-c_i A_i grad log pi_theta(y_i)``.
    """
    _check_tokens("token_logprobs", token_logprobs, mask)
    weights = coef_times_adv.detach()[:, None]  # (N, 1)
    return (-weights * token_logprobs).masked_fill(~mask, 0.0)  # (N, L)


def ppo_clip_token_loss(
    token_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, advantages: Tensor, eps: float
) -> Tensor:
    """Two-sided PPO clip on the token ratio (vanilla GRPO, Shao et al. 2024). ``(N, L)``, zeros on padding.

    ``loss_t = -min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)`` with ``r_t = exp(log pi_theta - l_t)``; the gradient
    flows through ``r_t``. The log-ratio is clamped at 80: above it the clipped branch is active for positive
    advantages, and the loss is already astronomically large for negative ones.
    """
    _check_tokens("behavior_logprobs", behavior_logprobs, mask)
    log_r = (token_logprobs - behavior_logprobs).masked_fill(~mask, 0.0).clamp(max=LOG_RATIO_LIMIT)  # (N, L)
    ratio = torch.exp(log_r)  # (N, L)
    adv = advantages.detach()[:, None]  # (N, 1)
    unclipped = ratio * adv  # (N, L)
    clipped = ratio.clamp(1.0 - eps, 1.0 + eps) * adv  # (N, L)
    return (-torch.minimum(unclipped, clipped)).masked_fill(~mask, 0.0)  # (N, L)


def token_policy_gradient_loss(weights: Tensor, advantages: Tensor, token_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``-sg(w_it A_i) log pi_theta(y_it)``: a policy-gradient loss with detached per-token weights ``w``. ``(n, L)``.

    The form every rule here takes when its gradient is ``w_t A_i grad log pi_theta(y_t)`` (CISPO, TIS, IcePop, M2PO,
    DPPO): the weight never carries gradient, so a huge ratio cannot turn into a huge derivative of ``exp``.
    """
    _check_tokens("weights", weights, mask)
    coef = (weights * advantages.detach()[:, None]).detach()  # (n, L)
    return (-coef * token_logprobs).masked_fill(~mask, 0.0)  # (n, L)


def token_log_ratio(token_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``log r_t = log pi_theta(y_t) - l_t`` per token, detached, 0 on padding. Returns ``(n, L)``."""
    _check_tokens("behavior_logprobs", behavior_logprobs, mask)
    return (token_logprobs.detach() - behavior_logprobs).masked_fill(~mask, 0.0)  # (n, L)


def truncated_token_ratio_loss(
    token_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, advantages: Tensor, cap: float
) -> tuple[Tensor, Tensor]:
    """Per token ``-sg(min(r_t, cap) A_i) log pi_theta(y_t)`` with ``r_t = exp(log pi_theta(y_t) - l_t)``.

    The shared form of CISPO and TIS. Returns the ``(n, L)`` loss (zeros on padding) and the ``(n, L)``
    mask of real tokens whose ratio was truncated.
    """
    log_r = token_log_ratio(token_logprobs, behavior_logprobs, mask)  # (n, L)
    weight = torch.exp(log_r.clamp(max=math.log(cap)))  # (n, L) min(r, cap)
    return token_policy_gradient_loss(weight, advantages, token_logprobs, mask), (log_r > math.log(cap)) & mask


def gspo_token_loss(
    token_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, advantages: Tensor, eps_low: float,
    eps_high: float,
) -> tuple[Tensor, Tensor]:
    """GSPO (Zheng et al. 2025) in its token form: PPO's clip on the geometric-mean sequence ratio ``s_i``.

    ``s_it = sg(s_i) pi_theta(y_it) / sg(pi_theta(y_it))`` (value ``s_i = exp(mean_t log r_t)``), ``loss_t =
    -min(s_it A_i, clip(s_it, 1 - eps_low, 1 + eps_high) A_i)``: summed over a sequence's tokens over ``|y_i|``
    (``seq_mean_token_mean``) its value and gradient are GSPO's sequence loss ``-min(s_i A_i, clip(s_i) A_i)``.
    ``log s_i`` is clamped at 80 so that the ratio stays finite. Returns the ``(n, L)`` loss (zeros on padding)
    and the ``(n,)`` mask of sequences whose ratio lies outside the clip band.
    """
    log_s = geometric_log_ratio(token_logprobs.detach(), behavior_logprobs, mask).clamp(max=LOG_RATIO_LIMIT)  # (n,)
    s_t = torch.exp(log_s[:, None] + token_logprobs - token_logprobs.detach())  # (n, L), value s_i
    adv = advantages.detach()[:, None]  # (n, 1)
    loss = -torch.minimum(s_t * adv, s_t.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)  # (n, L)
    floor = math.log1p(-eps_low) if eps_low < 1 else -math.inf  # a clip of 1 or more has no lower side
    outside = (log_s < floor) | (log_s > math.log1p(eps_high))  # (n,)
    return loss.masked_fill(~mask, 0.0), outside


# --- Aggregation -------------------------------------------------------------------------------------------------


def aggregate_loss(
    token_loss: Tensor,
    mask: Tensor,
    mode: Aggregation,
    *,
    max_length: int,
    total_sequences: int,
    total_tokens: int,
) -> Tensor:
    """Reduce a ``(n, L)`` per-token loss of a micro-batch to its share of the full-batch scalar.

    The normalisers are those of the whole batch, so the micro-batch shares add up to the full loss:
    - ``seq_sum_over_T``: ``sum / (T * N)``, the paper's ``1/(T B G)`` (eq. 4);
    - ``token_mean``: ``sum / (number of real tokens in the batch)``;
    - ``seq_mean_token_mean``: ``(1/N) sum_i (sum_t loss_it) / |y_i|``.
    """
    _check_tokens("token_loss", token_loss, mask)
    if mode == "seq_sum_over_T":
        return token_loss.sum() / (max_length * total_sequences)
    if mode == "token_mean":
        return token_loss.sum() / max(total_tokens, 1)
    if mode == "seq_mean_token_mean":
        lengths = mask.sum(-1).clamp(min=1)  # (n,)
        return (token_loss.sum(-1) / lengths).sum() / total_sequences
    raise ValueError(f"unknown aggregation {mode!r}; expected one of seq_sum_over_T, token_mean, seq_mean_token_mean")


def update_losses(token_loss: Tensor, mask: Tensor, mode: Aggregation, *, max_length: int, group_size: int) -> Tensor:
    """Each group's loss as an update of its own (one group, ``B = 1``), for ``k`` groups at once. Returns ``(k,)``.

    Group ``d``'s entry is :func:`aggregate_loss` of that group alone (the estimator lab's unit, the paper's per-group
    update ``U_b``): ``seq_sum_over_T`` over ``T G``, ``token_mean`` over the group's real tokens,
    ``seq_mean_token_mean`` the mean over its ``G`` responses of their token means.
    """
    _check_tokens("token_loss", token_loss, mask)
    loss = token_loss.view(-1, group_size, token_loss.shape[-1])  # (k, G, L)
    real = mask.view(loss.shape)  # (k, G, L)
    if mode == "seq_sum_over_T":
        return loss.sum((1, 2)) / (max_length * group_size)
    if mode == "token_mean":
        return loss.sum((1, 2)) / real.sum((1, 2)).clamp(min=1)
    if mode == "seq_mean_token_mean":
        return (loss.sum(-1) / real.sum(-1).clamp(min=1)).sum(-1) / group_size
    raise ValueError(f"unknown aggregation {mode!r}; expected one of seq_sum_over_T, token_mean, seq_mean_token_mean")


# --- Step rules (GMC's Corollary-1 cap, VCPO's step size, GAC's projection) -------------------------------------------


def ess_step_factor(log_w: Tensor) -> Tensor:
    """VCPO's step-size factor ``sqrt(min(1, ESS / n))`` with ``ESS = (sum w)^2 / sum w^2`` over all ``n`` rows.

    ``w`` is the unclipped sequence ratio, taken in log space (float64). Returns a 0-dim tensor in ``[1/sqrt(n), 1]``.
    """
    lw = log_w.detach().double().reshape(-1)  # (n,)
    if lw.numel() == 0:
        raise ValueError("ess_step_factor needs at least one log-ratio")
    ess = torch.exp(2.0 * torch.logsumexp(lw, 0) - torch.logsumexp(2.0 * lw, 0))
    return torch.sqrt((ess / lw.numel()).clamp(max=1.0))


def corollary1_eps(tau4: float, total_updates: int, c: float, eps_min: float, eps_max: float) -> float:
    """Corollary 1's cap for GMC, ``clip(c * tau_bar_4^(1/7) * N^(-3/14), eps_min, eps_max)``, ``N = total_updates``.

    ``tau4`` is the running averaged fourth delay moment (eq. 11, this update included). GMC's alone: the rate comes
    from a bound whose bias term is the mass the group cap removes, which does not bound what TIC's cap removes. The
    arguments are GMC's checked options (``cap_scale``, ``cap_min``, ``cap_max``).
    """
    return min(max(c * tau4 ** (1.0 / 7.0) * total_updates ** (-3.0 / 14.0), eps_min), eps_max)


def gac_shift(
    dot: float, norm_sq: float, prev_norm_sq: float, low: float = 0.05, high: float = 0.30
) -> tuple[float, float]:
    """GAC's projection as a multiple of the previous gradient, ``g' = g - shift * g_prev``: ``(cosine, shift)``.

    RECONSTRUCTION (DESIGN.md §8), not Xu et al.'s own code. With ``c = cos(g, g_prev)``:
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


# --- Diagnostics (detached) --------------------------------------------------------------------------------------


def group_ess(log_rho: Tensor, group_size: int) -> Tensor:
    """Per-group effective sample size ``(sum rho)^2 / sum rho^2`` in ``[1, G]``, in log space. ``(B,)``."""
    lr = per_group(log_rho.detach().double(), group_size, "log_rho")  # (B, G)
    return torch.exp(2 * torch.logsumexp(lr, -1) - torch.logsumexp(2 * lr, -1)).float()  # (B,)


def removed_mass(log_rho: Tensor, coefficients: Tensor, group_size: int) -> Tensor:
    """Importance mass the correction removed, ``(1/G) sum_i (rho_i - c_i)`` (the bias bound of eq. 7). ``(B,)``.

    In float64 with the log-ratio capped at 700, so that a diverged ratio reads as a huge number rather than inf.
    """
    rho = torch.exp(log_rho.detach().double().clamp(max=700.0))  # (N,)
    return per_group(rho - coefficients.detach().double(), group_size, "coefficients").mean(-1)  # (B,)


MISMATCH_LOG_RATIO_LIMIT = 20.0  # verl's clamp of log r before exp in its chi^2: one wild token cannot read as inf


def mismatch_statistics(token_log_ratios: Tensor, sequence_log_ratios: Tensor) -> dict[str, Tensor]:
    """How far the current policy is from the behaviour one, from sampled tokens and sequences (0-dim each, float64).

    ``token_log_ratios``: ``(tokens,)`` ``log r_t = log pi_theta(y_t) - l_t`` of real tokens; ``sequence_log_ratios``:
    ``(N,)`` ``log rho_i``. With samples from the behaviour policy (verl's conventions, log-ratios clamped at +-20):
    - ``k1 = mean_t(-log r_t)`` and ``k3 = mean_t(r_t - 1 - log r_t)`` estimate ``KL(pi_b || pi_theta)`` per token
      (k3 is >= 0 term by term, k1 can be negative);
    - ``chi2_token = mean_t(r_t^2) - 1`` and ``chi2_seq = mean_i(rho_i^2) - 1`` estimate ``chi^2(pi_theta || pi_b)``,
      per token and per sequence (the paper's ``chi^2 = E_b[(rho - 1)^2]``, since ``E_b[rho] = 1``).
    Empty inputs give NaN for their entries.
    """
    t = token_log_ratios.detach().double().clamp(-MISMATCH_LOG_RATIO_LIMIT, MISMATCH_LOG_RATIO_LIMIT)  # (tokens,)
    s = sequence_log_ratios.detach().double().clamp(-MISMATCH_LOG_RATIO_LIMIT, MISMATCH_LOG_RATIO_LIMIT)  # (N,)
    return {
        "k1": (-t).mean(),
        "k3": (torch.exp(t) - 1.0 - t).mean(),
        "chi2_token": torch.exp(2.0 * t).mean() - 1.0,
        "chi2_seq": torch.exp(2.0 * s).mean() - 1.0,
    }


def token_fraction(selected: Tensor, mask: Tensor) -> Tensor:
    """The share of real tokens (``mask``) that ``selected`` marks, 0-dim; 0 for a batch without tokens."""
    return selected.sum() / mask.sum().clamp(min=1)


def token_entropy(logprobs: Tensor) -> Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` of each row of normalised log-probs ``(..., V)``. Returns ``(...)``.

    From the log-softmax the loss computes anyway: one ``exp`` and one product over the vocabulary.
    """
    return -(logprobs.exp() * logprobs).sum(-1)  # (...)

"""The baselines beside GMC (DESIGN.md §8): VCPO, GAC, A-3PO, plus CISPO and TIS. One function and one entry each.

Every rule has the shape of :mod:`lit_gmc.corrections` (``(terms, eps) -> CorrectionOutput``). VCPO and GAC
also change the optimizer step, through a :class:`~lit_gmc.corrections.StepRule`: VCPO scales the learning
rate of one step by its effective sample size, GAC projects the whole gradient before clipping. The math
each rule needs beyond :mod:`lit_gmc.objectives` (the VCPO baseline, the ESS factor, the proximal
log-probs, the projection coefficient) is written as small functions here, tested on hand-made tensors.

What ``--model.eps`` means for each rule (registry default in brackets):
- ``vcpo``: the truncation ``c`` of the sequence ratio [8];
- ``gac``, ``a3po``, ``a3po_capped``: the two-sided PPO clip [0.2];
- ``cispo``: ``eps_high``; the token ratio is capped at ``1 + eps`` [0.28];
- ``tis``: the cap ``C`` of the token ratio [2].

Where this code fills gaps the sources leave:
- GAC's projection is the reconstruction of DESIGN.md §8, not the authors' code (see :func:`gac_shift`).
- A-3PO and TIS use the group-centred advantage of this project's vanilla GRPO, so that each differs from
  GRPO only by its correction (A-3PO is then exactly GRPO whenever ``tau <= 1``).
- TIS is written in its policy-gradient form with the current policy as the trainer side, because the
  learner has no separate recompute of the behaviour version to put in a PPO ratio.

A-3PO has two registry entries rather than one rule with an option: ``a3po`` is the rule as the seed paper
states it (outer factor ``pi_prox / pi_b`` unclipped) and ``a3po_capped`` adds AReaL's masking of tokens whose
factor exceeds 5. A rule sees only ``(terms, eps)``; a second name keeps that shape, so no rule-specific
argument has to be threaded through ``GMCModule``, the CLI and the sweep script, and ``--model.correction``
already validates and documents the choice.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction, CorrectionOutput, PolicyTerms, grpo, register
from lit_gmc.distributed import full_tensor, like, local_part, rank_and_world, sum_across

MIN_REWARD_STD = 1e-8  # below this a group's rewards tie, and VCPO/CISPO skip the std division
GAC_LOW, GAC_HIGH = 0.05, 0.30  # cosine thresholds of GAC (Xu et al. 2026)
A3PO_BEHAVIOR_CAP = 5.0  # a3po_capped leaves out tokens with pi_prox / pi_behaviour above this (AReaL's default)


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


def vcpo(terms: PolicyTerms, eps: float) -> CorrectionOutput:
    """VCPO (Huang et al. 2026; reference code mit-han-lab/vcpo), ``eps`` being the truncation ``c``.

    ``w_i = exp(sum_t (log pi_theta - l))``, coefficient ``min(w_i, c)`` (detached), advantage
    ``(r_i - b*) / sigma_group`` with :func:`vcpo_baseline`, surrogate ``-sg(min(w_i, c) A_i) log pi_theta(y_i)``
    averaged seq-mean-token-mean. The step size is the job of :class:`ESSStepSize`. Needs
    ``terms.grad_norms_sq`` (the module computes it when the entry sets ``needs_grad_norms``).
    """
    if terms.grad_norms_sq is None:
        raise ValueError("vcpo needs PolicyTerms.grad_norms_sq; register it with Correction(needs_grad_norms=True)")
    log_w = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask).detach()  # (n,)
    truncated = torch.exp(log_w.clamp(max=math.log(eps)))  # (n,) min(w, c)
    baseline = vcpo_baseline(log_w, terms.grad_norms_sq, terms.rewards, terms.group_size)  # (k,)
    adv = group_normalized_advantages(terms.rewards, baseline, terms.group_size)  # (n,)
    loss = O.surrogate_token_loss(truncated * adv, terms.token_logprobs, terms.mask)  # (n, L)
    extra = {
        "vcpo/truncated_fraction": (log_w > math.log(eps)).float().mean(),
        "vcpo/baseline_mean": baseline.mean(),
        "vcpo/trajectory_grad_norm_mean": terms.grad_norms_sq.detach().sqrt().mean(),
    }
    return CorrectionOutput(loss, log_w, truncated, adv.detach(), extra)


class ESSStepSize:
    """VCPO's step rule: this step's learning rate is ``lr * sqrt(min(1, ESS / n))``, restored after the step.

    It reads the unclipped log-ratios of the whole optimizer batch from ``stats["log_rho"]``.
    """

    def __init__(self) -> None:
        self._saved_lrs: list[Any] | None = None

    def before_step(
        self, parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, stats: dict[str, Tensor]
    ) -> dict[str, float]:
        """Scale every param group's lr by the ESS factor; returns the factor and the ESS fraction."""
        factor = float(ess_step_factor(stats["log_rho"]))
        self._saved_lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        return {"vcpo/lr_factor": factor, "vcpo/ess_fraction": factor * factor}

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Put back the learning rates saved by :meth:`before_step`."""
        if self._saved_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._saved_lrs, strict=True):
                group["lr"] = lr
            self._saved_lrs = None

    def state_dict(self) -> dict[str, Any]:
        """Stateless between steps: nothing to checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""
        del state


def gac_shift(
    dot: float, norm_sq: float, prev_norm_sq: float, low: float = GAC_LOW, high: float = GAC_HIGH
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


def _dot_and_norms(g: Tensor, prev: Tensor | None) -> Tensor:
    """``(g . prev, ||g||^2, ||prev||^2)`` of one tensor pair as float64; a missing ``prev`` counts as zero."""
    a = g.to(torch.promote_types(g.dtype, torch.float32))  # bf16 gradients are summed in float32
    if prev is None:
        zero = a.new_zeros(())
        return torch.stack([zero, a.square().sum(), zero]).double()
    b = prev.to(a.dtype)
    return torch.stack([(a * b).sum(), a.square().sum(), b.square().sum()]).double()


class GradientProjection:
    """GAC's step rule: project the full gradient against the previous step's before clipping and the step.

    ``g_prev`` is the previous step's raw gradient (before its own projection): the cosine between
    consecutive policy gradients is the signal the paper monitors, and measuring it against an
    already-projected update would make it depend on the previous projection. It is a full copy of the
    gradient and is saved in checkpoints (``state_dict``), so a resumed run projects exactly as an
    uninterrupted one.

    FSDP2: each rank holds shards of every gradient, so the three sums in :meth:`before_step` are taken over
    the local shards and summed over ranks before :func:`gac_shift`, which keeps the cosine global; the shift
    is then applied shard by shard. Under DDP the gradients are already reduced and replicated, and no
    reduction is needed. Checkpoints hold the whole previous gradient (gathered to rank 0, which writes them).
    """

    def __init__(self, low: float = GAC_LOW, high: float = GAC_HIGH) -> None:
        if not -1.0 < low < high < 1.0:
            raise ValueError(f"GAC thresholds must satisfy -1 < low < high < 1, got low={low}, high={high}")
        self.low, self.high = low, high
        self.previous: list[Tensor | None] | None = None

    def before_step(
        self, parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, stats: dict[str, Tensor]
    ) -> dict[str, float]:
        """Project the gradients in place; returns the cosine before and after and the shift."""
        del optimizer, stats
        grads = [p.grad for p in parameters]
        raw = [None if g is None else g.detach().clone() for g in grads]
        previous, self.previous = self.previous, raw
        if previous is None:
            return {}
        if len(previous) != len(grads):
            raise ValueError(f"GAC kept {len(previous)} gradient tensors but the model has {len(grads)} parameters")
        # Parameters without a gradient now cannot be moved and take no part; a missing g_prev counts as zero.
        pairs = [(g, None if prev is None else like(g, prev)) for g, prev in zip(grads, previous, strict=True)]
        pairs = [(g, prev) for g, prev in pairs if g is not None]
        # Sums over this rank's part of each gradient (g . g_prev, ||g||^2, ||g_prev||^2), then over ranks if sharded.
        parts = [_dot_and_norms(local_part(g), None if prev is None else local_part(prev)) for g, prev in pairs]
        sums = torch.stack([p.to(parts[0].device) for p in parts]).sum(0) if parts else torch.zeros(3)  # (3,)
        if any(isinstance(g, DTensor) for g, _ in pairs):
            sums = sum_across(sums)
        dot, norm_sq, prev_sq = sums.tolist()
        cosine, shift = gac_shift(dot, norm_sq, prev_sq, self.low, self.high)
        if shift != 0.0:
            for g, prev in pairs:
                if prev is not None:
                    g.sub_(prev, alpha=shift)
        new_sq = norm_sq - 2.0 * shift * dot + shift * shift * prev_sq
        projected = (dot - shift * prev_sq) / math.sqrt(new_sq * prev_sq) if new_sq > 0 and prev_sq > 0 else 0.0
        return {"gac/cosine": cosine, "gac/projected_cosine": projected, "gac/shift": shift}

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to undo: the projection is meant to stay in the applied update."""
        del optimizer

    def state_dict(self) -> dict[str, Any]:
        """The previous raw gradient (a list aligned with the parameters, or None before the first step).

        Sharded gradients are gathered whole, one at a time, and kept (on CPU) by rank 0 only, the rank that writes
        checkpoints; every rank must call this (each gather is a collective).
        """
        previous = self.previous
        if previous is not None and any(isinstance(t, DTensor) for t in previous):
            keep = rank_and_world()[0] == 0
            gathered: list[Tensor | None] = []
            for t in previous:
                whole = None if t is None else full_tensor(t)
                gathered.append(whole.cpu() if keep and whole is not None else None)
            previous = gathered
        return {"previous": previous, "low": self.low, "high": self.high}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; tensors move to the gradients' device when next used."""
        self.previous = state["previous"]
        self.low, self.high = state["low"], state["high"]


def gac(terms: PolicyTerms, eps: float) -> CorrectionOutput:
    """GAC (Xu et al. 2026) on vanilla GRPO: the token-level PPO-clip loss of :func:`lit_gmc.corrections.grpo`.

    GAC changes the update, not the loss: its rule is :class:`GradientProjection` (a reconstruction).
    """
    return grpo(terms, eps)


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


def _a3po_rule(terms: PolicyTerms, eps: float, cap: float | None) -> CorrectionOutput:
    mask = terms.mask
    alpha = a3po_alpha(terms.delays)  # (n,)
    log_prox = loglinear_proximal_logprobs(terms.token_logprobs, terms.behavior_logprobs, alpha)  # (n, L)
    log_weight = (log_prox - terms.behavior_logprobs).masked_fill(~mask, 0.0)  # (n, L), detached
    weight, kept = a3po_behavior_weight(log_weight, mask, cap)  # (n, L), (n, L)
    adv = O.group_centered_advantages(terms.rewards, terms.group_size)  # (n,)
    loss = weight * O.ppo_clip_token_loss(terms.token_logprobs, log_prox, mask, adv, eps)  # (n, L)
    log_r = (terms.token_logprobs.detach() - log_prox).masked_fill(~mask, 0.0)  # (n, L)
    floor = math.log1p(-eps) if eps < 1 else -math.inf  # a clip of 1 or more has no lower side
    clipped = ((log_r < floor) | (log_r > math.log1p(eps))) & kept  # (n, L)
    over_cap = mask & (log_weight > math.log(A3PO_BEHAVIOR_CAP))  # (n, L), kept by a3po, masked by a3po_capped
    tokens = mask.sum().clamp(min=1)
    log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, mask).detach()  # (n,)
    extra = {
        "a3po/over_cap_fraction": over_cap.sum() / tokens,
        "a3po/clip_fraction": clipped.sum() / tokens,
        "a3po/alpha_mean": alpha.mean(),
    }
    return CorrectionOutput(loss, log_rho, torch.exp(log_rho.clamp(max=80.0)), adv.detach(), extra)


def a3po(terms: PolicyTerms, eps: float) -> CorrectionOutput:
    """A-3PO (Li et al. 2025) as the seed paper states it: the outer factor ``pi_prox / pi_b`` is NOT clipped.

    Per token, ``log pi_prox = alpha l + (1 - alpha) sg(log pi_theta)`` (:func:`loglinear_proximal_logprobs`)
    with ``alpha = 1 / max(1, tau)`` (``tau`` the group's delay), ``r = exp(log pi_theta - log pi_prox)`` and

        ``loss_t = -sg(pi_prox / pi_b) min(r A, clip(r, 1 - eps, 1 + eps) A)``.

    Its gradient on an unclipped token is ``-(pi_theta / pi_b) A grad log pi_theta``: the full, unbounded
    token ratio, the factor the seed paper blames for A-3PO's collapse at 8B. Group-centred advantages; the
    registry aggregates ``token_mean`` (token sum over the batch's count of real tokens). Logs
    ``a3po/over_cap_fraction``, the share of real tokens with ``pi_prox / pi_b > 5`` (kept here; see
    :func:`a3po_capped`).
    """
    return _a3po_rule(terms, eps, cap=None)


def a3po_capped(terms: PolicyTerms, eps: float) -> CorrectionOutput:
    """A-3PO with AReaL's safeguard: :func:`a3po`, except tokens with ``pi_prox / pi_b > 5`` are left out.

    As AReaL's decoupled PPO loss with ``behav_imp_weight_cap=5``: such a token's loss is 0 (no gradient) but it
    still counts in the ``token_mean`` denominator. ``a3po/over_cap_fraction`` is then the masked share.
    """
    return _a3po_rule(terms, eps, cap=A3PO_BEHAVIOR_CAP)


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


def _token_rule(terms: PolicyTerms, cap: float, adv: Tensor, name: str) -> CorrectionOutput:
    loss, truncated = truncated_token_ratio_loss(terms.token_logprobs, terms.behavior_logprobs, terms.mask, adv, cap)
    log_rho = O.log_ratio(terms.token_logprobs, terms.behavior_logprobs, terms.mask).detach()  # (n,)
    extra = {f"{name}/truncated_fraction": truncated.sum() / terms.mask.sum().clamp(min=1)}
    return CorrectionOutput(loss, log_rho, torch.exp(log_rho.clamp(max=80.0)), adv.detach(), extra)


def cispo(terms: PolicyTerms, eps: float) -> CorrectionOutput:
    """CISPO (MiniMax-M1, Chen et al. 2025): ``-sg(min(r_t, 1 + eps) A_i) log pi_theta(y_t)``, ``eps = eps_high``.

    No lower bound on the weight (the authors set ``eps_low`` out of reach), advantages
    ``(r_i - mean) / std`` per group (population std, skipped on ties), ``token_mean`` aggregation.
    """
    r = O.per_group(terms.rewards, terms.group_size, "rewards")  # (k, G)
    adv = group_normalized_advantages(terms.rewards, r.mean(-1), terms.group_size)  # (n,)
    return _token_rule(terms, 1.0 + eps, adv, "cispo")


def tis(terms: PolicyTerms, eps: float) -> CorrectionOutput:
    """Truncated importance sampling (Yao et al. 2025) for the engine/trainer mismatch, ``eps`` being the cap ``C``.

    ``-sg(min(pi_theta(y_t) / pi_engine(y_t), C) A_i) log pi_theta(y_t)`` per token (the policy-gradient
    form), group-centred advantages, ``token_mean`` aggregation.
    """
    adv = O.group_centered_advantages(terms.rewards, terms.group_size)  # (n,)
    return _token_rule(terms, eps, adv, "tis")


register("vcpo", Correction(vcpo, 8.0, "seq_mean_token_mean", step_rule=ESSStepSize, needs_grad_norms=True))
register("gac", Correction(gac, 0.2, "seq_mean_token_mean", step_rule=GradientProjection))
register("a3po", Correction(a3po, 0.2, "token_mean"))
register("a3po_capped", Correction(a3po_capped, 0.2, "token_mean"))
register("cispo", Correction(cispo, 0.28, "token_mean"))
register("tis", Correction(tis, 2.0, "token_mean"))

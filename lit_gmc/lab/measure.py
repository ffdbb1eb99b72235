"""A rule's update on groups drawn from the behaviour policy, and the estimates made of many such updates.

Every rule's loss depends on the parameters only through the current log-probs of the tokens it is given, so a
group's update is ``g = -sum_{i,t} (dL / d log pi_theta(y_it)) grad log pi_theta(y_it)``: the rule's own ``__call__``
and aggregation, differentiated by autograd with respect to the log-probs (:func:`loss_gradients`), then contracted
with the per-token score vectors of :mod:`~lit_gmc.lab.space`. The same update through the learner's backward is
checked equal in tests/test_lab.py. An update is one group (``B = 1``, the paper's per-group ``U_b``), its loss
:func:`~lit_gmc.objectives.update_losses`.

Expectations over groups are exact sums over every group of the kept responses (:func:`expected_coefficients`) or
Monte-Carlo means over drawn groups, split into batches whose means give unbiased estimates of squared norms and
inner products (:func:`batch_statistics`): ``||E[g] - h||^2`` as a U-statistic over pairs of batches, so the
noise of the means does not read as bias.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction, PolicyTerms
from lit_gmc.errors import UserError, first_line
from lit_gmc.lab.space import PromptSpace, chunks

EXACT_GROUPS = 2_000_000
"""The most groups an exact expectation sums over (each is one row of the rule's batched call)."""
EXACT_GROUPS_ONE_BY_ONE = 20_000
"""The most, for a rule called once per group (``couples_groups``)."""


@dataclass(frozen=True)
class PromptPolicies:
    """One prompt's responses and their token log-probs under both policies (float64, 0 on padding)."""

    space: PromptSpace
    behavior: Tensor  # (N, T)
    current: Tensor  # (N, T)

    @cached_property
    def log_rho(self) -> Tensor:
        """``(N,)`` ``log pi_theta(y) - log pi_b(y)``."""
        return self.current.sum(-1) - self.behavior.sum(-1)

    @cached_property
    def p_behavior(self) -> Tensor:
        """``(N,)`` ``pi_b(y)``."""
        return self.behavior.sum(-1).exp()

    @cached_property
    def p_current(self) -> Tensor:
        """``(N,)`` ``pi_theta(y)``."""
        return self.current.sum(-1).exp()

    def divergences(self) -> dict[str, float]:
        """Exact ``KL(pi_b || pi_theta)``, ``KL(pi_theta || pi_b)``, ``chi^2 = E_b[(rho - 1)^2]`` of the prompt."""
        lb, lc = self.behavior.sum(-1), self.current.sum(-1)  # (N,) each
        return {
            "kl_behavior_current": float((self.p_behavior * (lb - lc)).sum()),
            "kl_current_behavior": float((self.p_current * (lc - lb)).sum()),
            "chi2": float(torch.exp(torch.logsumexp(2 * lc - lb, 0)) - 1.0),  # sum pi^2 / pi_b - 1, overflow-free
        }

    def true_coefficients(self) -> Tensor:
        """``(N, T)``: ``grad J_x(theta) / T = sum_{y,t} c_yt grad log pi_theta(y_t)``, ``c = pi(y) (r - E r) / T``.

        The baseline ``E_theta[r]`` changes nothing in exact arithmetic (``E_theta[grad log pi] = 0``) and keeps the
        sum's terms small.
        """
        p, r = self.p_current, self.space.rewards
        per_row = p * (r - (p * r).sum()) / self.space.max_tokens  # (N,)
        return per_row[:, None] * self.space.mask  # (N, T)

    def tic_limit_coefficients(self, cap: float) -> Tensor:
        """``(N, T)`` of Remark 8's TIC bias, ``-(1/T) E_b[rho 1{rho > 1 + eps} grad log pi (r - E_b r)]``.

        TIC's expected update with leave-one-out advantages minus ``grad J / T``, the same at every ``G``.
        """
        r, above = self.space.rewards, self.log_rho > math.log1p(cap)  # (N,), (N,)
        per_row = -self.p_current * above * (r - (self.p_behavior * r).sum()) / self.space.max_tokens  # (N,)
        return per_row[:, None] * self.space.mask  # (N, T)


def draw_groups(probabilities: Tensor, count: int, group_size: int, generator: torch.Generator) -> Tensor:
    """``(count, G)`` rows drawn i.i.d. from ``probabilities`` (with replacement)."""
    drawn = torch.multinomial(probabilities, count * group_size, replacement=True, generator=generator)
    return drawn.view(count, group_size)


def kept_rows(*probabilities: Tensor, omit: float) -> Tensor:
    """Sorted indices of the responses that hold all but ``omit`` of each distribution's mass (largest first)."""
    keep = torch.zeros(probabilities[0].numel(), dtype=torch.bool)
    for p in probabilities:
        order = torch.argsort(p, descending=True)
        held = int((torch.cumsum(p[order], 0) < 1.0 - omit).sum()) + 1
        keep[order[:held]] = True
    return keep.nonzero()[:, 0]


@dataclass
class RuleOutput:
    """A rule on ``k`` groups, each an update of its own.

    Attributes:
        loss_grads: ``(k, G, T)`` ``dL_d / d log pi_theta(y_t)`` (0 on padding).
        removed_mass: ``(k,)`` ``(1/G) sum_i (rho_i - c_i)``: the importance mass the rule's coefficients removed.
    """

    loss_grads: Tensor
    removed_mass: Tensor


def loss_gradients(
    name: str,
    rule: Correction,
    data: PromptPolicies,
    groups: Tensor,
    *,
    delay: int,
    grad_norms_sq: Tensor | None = None,
    chunk_groups: int = 4096,
) -> RuleOutput:
    """Each group of ``groups`` ``(k, G)`` as one update: the rule's loss gradients in the log-probs.

    The rule is called on many groups at once unless it declares ``couples_groups`` (its loss on a call is then
    not the sum of its groups' losses), or ``chunk_groups`` is 1. A rule that raises, or gives a non-finite loss, is
    one :class:`UserError` naming it (``name``).
    """
    k, size = groups.shape
    space = data.space
    step = 1 if getattr(rule, "couples_groups", False) else chunk_groups
    grads, removed = [], []
    for part in chunks(k, step):
        rows = groups[part].reshape(-1)  # (n,)
        z = data.current[rows].clone().requires_grad_()  # (n, T)
        terms = PolicyTerms(
            token_logprobs=z, behavior_logprobs=data.behavior[rows], mask=space.mask[rows],
            rewards=space.rewards[rows], delays=torch.full((rows.numel(),), delay, dtype=torch.long),
            group_size=size, grad_norms_sq=None if grad_norms_sq is None else grad_norms_sq[rows],
        )  # fmt: skip
        try:
            out = rule(terms)
            losses = O.update_losses(out.token_loss, terms.mask, rule.aggregation, max_length=space.max_tokens,
                                     group_size=size)  # fmt: skip
            (grad,) = torch.autograd.grad(losses.sum(), z, allow_unused=True)
        except Exception as err:
            raise UserError(f"--rules {name}: the rule raised {type(err).__name__} on a group of {size} responses to "
                            f"{space.prompt!r}: {first_line(err)}") from err  # fmt: skip
        if not torch.isfinite(losses).all():
            raise UserError(f"--rules {name}: a non-finite loss on a group of {size} responses to {space.prompt!r}")
        grads.append(torch.zeros_like(z) if grad is None else grad.masked_fill(~terms.mask, 0.0))
        removed.append(O.removed_mass(out.log_rho, out.coefficients, size))
    return RuleOutput(torch.cat(grads).view(k, size, -1), torch.cat(removed))


def check_separable(name: str, rule: Correction, data: PromptPolicies, groups: Tensor, delay: int,
                    grad_norms_sq: Tensor | None = None) -> None:  # fmt: skip
    """Raise a :class:`UserError` if the rule's loss on a call of several groups is not the sum of its per-group losses.

    Checked on the first groups, against its losses on each group alone: the lab calls such a rule once per group, when
    it says so.
    """
    if getattr(rule, "couples_groups", False):
        return
    few = groups[:4]
    together = loss_gradients(name, rule, data, few, delay=delay, grad_norms_sq=grad_norms_sq).loss_grads
    alone = loss_gradients(name, rule, data, few, delay=delay, grad_norms_sq=grad_norms_sq, chunk_groups=1).loss_grads
    if not torch.allclose(together, alone, rtol=1e-9, atol=1e-12):
        raise UserError(f"--rules {name}: its loss on a call of several groups is not the sum of its losses on each "
                        "group alone (a mask or normaliser over the whole call, as M2PO's): set the class attribute "
                        "couples_groups = True, so that the lab calls it once per group")  # fmt: skip


def all_groups(rows: Tensor, group_size: int) -> Tensor:
    """``(n^G, G)``: every ordered group of ``G`` of the ``n`` rows."""
    grid = torch.cartesian_prod(*[rows] * group_size)
    return grid.view(-1, group_size)


def expected_coefficients(
    name: str,
    rule: Correction,
    data: PromptPolicies,
    rows: Tensor,
    group_size: int,
    *,
    delay: int,
    grad_norms_sq: Tensor | None = None,
) -> tuple[Tensor, float, float] | None:
    """``E[g]``'s coefficients, its expected removed mass and the mass left out; None when there are too many groups.

    The coefficients ``(N, T)`` are summed over every group of ``rows``; the mass left out is the behaviour probability
    of the groups left out (``1 - pi_b(rows)^G``).
    """
    count = rows.numel() ** group_size
    one_by_one = getattr(rule, "couples_groups", False)
    if count > (EXACT_GROUPS_ONE_BY_ONE if one_by_one else EXACT_GROUPS):
        return None
    groups = all_groups(rows, group_size)  # (n^G, G)
    weights = data.p_behavior[groups].prod(-1)  # (n^G,)
    out = loss_gradients(name, rule, data, groups, delay=delay, grad_norms_sq=grad_norms_sq)
    flat = (-weights[:, None, None] * out.loss_grads).reshape(-1, data.space.max_tokens)  # (n^G * G, T)
    coefficients = torch.zeros_like(data.current).index_add_(0, groups.reshape(-1), flat)  # (N, T)
    left_out = 1.0 - float(data.p_behavior[rows].sum()) ** group_size
    return coefficients, float((weights * out.removed_mass).sum()), left_out


def batch_columns(loss_grads: Tensor, groups: Tensor, batches: int, rows: int) -> Tensor:
    """``(batches, N, T)``: minus the mean loss gradient of each batch's groups, on the rows they drew.

    Group ``d`` of the ``k`` belongs to batch ``d * batches // k`` (consecutive, as equal as can be).
    """
    k, size, length = loss_grads.shape
    batch = torch.arange(k) * batches // k  # (k,)
    counts = torch.bincount(batch, minlength=batches).to(loss_grads.dtype)  # (batches,)
    flat_index = (batch[:, None] * rows + groups).reshape(-1)  # (k * G,)
    out = torch.zeros(batches * rows, length, dtype=loss_grads.dtype)
    out.index_add_(0, flat_index, -loss_grads.reshape(-1, length))
    return out.view(batches, rows, length) / counts[:, None, None]


@dataclass
class Estimate:
    """A value, its standard error (0 when exact) and its 95% interval."""

    value: float
    se: float = 0.0

    @property
    def low(self) -> float:
        """The lower end of the 95% interval."""
        return self.value - 1.96 * self.se

    @property
    def high(self) -> float:
        """The upper end of the 95% interval."""
        return self.value + 1.96 * self.se

    def as_dict(self) -> dict[str, float]:
        """``value``, ``se``, ``low`` and ``high`` as a dict."""
        return {"value": self.value, "se": self.se, "low": self.low, "high": self.high}


def jackknife(count: int, statistic: Callable[[Tensor], float]) -> Estimate:
    """``statistic`` of all ``count`` batches and its leave-one-batch-out jackknife standard error.

    ``statistic`` takes the indices of the batches it may use.
    """
    everything = torch.arange(count)
    whole = statistic(everything)
    if count < 3:
        return Estimate(whole, math.nan)
    leave_out = torch.tensor([statistic(everything[everything != k]) for k in range(count)], dtype=torch.float64)
    return Estimate(whole, math.sqrt((count - 1) / count * float(((leave_out - leave_out.mean()) ** 2).sum())))


def off_diagonal_mean(gram: Tensor) -> float:
    """Mean of the off-diagonal entries of a ``(K, K)`` Gram matrix: unbiased for ``<E a, E b>`` over batches."""
    count = gram.shape[0]
    return float((gram.sum() - gram.diagonal().sum()) / (count * (count - 1)))


def batch_statistics(batch_means: Tensor, target: Tensor, draw_norms: Tensor, draw_weights: Tensor) -> dict:
    """Unbiased estimates from ``(K, d)`` batch means of an update ``g`` and its target ``h``.

    ``h`` is exact ``(d,)`` or its own ``(K, d)`` batch means, independent of ``g``'s (sampled spaces);
    ``draw_norms`` are the squared norms of every drawn update, ``draw_weights`` each draw's share of the expectation.
    ``bias^2 = ||E g - h||^2``, ``||E g||^2`` and ``||h||^2`` are U-statistics over pairs of batches (their means are
    independent, so the noise of a mean does not add to them), ``<E g, h>`` the mean over every pair; ``cos(E g, h)``
    and ``scale = <E g, h> / ||h||^2`` (how much of ``h`` the mean update carries: 1 for an unbiased rule) are formed
    from them; ``E||g||^2`` is the weighted mean of the draws' squared norms. Standard errors by the jackknife over
    batches (over draws for ``E||g||^2``, conservative: the spread between prompts is counted too).
    """
    targets = target.expand_as(batch_means) if target.dim() == 1 else target  # (K, d)
    gram = batch_means @ batch_means.T  # (K, K)
    cross = batch_means @ targets.T  # (K, K): <v_k, h_l>
    target_gram = targets @ targets.T  # (K, K)

    def mean_sq(index: Tensor) -> float:
        return off_diagonal_mean(gram[index][:, index])

    def target_sq(index: Tensor) -> float:
        return off_diagonal_mean(target_gram[index][:, index])

    def inner(index: Tensor) -> float:
        return float(cross[index][:, index].mean())

    def bias_sq(index: Tensor) -> float:
        difference = gram - cross - cross.T + target_gram
        return off_diagonal_mean(difference[index][:, index])

    def cosine(index: Tensor) -> float:  # undefined where a squared norm is estimated at or below 0
        norms = mean_sq(index) * target_sq(index)
        return inner(index) / math.sqrt(norms) if norms > 0 and mean_sq(index) > 0 else math.nan

    def scale(index: Tensor) -> float:
        hh = target_sq(index)
        return inner(index) / hh if hh > 0 else math.nan

    weights = draw_weights / draw_weights.sum()
    m2 = float((weights * draw_norms).sum())
    spread = float((weights**2 * (draw_norms - m2) ** 2).sum()) * len(draw_norms) / max(len(draw_norms) - 1, 1)
    count = gram.shape[0]
    mean_norm_sq = jackknife(count, mean_sq)
    return {
        "bias_sq": jackknife(count, bias_sq),
        "mean_norm_sq": mean_norm_sq,
        "target_norm_sq": jackknife(count, target_sq),
        "cosine": jackknife(count, cosine),
        "scale": jackknife(count, scale),
        "second_moment": Estimate(m2, math.sqrt(spread)),
        "variance": Estimate(m2 - mean_norm_sq.value, math.hypot(math.sqrt(spread), mean_norm_sq.se)),
    }


def exact_statistics(mean: Tensor, target: Tensor) -> dict:
    """The same quantities for an exact ``E[g]`` (no second moment: that needs draws)."""
    hh = float(target @ target)
    mm = float(mean @ mean)
    return {
        "bias_sq": Estimate(float((mean - target) @ (mean - target))),
        "mean_norm_sq": Estimate(mm),
        "cosine": Estimate(float(mean @ target) / math.sqrt(mm * hh)) if mm > 0 and hh > 0 else Estimate(math.nan),
        "scale": Estimate(float(mean @ target) / hh) if hh > 0 else Estimate(math.nan),
    }

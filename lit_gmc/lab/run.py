"""One delay of the lab: every cell (rule x G) measured on the prompts' spaces, and the paper's bounds beside it.

Per prompt: the current log-probs of every response; the responses kept for sums (all but ``omit`` of each policy's
mass) and the groups drawn for each ``G`` (the same draws for every rule: common random numbers, so differences between
rules are not sampling noise); the per-token score vectors of the kept and drawn responses, once; the rules' loss
gradients on the draws and on every group of the kept responses. Every vector the lab reports (``grad J / T``,
Remark 8's TIC bias, each exact ``E[g]``, each batch mean) is then one weighting of those score vectors, and every
draw's ``||g||^2`` a quadratic form in their Gram matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lit_gmc.corrections import Correction
from lit_gmc.errors import UserError
from lit_gmc.lab.measure import (
    Estimate,
    PromptPolicies,
    batch_columns,
    batch_statistics,
    check_separable,
    draw_groups,
    exact_statistics,
    expected_coefficients,
    kept_rows,
    loss_gradients,
)
from lit_gmc.lab.space import PromptSpace, prefix_scores, token_logprobs
from lit_gmc.rules._token_level import TokenLevel

SCORE_MEMORY_GB = 6.0
"""The most memory the drawn rows' per-token score vectors of one prompt may take."""


@dataclass(frozen=True)
class Cell:
    """One rule at one group size. ``exact``: also sum ``E[g]`` over every group of the kept responses."""

    name: str
    rule: Correction
    group_size: int
    exact: bool = False


@dataclass(frozen=True)
class Settings:
    """How the lab measures (the ``lit-gmc estimate`` options of the same names)."""

    draws: int = 1000
    batches: int = 10
    omit: float = 1e-5
    max_tokens: int = 2
    target_group: int = 8
    temperature: float = 1.0
    reward_bound: float = 1.0
    seed: int = 0


@dataclass
class CellParts:
    """What one cell gathers over the prompts before its statistics (each vector a prompt-weighted sum)."""

    batch_means: Tensor  # (K, d)
    draw_norms: list[Tensor] = field(default_factory=list)  # (M,) per prompt
    removed_mass: list[float] = field(default_factory=list)  # per prompt, mean over draws
    exact_mean: Tensor | None = None  # (d,)
    exact_removed_mass: list[float] = field(default_factory=list)
    exact_left_out: list[float] = field(default_factory=list)


def dimension(model: nn.Module) -> int:
    """The number of parameters of ``model``."""
    return sum(p.numel() for _, p in model.named_parameters())


def measure_delay(
    model: nn.Module,
    spaces: Sequence[PromptSpace],
    behavior: Sequence[Tensor],
    delay: int,
    cells: Sequence[Cell],
    settings: Settings,
    advance: Callable[[str], None] = lambda _: None,
) -> tuple[dict, list[dict]]:
    """Measure every cell on the enumerated ``spaces``, ``model`` the current policy, ``behavior`` the behaviour's.

    ``behavior[p]`` is prompt ``p``'s ``(N, T)`` behaviour log-probs; ``advance`` is called after each prompt.
    Returns the delay's record and one record per cell (see :mod:`lit_gmc.lab.report`).
    """
    tic_caps = sorted({c.rule.cap for c in cells if type(c.rule).__name__ == "TIC"})
    totals = Totals(len(cells), dimension(model), settings.batches, 1 + len(tic_caps))
    prompts: list[dict] = []
    for p, (space, lb) in enumerate(zip(spaces, behavior, strict=True)):
        data = PromptPolicies(space, lb, token_logprobs(model, space, settings.temperature))
        kept = kept_rows(data.p_behavior, data.p_current, omit=settings.omit)
        groups = {g: draw_groups(data.p_behavior, settings.draws, g, seeded(settings.seed, delay, p, g))
                  for g in sorted({c.group_size for c in cells})}  # fmt: skip
        targets = [data.true_coefficients(), *(data.tic_limit_coefficients(c) for c in tic_caps)]
        block, norms_sq = measure_prompt(model, data, groups, kept, targets, cells, settings, delay, totals,
                                         1 / len(spaces))  # fmt: skip
        prompts.append(prompt_record(data, kept, block, norms_sq))
        advance(f"delay {delay}: prompt {p + 1}/{len(spaces)} done")
    target = totals.targets[0]
    limits = {str(cap): float(vector.norm()) for cap, vector in zip(tic_caps, totals.targets[1:], strict=True)}
    record = {**delay_record(delay, prompts, float(target.norm()), limits), "space": "enumerated"}
    return record, [cell_record(cell, totals, i, target, delay, prompts, settings) for i, cell in enumerate(cells)]


class Totals:
    """What every cell gathers over the prompts: vectors (each a prompt-weighted sum), draw norms, removed mass."""

    def __init__(self, cells: int, d: int, batches: int, targets: int) -> None:
        self.targets = torch.zeros(targets, d, dtype=torch.float64)  # h (or its batch means), Remark 8's vectors
        self.parts = [CellParts(torch.zeros(batches, d, dtype=torch.float64)) for _ in range(cells)]


def measure_prompt(
    model: nn.Module,
    data: PromptPolicies,
    groups: dict[int, Tensor],
    kept: Tensor,
    targets: list[Tensor],
    cells: Sequence[Cell],
    settings: Settings,
    delay: int,
    totals: Totals,
    weight: float,
) -> tuple[Tensor, Tensor]:
    """Add one prompt's share (``weight``) of every vector and its draws' squared norms to ``totals``.

    ``groups``: ``G -> (M, G)`` rows drawn from the behaviour policy; ``kept``: the rows of the exact sums (empty:
    none); ``targets``: ``(N, T)`` weightings of the score vectors to sum as they are (``grad J / T`` and Remark 8's
    vectors, or ``h``'s batch means). Returns the rows whose scores were computed and their squared score norms.
    """
    space = data.space
    block = torch.unique(torch.cat([kept, *(rows.reshape(-1) for rows in groups.values())]))  # sorted
    scores, rows_of, tokens_of, prefix = block_scores(model, space, block, scores_dim(totals), settings.temperature)
    index_of = torch.full(space.mask.shape, -1, dtype=torch.long)  # (N, T) -> row of `scores`
    index_of[rows_of, tokens_of] = prefix
    incidence = torch.zeros(block.numel(), scores.shape[0], dtype=scores.dtype)  # (rows, Q): a row's prefixes
    incidence[torch.searchsorted(block, rows_of), prefix] = 1.0
    norms_sq = torch.zeros(space.size, dtype=torch.float64)
    norms_sq[block] = (incidence @ scores).double().square().sum(-1)
    del incidence
    # The rules on the draws (batch columns, per-draw coefficients) and on every group of the kept responses; each
    # column is an (N, T) weighting of the score vectors.
    columns, exact_cells, exact_columns, mc = list(targets), [], [], {}
    for i, cell in enumerate(cells):
        norms = norms_sq if cell.rule.needs_grad_norms else None
        rows = groups[cell.group_size]
        check_separable(cell.name, cell.rule, data, rows, delay, norms)
        out = loss_gradients(cell.name, cell.rule, data, rows, delay=delay, grad_norms_sq=norms)
        mc[i] = out.loss_grads
        totals.parts[i].removed_mass.append(float(out.removed_mass.mean()))
        columns += list(batch_columns(out.loss_grads, rows, settings.batches, space.size))
        exact = expected_coefficients(cell.name, cell.rule, data, kept, cell.group_size, delay=delay,
                                      grad_norms_sq=norms) if cell.exact and kept.numel() else None  # fmt: skip
        if exact is not None:
            exact_cells.append(i)
            exact_columns.append(exact[0])
            totals.parts[i].exact_removed_mass.append(exact[1])
            totals.parts[i].exact_left_out.append(exact[2])
    per_token = torch.stack(columns + exact_columns)[:, rows_of, tokens_of]  # (C, U)
    weights = torch.zeros(per_token.shape[0], scores.shape[0], dtype=torch.float64).index_add_(1, prefix, per_token)
    sums = (weights.to(scores.dtype) @ scores).double() * weight  # (C, d)
    totals.targets += sums[: len(targets)]
    at = len(targets)
    for part in totals.parts:
        part.batch_means += sums[at : at + settings.batches]
        at += settings.batches
    for i, vector in zip(exact_cells, sums[at:], strict=True):
        part = totals.parts[i]
        part.exact_mean = vector if part.exact_mean is None else part.exact_mean + vector
    # Every draw's ||g||^2, from the Gram matrix of the drawn positions.
    drawn = torch.unique(torch.cat([rows.reshape(-1) for rows in groups.values()]))
    at_drawn = torch.unique(index_of[drawn][space.mask[drawn]])  # rows of `scores` that some draw uses
    gram = torch.zeros(scores.shape[0], scores.shape[0], dtype=torch.float64)
    gram[at_drawn[:, None], at_drawn[None, :]] = (scores[at_drawn] @ scores[at_drawn].T).double()
    for i, cell in enumerate(cells):
        totals.parts[i].draw_norms.append(draw_norms_sq(gram, index_of, groups[cell.group_size], mc[i]))
    return block, norms_sq


def scores_dim(totals: Totals) -> int:
    """``d``, the number of parameters the vectors run over."""
    return totals.targets.shape[1]


def block_scores(model: nn.Module, space: PromptSpace, rows: Tensor, d: int, temperature: float
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(scores (Q, d), row (U,), token (U,), prefix (U,))``: the prefixes' score vectors, and where each token is.

    The score vectors of the distinct prefixes among the real tokens of ``rows``
    (:func:`~lit_gmc.lab.space.prefix_scores`), and for each real token its row, position and prefix. Refused, naming
    the prompt, when the scores would take more than :data:`SCORE_MEMORY_GB`.
    """
    where = torch.nonzero(space.mask[rows])  # (U, 2)
    size_gb = where.shape[0] * d * 4 / 1e9  # at most one prefix a token
    if size_gb > SCORE_MEMORY_GB:
        raise UserError(f"the responses kept and drawn for {space.prompt!r} need up to {size_gb:.1f} GB of score "
                        f"vectors (more than {SCORE_MEMORY_GB:g}): raise --omit, or lower --draws or --max-tokens")
    scores, prefix = prefix_scores(model, space, rows, temperature)
    return scores, rows[where[:, 0]], where[:, 1], prefix


def seeded(*keys: int) -> torch.Generator:
    """A generator seeded from the keys (the run's seed, the delay, the prompt, G): draws reproducible per cell."""
    return torch.Generator().manual_seed(hash(tuple(keys)) % (2**63))


def draw_norms_sq(gram: Tensor, index_of: Tensor, groups: Tensor, loss_grads: Tensor) -> Tensor:
    """``(k,)`` ``||g_d||^2`` of each drawn group's update from the Gram matrix of the drawn positions."""
    k, size, length = loss_grads.shape
    where = index_of[groups].reshape(k, size * length)  # (k, G T), -1 on padding
    coefficients = (-loss_grads).reshape(k, size * length) * (where >= 0)  # (k, G T)
    where = where.clamp(min=0)
    sub = gram[where[:, :, None], where[:, None, :]]  # (k, G T, G T)
    return torch.einsum("ka,kab,kb->k", coefficients, sub, coefficients)


def prompt_record(data: PromptPolicies, kept: Tensor, block: Tensor, norms_sq: Tensor) -> dict:
    """What the lab knows of one prompt at one delay (the bounds' constants among it).

    The sums over responses (``grad J / T``, the score moment) run over the kept and drawn responses: the
    ``left_out_mass_*`` entries are what each policy puts on the others.
    """
    p_b, p_c, r = data.p_behavior, data.p_current, data.space.rewards
    return {
        "prompt": data.space.prompt,
        "answer": data.space.answer,
        "responses": data.space.size,
        "kept_responses": kept.numel(),
        "left_out_mass_behavior": float(1 - p_b[block].sum()),
        "left_out_mass_current": float(1 - p_c[block].sum()),
        "reward_behavior": float((p_b * r).sum()),
        "reward_current": float((p_c * r).sum()),
        **data.divergences(),
        # E_theta ||grad log pi_theta(y)||^2, and the largest score norm, over the kept and drawn responses
        "score_second_moment": float((p_c[block] * norms_sq[block]).sum()),
        "score_norm_max": float(norms_sq[block].max().sqrt()),
        "max_tokens": data.space.max_tokens,
    }


def delay_record(delay: int, prompts: list[dict], target_norm: float, tic_limits: dict[str, float]) -> dict:
    """The delay's own numbers: divergences and reward averaged over prompts, ``||grad J / T||``, Remark 8."""
    mean = {key: sum(p[key] for p in prompts) / len(prompts)
            for key in ("kl_behavior_current", "kl_current_behavior", "chi2", "reward_behavior", "reward_current",
                        "score_second_moment")}  # fmt: skip
    return {
        "delay": delay,
        **mean,
        "score_norm_max": max(p["score_norm_max"] for p in prompts),
        "true_gradient_norm": target_norm,
        "tic_limit_bias": tic_limits,
        "prompts": prompts,
    }


def cell_record(cell: Cell, totals: Totals, index: int, target: Tensor, delay: int, prompts: list[dict],
                settings: Settings) -> dict:  # fmt: skip
    """One cell's estimates (Monte Carlo, and exact where summed) with the paper's bounds where it has one.

    ``target`` is ``h`` (exact) or its ``(K, d)`` batch means (sampled spaces).
    """
    parts = totals.parts[index]
    count = len(parts.draw_norms)
    weights = torch.cat([torch.full((len(q),), 1.0 / (count * len(q)), dtype=torch.float64) for q in parts.draw_norms])
    mc = batch_statistics(parts.batch_means, target, torch.cat(parts.draw_norms), weights)
    target_norm = math.sqrt(max(mc["target_norm_sq"].value, 0.0))
    record = {
        "rule": cell.name,
        "repr": repr(cell.rule),
        "group_size": cell.group_size,
        "delay": delay,
        "aggregation": cell.rule.aggregation,
        "family": "token" if isinstance(cell.rule, TokenLevel) else "trajectory",
        "draws": settings.draws * count,
        "removed_mass": sum(parts.removed_mass) / count,
        "mc": summary(mc, target_norm),
        "exact": None,
        "bounds": bounds(cell, prompts, sum(parts.removed_mass) / count, settings),
    }
    if parts.exact_mean is not None:
        exact = exact_statistics(parts.exact_mean, target)
        record["exact"] = summary(exact, target_norm)
        record["exact"]["left_out_mass"] = max(parts.exact_left_out)
        record["exact"]["removed_mass"] = sum(parts.exact_removed_mass) / count
    return record


def summary(stats: dict[str, Estimate], target_norm: float) -> dict:
    """Bias, relative bias, cosine and the moments, as plain numbers.

    The bias and its interval come from its square: ``[sqrt(max(U - 1.96 se, 0)), sqrt(max(U, 0) + 1.96 se)]``.
    """
    bias_sq = stats["bias_sq"]
    out = {
        "bias": math.sqrt(max(bias_sq.value, 0.0)),
        "bias_low": math.sqrt(max(bias_sq.low, 0.0)),
        # A U-statistic of a zero bias is negative half the time: the upper end never falls below the resolution.
        "bias_high": math.sqrt(max(bias_sq.value, 0.0) + 1.96 * bias_sq.se),
        "bias_sq": bias_sq.as_dict(),
        "cosine": stats["cosine"].as_dict(),
        "scale": stats["scale"].as_dict(),
        "mean_norm": math.sqrt(max(stats["mean_norm_sq"].value, 0.0)),
    }
    out["relative_bias"] = out["bias"] / target_norm if target_norm > 0 else math.nan
    for key in ("second_moment", "variance"):
        if key in stats:
            out[key] = stats[key].as_dict()
    return out


def bounds(cell: Cell, prompts: list[dict], removed_mass: float, settings: Settings) -> dict:
    """The paper's bounds for GMC and TIC (Lemmas 5, 6, 8, 9; eq. 7) with their constants measured.

    ``sqrt(2 L log C)``, the bound eq. 15 puts on ``||grad log pi_theta(y)|| / T``, is replaced by the largest score
    norm over the kept responses over ``T``; the score moment of eq. 13 by its exact value. With ``R`` the reward
    bound, ``S = E_theta ||grad log pi_theta(y)||^2``, ``s_max`` that largest norm, averaged over prompts:
    - second moment (Lemmas 5 and 8, before eq. 13): ``4 R^2 (1 + eps) S / T^2``;
    - bias, eq. 7: ``(2 R / T) s_max E[(1/G) sum_i (1 - w_i) rho_i]`` (the removed mass, measured);
    - GMC's chi-square branch (eq. 27): ``R s_max chi^2 / (2 T G eps)``, vanishing as ``G`` grows;
    - TIC's chi-square branch (eq. 40): ``(2 R / T) s_max (1 + eps) chi^2 / eps^2``, whatever ``G``.
    Only for the lab's GMC and TIC with leave-one-out advantages and ``seq_sum_over_T``, the paper's estimator.
    """
    kind = type(cell.rule).__name__
    if kind not in ("GMC", "TIC") or cell.rule.aggregation != "seq_sum_over_T":
        return {}
    eps, g, r = float(cell.rule.threshold), cell.group_size, settings.reward_bound
    length = prompts[0]["max_tokens"]
    out = {}
    s_max = max(p["score_norm_max"] for p in prompts)
    moment = sum(p["score_second_moment"] for p in prompts) / len(prompts)
    chi2 = sum(p["chi2"] for p in prompts) / len(prompts)
    out["second_moment"] = 4 * r**2 * (1 + eps) * moment / length**2
    out["bias_removed_mass"] = 2 * r / length * s_max * removed_mass
    if kind == "GMC":
        out["bias_chi2"] = r * s_max * chi2 / (2 * length * g * eps)
    else:
        out["bias_chi2"] = 2 * r / length * s_max * (1 + eps) * chi2 / eps**2
    return out

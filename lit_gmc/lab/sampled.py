"""The lab where a prompt's responses are too many to enumerate: responses sampled from each policy.

Per prompt, ``draws * max G`` responses from ``theta_b`` (the groups of each ``G`` are consecutive fresh samples)
and ``draws * target_group`` from ``theta``, whose leave-one-out on-policy estimator (unbiased for ``grad J / T``)
gives ``h``'s own batch means; the rest is :func:`lit_gmc.lab.run.measure_prompt`'s, with no exact sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lit_gmc import objectives as O
from lit_gmc.lab.measure import PromptPolicies, batch_columns, off_diagonal_mean
from lit_gmc.lab.run import Cell, Settings, Totals, cell_record, delay_record, dimension, measure_prompt, seeded
from lit_gmc.lab.space import sample_responses, sampled_space, token_logprobs
from lit_gmc.objectives import MISMATCH_LOG_RATIO_LIMIT


def measure_delay_sampled(
    behavior_model: nn.Module,
    model: nn.Module,
    prompts: Sequence[tuple[str, str]],
    tokenizer,
    score: Callable[[list[str], str], list[float]],
    delay: int,
    cells: Sequence[Cell],
    settings: Settings,
    advance: Callable[[str], None] = lambda _: None,
) -> tuple[dict, list[dict]]:
    """Measure every cell on sampled responses, where the space is too large to enumerate.

    Per prompt, ``draws * max G`` responses from ``theta_b`` (the groups of each ``G`` are consecutive fresh samples)
    and ``draws * target_group`` from ``theta``, whose leave-one-out on-policy estimator (unbiased for
    ``grad J / T``) gives ``h``'s batch means: bias, cosine and scale are then U-statistics over pairs of batches of
    both, ``||h||`` one of ``h``'s, and the divergences Monte-Carlo means with their standard errors. No exact sums.
    """
    sizes = sorted({c.group_size for c in cells})
    totals = Totals(len(cells), dimension(model), settings.batches, settings.batches)
    records = []
    for p, (text, answer) in enumerate(prompts):
        prompt_ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        pools = [sample_responses(policy, prompt_ids, settings.draws * size, settings.max_tokens,
                                  tokenizer.eos_token_id, tokenizer.pad_token_id, seeded(settings.seed, delay, p, k),
                                  settings.temperature)  # fmt: skip
                 for k, (policy, size) in enumerate(((behavior_model, sizes[-1]), (model, settings.target_group)))]
        space, (behavior_rows, current_rows) = sampled_space(text, answer, tokenizer, pools, score)
        data = PromptPolicies(space, token_logprobs(behavior_model, space, settings.temperature),
                              token_logprobs(model, space, settings.temperature))  # fmt: skip
        groups = {g: behavior_rows[: settings.draws * g].view(settings.draws, g) for g in sizes}
        on_policy = current_rows.view(settings.draws, settings.target_group)
        coefficients = O.leave_one_out_advantages(space.rewards[on_policy].reshape(-1), settings.target_group)
        coefficients = coefficients / (space.max_tokens * settings.target_group)  # (M H,): IS at delay 0, 1/(T H)
        loss_grads = -(coefficients[:, None] * space.mask[on_policy.reshape(-1)]).view(*on_policy.shape, -1)
        targets = list(batch_columns(loss_grads, on_policy, settings.batches, space.size))
        _, norms_sq = measure_prompt(model, data, groups, torch.zeros(0, dtype=torch.long), targets, cells, settings,
                                     delay, totals, 1 / len(prompts))  # fmt: skip
        records.append(sampled_prompt_record(data, behavior_rows, current_rows, norms_sq))
        advance(f"delay {delay}: prompt {p + 1}/{len(prompts)} done")
    target_norm = math.sqrt(max(off_diagonal_mean(totals.targets @ totals.targets.T), 0.0))
    record = {**delay_record(delay, records, target_norm, {}), "space": "sampled"}
    return record, [cell_record(cell, totals, i, totals.targets, delay, records, settings)
                    for i, cell in enumerate(cells)]  # fmt: skip


def sampled_prompt_record(data: PromptPolicies, behavior_rows: Tensor, current_rows: Tensor, norms_sq: Tensor) -> dict:
    """One prompt's divergences, rewards and score moment as Monte-Carlo means over the samples of each policy.

    ``*_se`` entries are their standard errors; ``score_norm_max`` is the largest over the responses sampled.
    """
    log_rho, r = data.log_rho, data.space.rewards
    behavior_rho = log_rho[behavior_rows].clamp(max=MISMATCH_LOG_RATIO_LIMIT)  # samples of theta_b

    def mean_se(values: Tensor) -> tuple[float, float]:
        return float(values.mean()), float(values.std() / math.sqrt(values.numel()))

    out = {"prompt": data.space.prompt, "answer": data.space.answer, "responses": data.space.size,
           "max_tokens": data.space.max_tokens, "score_norm_max": float(norms_sq.max().sqrt())}  # fmt: skip
    for key, values in (("kl_behavior_current", -behavior_rho), ("kl_current_behavior", log_rho[current_rows]),
                        ("chi2", torch.exp(2 * behavior_rho) - 1), ("reward_behavior", r[behavior_rows]),
                        ("reward_current", r[current_rows]), ("score_second_moment", norms_sq[current_rows])):
        out[key], out[f"{key}_se"] = mean_se(values)
    return out

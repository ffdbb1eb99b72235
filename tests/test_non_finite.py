"""Non-finite values never reach the weights: rewards are checked where they enter, and an update whose loss or
gradient is not finite stops before the optimizer step, naming the update and the first non-finite quantity."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from run_helpers import tiny_data

from lit_gmc import objectives as O
from lit_gmc.callbacks.weight_sync import WeightSync
from lit_gmc.corrections import Correction, CorrectionOutput, PolicyTerms
from lit_gmc.data.tasks.reward import Reward
from lit_gmc.errors import UserError
from lit_gmc.module import GMCModule


def test_rewards_are_finite_numbers_or_one_message_naming_the_function_the_prompt_and_the_values():
    def exact(completions, answer):
        return returned

    reward = Reward(exact, "exact")
    returned = [1, 0.5, True]
    assert reward(["a", "b", "c"], "a", prompt_id=7) == [1.0, 0.5, 1.0]
    for bad in (math.nan, math.inf, -math.inf):
        returned = [0.0, bad, 1.0]
        with pytest.raises(UserError) as caught:
            reward(["a", "b", "c"], "a", prompt_id=7)
        assert str(caught.value) == (
            f"reward exact, called as f(completions, answer), gave {bad!r} for response 1 of prompt 7 (rewards "
            f"[0.0, {bad!r}, 1.0]): rewards must be finite numbers (or None, TRL's 'skip this example')"
        )


def nan_reward(completions, answer):
    return [math.nan] + [0.0] * (len(completions) - 1)


def run(module: GMCModule, **data) -> None:
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[WeightSync()],
    )  # fmt: skip
    trainer.fit(module, tiny_data(1, batch_prompts=2, group_size=4, max_new_tokens=4, total_updates=2, **data))


def test_a_nan_reward_stops_the_run_where_it_enters():
    module = GMCModule(max_response_length=4)
    before = {k: v.clone() for k, v in module.actor.state_dict().items()}
    message = r"^reward --data.reward .*nan_reward, called as f\(completions, answer\), gave nan for response 0 of "
    with pytest.raises(UserError, match=message + r"prompt \d+ "):
        run(module, reward=nan_reward)
    assert all(torch.equal(before[k], v) for k, v in module.actor.state_dict().items())


class NanGradient(Correction):
    """A finite loss (0) whose gradient is NaN: d sqrt(x) / dx at 0 is inf, times the 0 inside."""

    def __init__(self) -> None:
        super().__init__("seq_sum_over_T")

    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        token_loss = torch.sqrt(terms.token_logprobs * 0.0) * terms.mask  # (n, L), value 0, gradient nan
        zeros = terms.rewards.new_zeros(terms.rewards.numel())
        adv = O.group_centered_advantages(terms.rewards, terms.group_size)
        return CorrectionOutput(token_loss, zeros, zeros + 1, adv)


class NanLoss(NanGradient):
    """A NaN loss."""

    def __call__(self, terms: PolicyTerms) -> CorrectionOutput:
        out = super().__call__(terms)
        return CorrectionOutput(out.token_loss + math.nan, out.log_rho, out.coefficients, out.advantages)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (NanGradient, r"update 0: the gradient norm is nan \(first non-finite in actor\.[\w.]+\); the weights"),
        (NanLoss, r"update 0: the loss is nan; the weights were not changed"),
    ],
)
def test_a_non_finite_update_stops_before_the_optimizer_step(rule, message):
    module = GMCModule(correction=rule(), max_response_length=4)
    before = {k: v.clone() for k, v in module.actor.state_dict().items()}
    with pytest.raises(FloatingPointError, match=message):
        run(module)
    assert all(torch.equal(before[k], v) for k, v in module.actor.state_dict().items())

"""The task and reward contracts: Prompt fields checked at start-up, TRL's reward functions called as TRL calls them,
None taken as TRL's "skip this example", and Samples showing prompts as the model sees them."""

from __future__ import annotations

import copy
import textwrap
import threading
import time
import warnings

import pytest
import torch
from run_helpers import main_error_line, write_config

from lit_gmc.batch import RolloutGroup, collate_groups
from lit_gmc.callbacks.samples import Samples
from lit_gmc.data.tasks.base import Prompt, prompt_problem
from lit_gmc.data.tasks.reward import Reward
from lit_gmc.errors import UserError
from lit_gmc.objectives import leave_one_out_advantages

trl_rewards = pytest.importorskip("trl.rewards", reason="TRL is in the dev extra")


def test_trl_s_own_reward_functions_work_unchanged_on_a_chat_task():
    accuracy = Reward(trl_rewards.accuracy_reward, "acc", chat=True)
    assert accuracy.convention == "trl"
    assert accuracy(["so \\boxed{\\frac{1}{3}}", "\\boxed{\\frac{1}{2}}"], "\\frac{1}{3}", "a third?") == [1.0, 0.0]
    think = Reward(trl_rewards.think_format_reward, "think", chat=True)
    assert think(["<think>\nhm\n</think>\n6", "<think>6"], "6") == [1.0, 0.0]
    reasoning = Reward(trl_rewards.reasoning_accuracy_reward, "reasoning", chat=True)
    assert reasoning(["<think>3+3</think>\\boxed{6}", "\\boxed{6}"], "6") == [1.0, 0.0]


def recorder(calls: list):
    def reward(prompts, completions, **kwargs):
        calls.append({"prompts": prompts, "completions": completions, **kwargs})
        return [1.0] * len(completions)

    return reward


@pytest.mark.parametrize("chat", [False, True])
def test_a_trl_style_function_gets_what_trl_passes_by_keyword(chat):
    calls: list = []
    Reward(recorder(calls), "r", chat=chat)(["5", "6"], "5", "2+3=", prompt_id=4, completion_ids=[[7, 1], [8]])
    prompt = [{"role": "user", "content": "2+3="}] if chat else "2+3="
    completions = (
        [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}]] if chat else ["5", "6"]
    )
    assert calls == [{"prompts": [prompt, prompt], "completions": completions, "completion_ids": [[7, 1], [8]],
                      "answer": ["5", "5"], "solution": ["5", "5"]}]  # fmt: skip


def solution_only(completions, solution):
    return [float(c == s) for c, s in zip(completions, solution, strict=True)]


def native(completions, answer):
    return [float(c == answer) for c in completions]


def test_the_convention_follows_the_parameter_names_and_kwargs():
    assert Reward(solution_only, "s").convention == "trl"  # named like TRL's own: gets lists by keyword
    assert Reward(solution_only, "s")(["5", "6"], "5") == [1.0, 0.0]
    assert Reward(native, "n").convention == "native"
    assert Reward(lambda completions, answer, **kwargs: [0.0] * len(completions), "k").convention == "trl"


def test_a_reward_slower_than_its_time_limit_is_stopped_at_the_limit_not_later():
    """A reward that would return after 120 s, under a 0.5 s limit, is one error long before it would return.

    The bound, 20 times the limit, only tells a wait that honours the limit from one that does not (a limit read in
    other units, or none); it measures nothing.
    """
    release = threading.Event()

    def slow(completions, answer):
        release.wait(120.0)
        return [0.0] * len(completions)

    began = time.monotonic()
    try:
        with pytest.raises(UserError, match=r"^reward slow did not return within 0.5 s on prompt 7 "):
            Reward(slow, "slow", timeout_s=0.5)(["5"], "5", prompt_id=7)
    finally:
        release.set()
    assert time.monotonic() - began < 10.0


def test_a_wrong_count_names_the_convention_it_was_called_with():
    reward = Reward(lambda completions, solution, **kwargs: [1.0, 0.0], "--data.reward my.acc", chat=True)
    with pytest.raises(UserError) as caught:
        reward(["a"] * 8, "a")
    assert str(caught.value) == (
        "reward --data.reward my.acc, called the TRL way, by keyword: prompts, completions (message lists), "
        "completion_ids, answer, solution, returned 2 values for 8 completions; it must return a list of 8 numbers, "
        "one reward per completion"
    )


def test_none_is_trl_s_skip_this_example_no_advantage_for_it_and_said_once():
    returned = [1.0, None, 0.0, None]
    reward = Reward(lambda completions, answer: returned, "maybe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filled = reward(["a"] * 4, "a", prompt_id=3)
        assert reward(["a"] * 4, "a", prompt_id=3) == filled == [1.0, 0.5, 0.0, 0.5]
    assert [str(w.message) for w in caught] == [
        "reward maybe returned None for 2 of 4 completions of prompt 3: taken as TRL's 'skip this example' (each gets "
        "its group's mean reward, so no advantage; 0.0 when the whole group is None); this warning is shown once"
    ]
    advantages = leave_one_out_advantages(torch.tensor([filled]).flatten(), 4)
    assert advantages[1].item() == advantages[3].item() == 0.0
    assert torch.tensor(filled).mean().item() == 0.5  # the group's mean is that of the rewards given
    returned = [None] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert reward(["a"] * 4, "a") == [0.0] * 4


@pytest.mark.parametrize(
    ("prompts", "problem"),
    [([], "task T gave no training prompts (train_prompts() is empty)"),
     ([Prompt(0, "1+1=", "2"), ("x", "y")], "task T: training prompt 1 is a tuple, not a "
                                            "lit_gmc.data.tasks.base.Prompt(id, text, answer)"),
     ([Prompt(1.0, "1+1=", "2")], "task T: training prompt 0 (id 1.0): Prompt.id must be an int, got float "
                                  "(number your prompts 0, 1, ...)"),
     ([Prompt(0, "1+1=", "2"), Prompt(0, "2+2=", "4")], "task T: training prompt 1 (id 0): Prompt.id repeats that "
                                                        "of training prompt 0; ids must be unique"),
     ([Prompt(0, "", "2")], "task T: training prompt 0 (id 0): Prompt.text must be a non-empty str, got ''"),
     ([Prompt(0, "1+1=", 2)], "task T: training prompt 0 (id 0): Prompt.answer must be a str, got int 2")],
)  # fmt: skip
def test_each_prompt_field_is_checked_naming_the_task_and_the_prompt(prompts, problem):
    assert prompt_problem("T", prompts) == problem
    assert prompt_problem("T", [Prompt(0, "1+1=", "2"), Prompt(5, "2+2=", "")]) is None


LETTER_COUNT = """
from collections.abc import Sequence

from lit_gmc.data.tasks.base import Prompt


class LetterCount:
    def train_prompts(self) -> Sequence[Prompt]:
        return [Prompt(f"q{n}", "a" * n + "=", str(n)) for n in range(1, 9)]  # the mistake: string ids

    def test_prompts(self) -> Sequence[Prompt]:
        return []

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        return [float(c.strip() == answer) for c in completions]
"""


def test_a_string_prompt_id_is_refused_at_start_up_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "letters.py").write_text(textwrap.dedent(LETTER_COUNT))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, "letters", total=2, task={"class_path": "letters.LetterCount"})
    assert main_error_line(monkeypatch, "fit", "--config", str(config)) == (
        "lit_gmc: error: task LetterCount: training prompt 0 (id 'q1'): Prompt.id must be an int, got str (number "
        "your prompts 0, 1, ...)"
    )


def test_samples_show_the_prompt_as_the_model_sees_it_with_the_template_s_markers(char_tokenizer):
    tokenizer = copy.deepcopy(char_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    prompt_ids = torch.tensor(tokenizer("<|user|>1+2=<|assistant|>", add_special_tokens=False)["input_ids"])
    three = tokenizer("3", add_special_tokens=False)["input_ids"]
    response = torch.tensor([three, three])
    group = RolloutGroup(prompt_id=0, prompt="", answer="3", prompt_ids=prompt_ids, response_ids=response,
                         response_mask=torch.ones_like(response, dtype=torch.bool),
                         behavior_logprobs=torch.zeros(response.shape), finish_reasons=["length"] * 2,
                         rewards=torch.tensor([1.0, 0.0]), version=0)  # fmt: skip
    batch = collate_groups([group, group], pad_id=tokenizer.pad_token_id)
    table = Samples(rows=1).table(batch, step=2, tokenizer=tokenizer)
    assert table.splitlines()[-1] == "| <\\|user\\|>1+2=<\\|assistant\\|> | 3 | 1.000 | 2 |"


def test_a_task_s_own_chat_template_option_points_to_the_datamodule_switch(tmp_path, monkeypatch):
    (tmp_path / "letters.py").write_text(textwrap.dedent(LETTER_COUNT))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, "letters", total=2, task={"class_path": "letters.LetterCount"})
    line = main_error_line(monkeypatch, "fit", "--config", str(config), "--data.task.chat_template", "true")
    assert line.startswith("lit_gmc: error: --data.task.chat_template: LetterCount has no option chat_template"), line
    assert line.endswith("every task's prompts are wrapped by the DataModule's switch, --data.chat_template true"), line


NONE_TASK = """
from collections.abc import Sequence

from lit_gmc.data.tasks.addition import Addition
from lit_gmc.data.tasks.base import Prompt


class NoneScore:
    def __init__(self) -> None:
        self.addition = Addition(max_operand=9)

    def train_prompts(self) -> Sequence[Prompt]:
        return self.addition.train_prompts()

    def test_prompts(self) -> Sequence[Prompt]:
        return self.addition.test_prompts()

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        return None  # the mistake: a forgotten return
"""


def test_a_plug_in_task_whose_score_returns_none_is_one_line_naming_it(tmp_path, monkeypatch):
    (tmp_path / "none_task.py").write_text(textwrap.dedent(NONE_TASK))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, "none", total=2, task={"class_path": "none_task.NoneScore"})
    assert main_error_line(monkeypatch, "fit", "--config", str(config)) == (
        "lit_gmc: error: reward NoneScore.score (the task's reward), called as f(completions, answer), returned None "
        "for 4 completions; it must return a list of 4 numbers, one reward per completion"
    )
    assert not list((tmp_path / "none").glob("version_*"))  # a run failed before its first update is no run to list

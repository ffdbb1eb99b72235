"""Users plug in their own task and reward from a module outside the package, through the real CLI."""

from __future__ import annotations

import textwrap

import pytest
from run_helpers import fit, records, write_config
from transformers import AutoTokenizer

from lit_gmc.tblog import read_scalars

USER_MODULE = '''
from collections.abc import Sequence

from lit_gmc.data.tasks.base import Prompt


class Doubling:
    """A user's task: "a+a=" for a in 0..limit, answer 2a; not derived from any lit_gmc class."""

    def __init__(self, limit: int = 30) -> None:
        self.prompts = [Prompt(a, f"{a}+{a}=", str(2 * a)) for a in range(limit + 1)]
        self.scored: list[str] = []

    def train_prompts(self) -> Sequence[Prompt]:
        return self.prompts

    def test_prompts(self) -> Sequence[Prompt]:
        return self.prompts[:3]

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        self.scored.append(answer)
        return [float(c.strip() == answer) for c in completions]


def half_credit(completions: Sequence[str], answer: str) -> list[float]:
    """A user's reward: 0.5 for every completion."""
    return [0.5 for _ in completions]
'''


def test_a_task_and_a_reward_from_a_user_module(tmp_path, monkeypatch, tiny_actor_dir):
    (tmp_path / "user_tasks.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = {"class_path": "user_tasks.Doubling", "init_args": {"limit": 12}}
    cli = fit(write_config(tmp_path, "own_task", total=3, task=task))
    dm = cli.datamodule
    assert type(dm.task).__name__ == "Doubling" and dm.task.scored, "the user's score() is the reward"
    answers = {str(2 * a) for a in range(13)}
    assert set(dm.task.scored) <= answers  # the prompts came from the user's task
    assert sorted(records(tmp_path / "own_task")) == [0, 1, 2]

    cli = fit(write_config(tmp_path, "own_reward", total=3, task=task, reward="user_tasks.half_credit"))
    rewards = [value for _, value in read_scalars(tmp_path / "own_reward")["train/reward"]]
    assert rewards == [0.5, 0.5, 0.5]  # the dotted-path reward replaced the task's score
    assert not cli.datamodule.task.scored

    pytest.importorskip("trl.rewards", reason="TRL is in the dev extra")
    # TRL's own reward, unchanged, on the user's task in a chat template (an actor whose template keeps the text)
    tokenizer = AutoTokenizer.from_pretrained(tiny_actor_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(tiny_actor_dir)
    config = write_config(tmp_path, "trl_reward", total=2, task=task, reward="trl.rewards.accuracy_reward",
                          chat_template=True)  # fmt: skip
    cli = fit(config, "--model.actor", str(tiny_actor_dir))
    assert cli.datamodule.score.convention == "trl" and cli.datamodule.score.chat and not cli.datamodule.task.scored
    rewards = [value for _, value in read_scalars(tmp_path / "trl_reward")["train/reward"]]
    assert rewards == [0.0, 0.0]  # a random actor writes no \\boxed answer


USER_RULE = '''
import torch

from lit_gmc.corrections import Correction, PolicyTerms


class HalfIS(Correction):
    """A user's rule in one class: importance ratios times ``scale``, the base class's leave-one-out advantages."""

    def __init__(self, scale: float = 0.5, aggregation: str | None = None) -> None:
        super().__init__(aggregation or "seq_sum_over_T")
        self.scale = scale
        self.calls = 0

    @property
    def threshold(self) -> float:
        return self.scale

    def coefficients(self, terms: PolicyTerms, log_rho: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.scale * torch.exp(log_rho)
'''


def test_a_rule_from_a_user_module_is_one_class(tmp_path, monkeypatch):
    (tmp_path / "user_rules.py").write_text(textwrap.dedent(USER_RULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, "own_rule", total=2)
    cli = fit(config, "--model.correction", "user_rules.HalfIS", "--model.correction.scale", "0.25")
    assert type(cli.model.correction).__name__ == "HalfIS" and cli.model.correction.calls == 2
    assert [value for _, value in read_scalars(tmp_path / "own_rule")["correction/eps"]] == [0.25, 0.25]

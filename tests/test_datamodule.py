"""The DataModule wires its components: setup starts the engine, teardown closes it, and both can repeat."""

from __future__ import annotations

import pytest
import torch
from run_helpers import fit, main_error_line, tiny_data, write_config

from lit_gmc.data.engines.hf import HFEngine
from lit_gmc.data.engines.recompute import BehaviorRecompute
from lit_gmc.data.tasks.addition import Addition
from lit_gmc.errors import UserError


@pytest.mark.parametrize("recompute", [False, True])
def test_setup_after_teardown_starts_the_engine_again(recompute):
    dm = tiny_data(0, group_size=2, batch_prompts=2, max_new_tokens=3, total_updates=4,
                   engine=HFEngine(recompute_behavior_logprobs=recompute))  # fmt: skip
    prompts = []
    for _ in range(2):
        dm.setup("fit")
        assert isinstance(dm.engine, BehaviorRecompute) == recompute and dm.rollout_engine is dm.engine
        batch = dm.next_batch()
        assert batch.rewards.shape == (4,) and batch.response_mask.any()
        prompts.append(batch.info["batch_id"])
        dm.teardown("fit")
        assert dm.rollout_engine is None and not isinstance(dm.engine, BehaviorRecompute)
    assert prompts == [0.0, 1.0]  # the second setup continues the launches
    assert (dm.stream.epoch, dm.stream.position) == (0, 4)  # and the prompt stream: 2 launches of B = 2 prompts


def test_the_training_stream_is_sized_stateful_and_yields_every_update():
    # Lightning skips its one-batch prefetch only for a sized loader (a prefetch would generate batch n + 1 before
    # update n's weights are published: one more step of delay on every row), and restarts without a warning only
    # a loader with state_dict.
    from lightning.fabric.utilities.data import sized_len
    from lightning.fabric.utilities.types import _Stateful

    dm = tiny_data(1, group_size=2, batch_prompts=2, max_new_tokens=3, total_updates=3)
    dm.setup("fit")
    try:
        stream = dm.train_dataloader()
        assert sized_len(stream) == 3 and isinstance(stream, _Stateful) and stream.state_dict() == {}
        batches = list(stream)  # the schedule's batches, then the end of the epoch
        assert len(batches) == 3 and all(b.rewards.shape == (4,) for b in batches)
        assert list(dm.train_dataloader()) == []  # the schedule is exhausted: a new stream yields nothing
    finally:
        dm.teardown("fit")


def test_each_launch_samples_with_its_own_seed_and_a_replayed_launch_samples_alike():
    """The sampling seed is a function of the launch id: a resumed run replays a launch, two launches differ."""
    dm = tiny_data(0, group_size=4, batch_prompts=2, max_new_tokens=6, total_updates=2)
    dm.setup("fit")
    try:
        prompts = dm.stream.take(2)
        first, again, other = (dm._generate(launch_id, prompts) for launch_id in (3, 3, 4))
        responses = [[g.response_ids for g in batch] for batch in (first, again, other)]
        assert all(torch.equal(a, b) for a, b in zip(responses[0], responses[1], strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(responses[0], responses[2], strict=True))
    finally:
        dm.teardown("fit")


def test_a_restored_datamodule_launches_next_what_the_original_launches_next():
    """Resume's data side: the launch id, prompts and samples after a state round trip are those of the original."""
    modules = [tiny_data(0, group_size=2, batch_prompts=2, max_new_tokens=4, total_updates=4) for _ in range(2)]
    original, restored = modules
    for dm in modules:
        dm.setup("fit")
    try:
        original.next_batch()
        restored.load_state_dict(original.state_dict())
        ahead, resumed = original.next_batch(), restored.next_batch()
        assert ahead.info["batch_id"] == resumed.info["batch_id"] == 1.0
        assert torch.equal(ahead.prompt_ids, resumed.prompt_ids) and torch.equal(ahead.input_ids, resumed.input_ids)
    finally:
        for dm in modules:
            dm.teardown("fit")


def test_the_prompt_budget_keeps_each_prompt_s_last_tokens_and_says_how_many_it_cut(char_tokenizer):
    from lit_gmc.data.datamodule import within_budget
    from lit_gmc.data.tasks.base import Prompt

    prompts = [Prompt(0, "1+2=", "3"), Prompt(3, "10+20+30=", "60"), Prompt(5, "4+5=", "9")]
    with pytest.warns(UserWarning, match=r"^--data.max_prompt_tokens 5: cut the beginning of 1 of 3 training prompts"):
        kept = within_budget(prompts, char_tokenizer, 5)
    assert kept == [prompts[0], Prompt(3, "10+20+30="[-5:], "60"), prompts[2]]  # one token per character


def test_chat_template_wraps_each_prompt_as_a_user_turn_and_a_base_tokenizer_is_refused(char_tokenizer):
    import copy

    from lit_gmc.data.tasks.base import prompts_in_chat_template

    chat = copy.deepcopy(char_tokenizer)
    chat.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    plain = Addition(max_operand=3).train_prompts()
    wrapped = prompts_in_chat_template(plain, chat)
    assert [p.text for p in wrapped] == [f"<user>{p.text}<assistant>" for p in plain]
    assert [(p.id, p.answer) for p in wrapped] == [(p.id, p.answer) for p in plain]
    with pytest.raises(UserError, match="^--data.chat_template: the actor's tokenizer has no chat template"):
        prompts_in_chat_template(plain, char_tokenizer)


LONG_TASK = """
from collections.abc import Sequence

from lit_gmc.data.tasks.base import Prompt


class Long:
    def train_prompts(self) -> Sequence[Prompt]:
        return [Prompt(0, "1+1=", "2"), Prompt(7, "1+" * 30 + "1=", "31")]

    def test_prompts(self) -> Sequence[Prompt]:
        return self.train_prompts()[:1]

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        return [float(c.strip() == answer) for c in completions]
"""


def test_prompts_that_leave_no_room_in_the_actor_s_context_are_refused_at_start_up(tmp_path, monkeypatch):
    (tmp_path / "long_task.py").write_text(LONG_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, "long", total=1, task={"class_path": "long_task.Long"})
    with pytest.raises(UserError) as caught:
        fit(config, "--data.max_new_tokens", "8")  # 62 + 8 tokens > the tiny actor's 64
    assert str(caught.value).startswith(
        "prompt 7 of the task is 62 tokens, and with --data.max_new_tokens 8 that is more than the 64 tokens "
        "--model.actor tiny can attend to; shorten"
    )
    with pytest.warns(UserWarning, match="cut the beginning of 1 of 2 training prompts"):  # the budget makes room
        fit(config, "--data.max_new_tokens", "8", "--data.max_prompt_tokens", "20")


SETUP_TASK = """
from collections.abc import Sequence
from dataclasses import replace

from lit_gmc.data.tasks.base import Prompt


class Padded:
    '''Prompts made in setup(tokenizer), as Math and Addition make theirs: a long preamble before each sum.'''

    def __init__(self) -> None:
        self.prompts = [Prompt(0, "1+1=", "2"), Prompt(7, "2+2=", "4")]

    def setup(self, tokenizer) -> None:
        self.prompts = [replace(p, text="0+" * (20 + 2 * p.id) + p.text) for p in self.prompts]

    def train_prompts(self) -> Sequence[Prompt]:
        return self.prompts

    def test_prompts(self) -> Sequence[Prompt]:
        return self.prompts[:1]

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        return [float(c.strip() == answer) for c in completions]
"""


def test_prompts_made_in_setup_are_checked_against_the_context_and_cut_by_the_budget(tmp_path, monkeypatch):
    """Through ``lit_gmc fit``: one line with status 2 naming prompt 7 (72 tokens + 4 > 64), then a budget of 40."""
    (tmp_path / "padded_task.py").write_text(SETUP_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, "padded", total=1, task={"class_path": "padded_task.Padded"})
    assert main_error_line(monkeypatch, "fit", "--config", str(config)) == (
        "lit_gmc: error: prompt 7 of the task is 72 tokens, and with --data.max_new_tokens 4 that is more than the 64 "
        "tokens --model.actor tiny can attend to; shorten the task's prompts (--data.max_prompt_tokens N keeps the "
        "last N tokens of each) or lower --data.max_new_tokens"
    )
    with pytest.warns(UserWarning, match=r"--data.max_prompt_tokens 40: cut the beginning of 2 of 2 training prompts"):
        cli = fit(config, "--data.max_prompt_tokens", "40", "--trainer.logger.init_args.name", "padded_cut")
    served = {prompt.id: prompt.text for prompt in cli.datamodule.stream.prompts}
    assert served == {0: ("0+" * 20 + "1+1=")[-40:], 7: ("0+" * 34 + "2+2=")[-40:]}  # one token per character

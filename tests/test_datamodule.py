"""The DataModule wires its components: setup starts the engine, teardown closes it, and both can repeat."""

from __future__ import annotations

import pytest
import torch
from run_helpers import tiny_data

from lit_gmc.data.engines.recompute import BehaviorRecompute


@pytest.mark.parametrize("recompute", [False, True])
def test_setup_after_teardown_starts_the_engine_again(recompute):
    dm = tiny_data(0, group_size=2, batch_prompts=2, max_new_tokens=3, total_updates=4,
                   recompute_behavior_logprobs=recompute)  # fmt: skip
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

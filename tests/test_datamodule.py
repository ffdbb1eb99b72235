"""The DataModule wires its components: setup starts the engine, teardown closes it, and both can repeat."""

from __future__ import annotations

import pytest
from run_helpers import tiny_data

from lit_gmc.data.recompute import BehaviorRecompute


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

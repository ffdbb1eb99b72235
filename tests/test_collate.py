"""``collate_groups`` against the layout written out row by row: prompts left-padded, responses right-padded."""

from __future__ import annotations

import random

import pytest
import torch

from lit_gmc.batch import RolloutGroup, collate_groups

PAD = 99


def random_group(rng: random.Random, prompt_id: int, size: int, width: int) -> RolloutGroup:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    ids_dtype = rng.choice([torch.int32, torch.int64])
    return RolloutGroup(
        prompt_id=prompt_id, prompt="p", answer="a",
        prompt_ids=torch.randint(0, 50, (rng.randint(0, 6),), generator=gen, dtype=ids_dtype),
        response_ids=torch.randint(0, 50, (size, width), generator=gen),
        response_mask=torch.rand(size, width, generator=gen) < 0.7,
        behavior_logprobs=-torch.rand(size, width, generator=gen, dtype=rng.choice([torch.float32, torch.float64])),
        finish_reasons=["stop"] * size, rewards=torch.rand(size, generator=gen), version=rng.randint(0, 3),
        batch_id=prompt_id,
    )  # fmt: skip


def row_by_row(groups: list[RolloutGroup]) -> dict[str, torch.Tensor]:
    """The batch's tensors built one row at a time from the layout's definition."""
    width_p = max(g.prompt_ids.numel() for g in groups)
    width_l = max(g.response_ids.shape[1] for g in groups)
    input_ids, attention, response_mask, behaviour = [], [], [], []
    for g in groups:
        prompt = [PAD] * (width_p - g.prompt_ids.numel()) + g.prompt_ids.tolist()
        prompt_real = [False] * (width_p - g.prompt_ids.numel()) + [True] * g.prompt_ids.numel()
        for i in range(g.group_size):
            length = g.response_ids.shape[1]
            mask = g.response_mask[i].tolist() + [False] * (width_l - length)
            input_ids.append(prompt + g.response_ids[i].tolist() + [PAD] * (width_l - length))
            attention.append(prompt_real + mask)
            response_mask.append(mask)
            values = g.behavior_logprobs[i].float().tolist() + [0.0] * (width_l - length)
            behaviour.append([v if real else 0.0 for v, real in zip(values, mask, strict=True)])
    return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention),
            "response_mask": torch.tensor(response_mask), "behavior_logprobs": torch.tensor(behaviour)}  # fmt: skip


@pytest.mark.parametrize("same_width", [True, False], ids=["one_generate_call", "mixed_widths"])
def test_collate_equals_the_layout_built_row_by_row(same_width):
    rng = random.Random(0)
    for _ in range(50):
        size, count = rng.randint(1, 4), rng.randint(1, 5)
        groups = [random_group(rng, b, size, 3 if same_width else rng.randint(1, 5)) for b in range(count)]
        batch = collate_groups(groups, PAD, {"queue_depth": 2.0})
        for name, want in row_by_row(groups).items():
            got = getattr(batch, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        assert batch.prompt_width == max(g.prompt_ids.numel() for g in groups) and batch.group_size == size
        assert torch.equal(batch.rewards, torch.cat([g.rewards for g in groups]).float())
        assert batch.versions.tolist() == [g.version for g in groups] and batch.info == {"queue_depth": 2.0}


def test_collate_refuses_mixed_group_sizes_and_nothing():
    rng = random.Random(1)
    with pytest.raises(ValueError, match="same group size"):
        collate_groups([random_group(rng, 0, 2, 3), random_group(rng, 1, 3, 3)], PAD)
    with pytest.raises(ValueError, match="at least one group"):
        collate_groups([], PAD)


def test_group_fields_and_rewards_are_tensors_of_the_right_dtype():
    rng = random.Random(2)
    groups = [random_group(rng, b, 2, 3) for b in range(3)]
    batch = collate_groups(groups, PAD)
    for name, field in (("versions", "version"), ("batch_ids", "batch_id"), ("prompt_ids", "prompt_id")):
        got = getattr(batch, name)
        assert got.dtype == torch.long and got.tolist() == [getattr(g, field) for g in groups], name
    rewards = [0.1, 1 / 3, 1e-40, True]  # float32 rounding, a subnormal, a bool
    scored = groups[0].with_rewards(rewards, version=9)
    assert scored.rewards.dtype == torch.float32 and scored.version == 9
    assert scored.rewards.tolist() == [float(torch.tensor(v, dtype=torch.float32)) for v in rewards]
    assert torch.equal(groups[0].with_rewards(torch.tensor([1, 0])).rewards, torch.tensor([1.0, 0.0]))

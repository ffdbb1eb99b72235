"""``collate_groups`` against the layout written out row by row: prompts left-padded, responses right-padded."""

from __future__ import annotations

import random

import pytest
import torch

from lit_gmc.batch import RolloutGroup, balanced_partition, collate_groups
from lit_gmc.logprobs import response_logprobs

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


def heaviest(weights: list[int], partition: list[list[int]]) -> int:
    return max(sum(weights[i] for i in part) for part in partition)


def test_balanced_partition_takes_every_group_once_in_equal_counts_and_never_loses_to_contiguous():
    rng = random.Random(0)
    gained = 0
    for _ in range(500):
        parts = rng.randint(1, 5)
        weights = [rng.choice([rng.randint(0, 20), rng.randint(0, 2000)]) for _ in range(parts * rng.randint(1, 6))]
        partition = balanced_partition(weights, parts)
        size = len(weights) // parts
        assert len(partition) == parts and all(len(part) == size for part in partition)
        assert sorted(i for part in partition for i in part) == list(range(len(weights)))
        assert all(part == sorted(part) for part in partition)
        contiguous = [list(range(p * size, (p + 1) * size)) for p in range(parts)]
        assert heaviest(weights, partition) <= heaviest(weights, contiguous)
        gained += heaviest(weights, partition) < heaviest(weights, contiguous)
        assert partition == balanced_partition(list(weights), parts)  # deterministic
    assert gained > 200  # the greedy pass is what is kept in most draws, not the contiguous fallback


def test_balanced_partition_by_hand():
    # Contiguous blocks give 100 + 90 = 190 against 2. Greedy: 100 and 90 apart, the first 1 to the lighter
    # 90, the last 1 to the only part with room.
    assert balanced_partition([100, 90, 1, 1], 2) == [[0, 3], [1, 2]]
    assert balanced_partition([5, 5, 5, 5], 2) == [[0, 1], [2, 3]]  # nothing to gain: contiguous blocks
    with pytest.raises(ValueError, match="5 items cannot be split into 2 parts"):
        balanced_partition([1] * 5, 2)


def test_shards_are_balanced_padded_to_their_own_width_and_carry_the_update_s_positions():
    rng = random.Random(3)
    for _ in range(30):
        size, world = rng.randint(1, 3), rng.choice([2, 3])
        groups = [random_group(rng, b, size, rng.randint(1, 6)) for b in range(world * rng.randint(1, 3))]
        batch = collate_groups(groups, PAD)
        shares = batch.shards(world)
        positions = [share.update_positions.tolist() for share in shares]
        assert positions == balanced_partition(batch.group_tokens(), world)
        for share, kept in zip(shares, positions, strict=True):
            alone = collate_groups([groups[b] for b in kept], PAD)  # the share as if collated by itself
            widest = max(int(g.response_mask.any(0).nonzero().max()) + 1 if g.response_mask.any() else 1
                         for g in (groups[b] for b in kept))  # fmt: skip
            assert share.response_mask.shape[1] == widest <= alone.response_mask.shape[1]
            assert share.prompt_width == alone.prompt_width
            for name in ("input_ids", "attention_mask"):
                want = getattr(alone, name)[:, : share.prompt_width + widest]
                assert torch.equal(getattr(share, name), want), name
            assert torch.equal(share.behavior_logprobs, alone.behavior_logprobs[:, :widest])
            assert torch.equal(share.rewards, alone.rewards)
            assert share.versions.tolist() == [groups[b].version for b in kept]
            assert share.total_rows == batch.total_rows and share.total_tokens == batch.total_tokens
        assert batch.shards(1) == [batch]


def test_a_trimmed_share_gives_the_learner_the_same_log_probs(tiny_model):
    """Cutting all-padding columns (left of the prompts, right of the responses) changes no real token's log-prob."""
    gen = torch.Generator().manual_seed(4)
    groups = []
    for b, (prompt, length) in enumerate([(5, 7), (1, 1), (2, 2), (6, 6)]):  # each share is narrower than the batch
        lengths = torch.tensor([length, max(1, length - 1)])  # (G,)
        mask = torch.arange(length)[None, :] < lengths[:, None]  # (G, L_b)
        responses = torch.randint(1, 46, (2, length), generator=gen).masked_fill(~mask, 0)  # tiny vocabulary: 46
        groups.append(RolloutGroup(
            prompt_id=b, prompt="p", answer="a", prompt_ids=torch.randint(1, 46, (prompt,), generator=gen),
            response_ids=responses, response_mask=mask, behavior_logprobs=torch.zeros(2, length),
            finish_reasons=["stop"] * 2, rewards=torch.zeros(2), version=0, batch_id=0,
        ))  # fmt: skip
    batch = collate_groups(groups, pad_id=0)
    for share in batch.shards(2):
        whole = batch.select_groups(share.update_positions)  # the same groups at the whole batch's widths
        assert share.input_ids.shape[1] < whole.input_ids.shape[1]
        with torch.no_grad():
            want, _ = response_logprobs(tiny_model, whole.input_ids, whole.attention_mask, whole.prompt_width)
            got, _ = response_logprobs(tiny_model, share.input_ids, share.attention_mask, share.prompt_width)
        width, real = share.response_mask.shape[1], share.response_mask
        assert torch.equal(whole.response_mask[:, :width], real) and not whole.response_mask[:, width:].any()
        torch.testing.assert_close(got[real], want[:, :width][real], rtol=0, atol=1e-6)

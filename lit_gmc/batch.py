"""The two records that cross the data/learner boundary: one prompt's group and one update's batch.

Layout chosen so the learner can slice the response logits of every row with one index: prompts are
left-padded to a common width ``P`` and responses right-padded to a common width ``L``, exactly the
layout in which a causal LM generates them. Position ``P - 1 + t`` of the concatenated row predicts
response token ``t``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence


@dataclass
class RolloutGroup:
    """G responses to one prompt, sampled by one engine at one policy version.

    Attributes:
        prompt_id: Stable id of the prompt in its stream (row index for datasets).
        prompt: Prompt text as given to the engine.
        answer: Reference answer the reward was computed against.
        prompt_ids: ``(P_i,)`` prompt token ids, unpadded.
        response_ids: ``(G, L_i)`` response token ids, right-padded with ``pad_id``.
        response_mask: ``(G, L_i)`` True on real response tokens (EOS included when sampled).
        behavior_logprobs: ``(G, L_i)`` log-probs of the sampled tokens under the distribution they
            were sampled from (temperature applied), 0 on padding.
        finish_reasons: ``G`` strings, ``"stop"`` (EOS sampled) or ``"length"`` (budget exhausted).
        rewards: ``(G,)`` float rewards, filled in by the task after generation.
        version: Policy version ``s`` (number of optimizer updates) of the weights that sampled it.
        batch_id: Sequential id of the launched batch this group belongs to (-1 when not batched).
    """

    prompt_id: int
    prompt: str
    answer: str
    prompt_ids: Tensor
    response_ids: Tensor
    response_mask: Tensor
    behavior_logprobs: Tensor
    finish_reasons: list[str]
    rewards: Tensor
    version: int
    batch_id: int = -1

    @property
    def group_size(self) -> int:
        """``G``, the number of responses in the group."""
        return int(self.response_ids.shape[0])

    @property
    def lengths(self) -> Tensor:
        """``(G,)`` number of real response tokens per response."""
        return self.response_mask.sum(-1)

    def with_rewards(self, rewards: Sequence[float] | Tensor, **changes: Any) -> RolloutGroup:
        """A copy of the group with ``rewards`` set (as a float32 tensor) and any other ``changes`` of fields."""
        return replace(self, rewards=torch.as_tensor(rewards, dtype=torch.float32), **changes)


@dataclass
class RolloutBatch:
    """B groups of G responses collated for one optimizer update (rows are group-major: row = b * G + i).

    Attributes:
        input_ids: ``(N, P + L)`` prompt (left-padded) then response (right-padded), ``N = B * G``.
        attention_mask: ``(N, P + L)`` True on real tokens.
        response_mask: ``(N, L)`` True on real response tokens.
        behavior_logprobs: ``(N, L)`` behaviour log-probs of the response tokens, 0 on padding.
        rewards: ``(N,)`` rewards.
        versions: ``(B,)`` behaviour policy version of each group.
        prompt_width: ``P``, the padded prompt width (response token t is predicted at ``P - 1 + t``).
        group_size: ``G``.
        batch_ids: ``(B,)`` launched-batch id of each group.
        prompt_ids: ``(B,)`` prompt id of each group.
        info: Schedule bookkeeping for logging (queue depth, drain flag, ...), plain Python numbers.
        update_rows: ``N`` of the whole update when this batch is one rank's share of it (see :meth:`shard`);
            ``None`` when the batch is the whole update.
        update_tokens: The whole update's number of real response tokens, likewise.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    behavior_logprobs: Tensor
    rewards: Tensor
    versions: Tensor
    prompt_width: int
    group_size: int
    batch_ids: Tensor
    prompt_ids: Tensor
    info: dict[str, float] = field(default_factory=dict)
    update_rows: int | None = None
    update_tokens: int | None = None

    @property
    def total_rows(self) -> int:
        """Rows of the whole update this batch belongs to: the loss normaliser ``B G`` (``T B G`` with ``T``)."""
        return self.update_rows if self.update_rows is not None else int(self.rewards.numel())

    @property
    def total_tokens(self) -> int:
        """Real response tokens of the whole update: the normaliser of token-mean aggregation."""
        return self.update_tokens if self.update_tokens is not None else int(self.response_mask.sum())

    def shard(self, rank: int, world: int) -> RolloutBatch:
        """Rank ``rank``'s share of ``world``: a contiguous block of whole groups.

        It keeps the whole update's padding and loss normalisers, so the shares' losses sum to the batch's loss.
        """
        if self.num_groups % world:
            raise ValueError(f"{self.num_groups} groups cannot be split evenly over {world} ranks")
        per_rank = self.num_groups // world
        share = self.groups_slice(rank * per_rank, (rank + 1) * per_rank)
        return replace(share, update_rows=self.total_rows, update_tokens=self.total_tokens)

    @property
    def num_groups(self) -> int:
        """``B``, the number of groups in the batch."""
        return int(self.versions.shape[0])

    @property
    def position_ids(self) -> Tensor:
        """``(N, P + L)`` positions that skip the left padding, as the generating engine saw them."""
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    def delays(self, step: int) -> Tensor:
        """``(N,)`` delay ``tau = step - s`` of every row when consumed at optimizer step ``step``."""
        return (step - self.versions).repeat_interleave(self.group_size)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy of the batch with every tensor field moved to ``device``."""
        moved = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return RolloutBatch(**moved)

    def groups_slice(self, start: int, stop: int) -> RolloutBatch:
        """The sub-batch of groups ``start:stop`` (used for micro-batching whole groups)."""
        g = self.group_size
        rows = slice(start * g, stop * g)
        return replace(
            self,
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows],
            behavior_logprobs=self.behavior_logprobs[rows],
            rewards=self.rewards[rows],
            versions=self.versions[start:stop],
            batch_ids=self.batch_ids[start:stop],
            prompt_ids=self.prompt_ids[start:stop],
        )


def collate_groups(groups: Sequence[RolloutGroup], pad_id: int, info: dict[str, float] | None = None) -> RolloutBatch:
    """Stack groups into one :class:`RolloutBatch` (prompts left-padded, responses right-padded)."""
    if not groups:
        raise ValueError("collate_groups needs at least one group")
    sizes = {g.group_size for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"all groups in a batch must have the same group size, got {sorted(sizes)}")
    (size,) = sizes
    width_l = max(int(g.response_ids.shape[1]) for g in groups)
    # One row per group, repeated G times: prompts are shared within a group.
    unpadded = [g.prompt_ids.long() for g in groups]
    group_prompts = pad_sequence(unpadded, batch_first=True, padding_value=pad_id, padding_side="left")  # (B, P)
    real = [torch.ones_like(ids, dtype=torch.bool) for ids in unpadded]
    group_mask = pad_sequence(real, batch_first=True, padding_value=False, padding_side="left")  # (B, P)
    width_p = group_prompts.shape[1]
    prompts = group_prompts.repeat_interleave(size, 0)  # (N, P)
    prompt_mask = group_mask.repeat_interleave(size, 0)  # (N, P)

    def right_padded(field: str, fill: float | bool | int, dtype: torch.dtype) -> Tensor:  # (N, L)
        parts = [getattr(g, field).to(dtype) for g in groups]
        if any(part.shape[1] != width_l for part in parts):  # groups from different generate calls
            parts = [torch.nn.functional.pad(part, (0, width_l - part.shape[1]), value=fill) for part in parts]
        return torch.cat(parts)

    responses = right_padded("response_ids", pad_id, torch.long)
    response_mask = right_padded("response_mask", False, torch.bool)
    behavior = right_padded("behavior_logprobs", 0.0, torch.float32)
    return RolloutBatch(
        input_ids=torch.cat([prompts, responses], dim=1),  # (N, P + L)
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1),  # (N, P + L)
        response_mask=response_mask,  # (N, L)
        behavior_logprobs=behavior.masked_fill(~response_mask, 0.0),  # (N, L)
        rewards=torch.cat([g.rewards.float() for g in groups]),  # (N,)
        versions=torch.tensor([g.version for g in groups], dtype=torch.long),  # (B,)
        prompt_width=width_p,
        group_size=size,
        batch_ids=torch.tensor([g.batch_id for g in groups], dtype=torch.long),  # (B,)
        prompt_ids=torch.tensor([g.prompt_id for g in groups], dtype=torch.long),  # (B,)
        info=dict(info or {}),
    )

"""The two records that cross the data/learner boundary: one prompt's group and one update's batch.

Prompts are left-padded to a common width ``P`` and responses right-padded to ``L``, as a causal LM generates them,
so that position ``P - 1 + t`` of every row predicts response token ``t`` and one index slices all the logits.
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

    Lightning moves it to the learner's device field by field, as it moves any dataclass.

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
        update_rows: ``N`` of the whole update when this batch is one rank's share of it (see :meth:`shards`);
            ``None`` when the batch is the whole update.
        update_tokens: The whole update's number of real response tokens, likewise.
        update_positions: ``(B_r,)`` indices in the whole update of this share's groups, in the share's order
            (see :meth:`shards`); ``None`` when the batch is the whole update.
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
    update_positions: Tensor | None = None

    @property
    def total_rows(self) -> int:
        """Rows of the whole update this batch belongs to: the loss normaliser ``B G`` (``T B G`` with ``T``)."""
        return self.update_rows if self.update_rows is not None else int(self.rewards.numel())

    @property
    def total_tokens(self) -> int:
        """Real response tokens of the whole update: the normaliser of token-mean aggregation."""
        return self.update_tokens if self.update_tokens is not None else int(self.response_mask.sum())

    def group_tokens(self) -> list[int]:
        """Real tokens of each group, prompt and responses (``(P_b + sum_i |y_bi|)`` per row, summed over ``G``)."""
        prompt = self.attention_mask[:, : self.prompt_width].sum(-1)  # (N,)
        per_row = prompt + self.response_mask.sum(-1)  # (N,)
        return per_row.reshape(self.num_groups, self.group_size).sum(-1).tolist()

    def shards(self, world: int) -> list[RolloutBatch]:
        """One share per rank: ``B / world`` whole groups each, balanced by tokens, each padded to its own width.

        Groups go to ranks by :func:`balanced_partition` of :meth:`group_tokens`; a share keeps the update's loss
        normalisers and its groups' positions in it, and is :meth:`trimmed`. One rank: the batch itself.
        """
        if world == 1:
            return [self]
        if self.num_groups % world:
            raise ValueError(f"{self.num_groups} groups cannot be split evenly over {world} ranks")
        shares = []
        for groups in balanced_partition(self.group_tokens(), world):
            share = self.select_groups(torch.tensor(groups, dtype=torch.long)).trimmed()
            shares.append(replace(share, update_rows=self.total_rows, update_tokens=self.total_tokens,
                                  update_positions=torch.tensor(groups, dtype=torch.long)))  # fmt: skip
        return shares

    def select_groups(self, groups: Tensor) -> RolloutBatch:
        """The sub-batch of the groups at indices ``groups`` ``(k,)``, in that order (copies)."""
        rows = (groups[:, None] * self.group_size + torch.arange(self.group_size)).flatten()  # (k G,)
        return self._take(rows, groups)

    def _take(self, rows: Tensor | slice, groups: Tensor | slice) -> RolloutBatch:
        """The batch with per-row fields indexed by ``rows`` and per-group fields by ``groups`` (the same groups)."""
        return replace(
            self,
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows],
            behavior_logprobs=self.behavior_logprobs[rows],
            rewards=self.rewards[rows],
            versions=self.versions[groups],
            batch_ids=self.batch_ids[groups],
            prompt_ids=self.prompt_ids[groups],
            update_positions=None if self.update_positions is None else self.update_positions[groups],
        )

    def trimmed(self) -> RolloutBatch:
        """The batch without its all-padding columns: prompt columns on the left, response columns on the right.

        Exact: positions come from the attention mask (:attr:`position_ids`), and padded columns are masked out
        of attention and of the loss. At least one response column stays, so per-token tensors keep their rank.
        """
        prompt_real = self.attention_mask[:, : self.prompt_width].any(0)  # (P,)
        cut = int(prompt_real.int().argmax()) if bool(prompt_real.any()) else self.prompt_width
        response_real = self.response_mask.any(0).nonzero()  # (k, 1) columns with a real token
        width = max(1, int(response_real.max()) + 1 if response_real.numel() else 1)
        stop = self.prompt_width + width
        return replace(
            self,
            input_ids=self.input_ids[:, cut:stop],
            attention_mask=self.attention_mask[:, cut:stop],
            response_mask=self.response_mask[:, :width],
            behavior_logprobs=self.behavior_logprobs[:, :width],
            prompt_width=self.prompt_width - cut,
        )

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

    def groups_slice(self, start: int, stop: int) -> RolloutBatch:
        """The sub-batch of groups ``start:stop`` (used for micro-batching whole groups)."""
        return self._take(slice(start * self.group_size, stop * self.group_size), slice(start, stop))  # views


def balanced_partition(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Indices ``0..len(weights)-1`` split into ``parts`` lists of equal length, the largest sum made small.

    Greedy: items in decreasing weight (ties by index) go to the lightest part with room (ties to the lowest), kept
    only where its largest part is lighter than contiguous blocks' (else those blocks). Each list is sorted.
    """
    if parts < 1 or len(weights) % parts:
        raise ValueError(f"{len(weights)} items cannot be split into {parts} parts of equal size")
    size = len(weights) // parts
    contiguous = [list(range(p * size, (p + 1) * size)) for p in range(parts)]
    greedy: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        part = min((p for p in range(parts) if len(greedy[p]) < size), key=lambda p: (loads[p], p))
        greedy[part].append(item)
        loads[part] += weights[item]

    def heaviest(partition: list[list[int]]) -> int:
        return max(sum(weights[i] for i in part) for part in partition)

    return [sorted(part) for part in greedy] if heaviest(greedy) < heaviest(contiguous) else contiguous


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

"""The rollout engine protocol (DESIGN.md §5) and the sampling options every engine takes.

The behaviour log-prob of a token is its log-probability under the distribution it was actually sampled from
(temperature and top-p applied), which is what the learner's ratio ``pi_theta / pi_behaviour`` needs. Rewards are
left at zero: the task scores them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lit_gmc.batch import RolloutGroup
from lit_gmc.data.tasks.base import Prompt
from lit_gmc.options import check_options


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: the paper's ``temperature`` and ``top_p`` are 1.0, its ``max_new_tokens`` ``T`` 4,096.

    ``temperature == 0`` is greedy (log-probs then use the raw logits). The same ``seed`` and weights give the same
    samples.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    seed: int = 0


@dataclass(frozen=True)
class Sampling:
    """The distribution training rollouts are sampled from (``--data.sampling.*``); the paper's is 1.0 and 1.0.

    What the engine is asked for on every training launch, with the DataModule's completion budget and the launch's
    seed (:meth:`params`); evaluation asks the same engine for other values, so they are no engine option.

    Args:
        temperature: Sampling temperature (> 0); the learner's log-probs divide by the same (``--model.temperature``,
            linked).
        top_p: Nucleus mass, in (0, 1].
    """

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_options("Sampling", self.option_problems(self.temperature, self.top_p))

    @staticmethod
    def option_problems(temperature: float, top_p: float) -> list[str]:
        """Every problem with the options, named by their fields."""
        problems = []
        if not temperature > 0:
            problems.append(f"temperature={temperature} must be > 0 for training rollouts")
        if not 0 < top_p <= 1:
            problems.append(f"top_p={top_p} must be in (0, 1]")
        return problems

    def params(self, max_new_tokens: int, seed: int) -> SamplingParams:
        """The :class:`SamplingParams` of one launch."""
        return SamplingParams(self.temperature, self.top_p, max_new_tokens, seed)


@runtime_checkable
class RolloutEngine(Protocol):
    """The one interface the DataModule and the evaluation callback use.

    An engine is built from its own options (a LightningCLI component, ``data.engine``); the DataModule then
    calls :meth:`start` with the actor, and reads :attr:`tokenizer` to decode and pad. An engine may also have a
    ``recompute_behavior_logprobs`` attribute (its option, as the shipped engines have): when true, the DataModule
    rescores its behaviour log-probs with the learner's numerics (``recompute.BehaviorRecompute``).
    """

    tokenizer: Any

    def start(self, actor: str) -> None:
        """Load the actor (``"tiny"``, a hub name or a local path) as the sampling weights, at version 0."""

    @property
    def version(self) -> int:
        """Policy version (optimizer updates) of the weights currently used for sampling."""

    def generate(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams) -> list[RolloutGroup]:
        """``n`` responses to each prompt, one :class:`RolloutGroup` per prompt, stamped with ``version``."""

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Replace the sampling weights in place and set ``version``."""

    def close(self) -> None:
        """Release the engine's resources; idempotent."""


@dataclass(frozen=True)
class Sample:
    """One completion: its tokens, their behaviour log-probs, and whether it stopped at EOS."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool


def rollout_group(prompt: Prompt, prompt_ids: list[int], samples: Sequence[Sample], version: int,
                  tokenizer) -> RolloutGroup:  # fmt: skip
    """One prompt's samples as a right-padded :class:`RolloutGroup` (EOS kept), the form every engine returns."""
    width = max(1, max(len(s.token_ids) for s in samples))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(samples), width), pad, dtype=torch.long)  # (G, L)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)  # (G, L)
    logprobs = torch.zeros((len(samples), width), dtype=torch.float32)  # (G, L)
    for row, sample in enumerate(samples):
        k = len(sample.token_ids)
        if len(sample.logprobs) != k:
            raise ValueError(f"prompt {prompt.id}: {k} sampled tokens but {len(sample.logprobs)} log-probs")
        ids[row, :k] = torch.tensor(sample.token_ids, dtype=torch.long)
        mask[row, :k] = True
        logprobs[row, :k] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return RolloutGroup(
        prompt_id=prompt.id,
        prompt=prompt.text,
        answer=prompt.answer,
        prompt_ids=torch.tensor(prompt_ids, dtype=torch.long),
        response_ids=ids,
        response_mask=mask,
        behavior_logprobs=logprobs,
        finish_reasons=["stop" if s.stopped else "length" for s in samples],
        rewards=torch.zeros(len(samples)),
        version=version,
    )

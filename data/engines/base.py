"""The rollout engine protocol (DESIGN.md §5) and the sampling options every engine takes.

The behaviour log-prob of a token is its log-probability under the distribution it was actually sampled from
(temperature and top-p applied), which is what the learner's ratio ``pi_theta / pi_behaviour`` needs. Rewards are
left at zero: the task scores them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from lit_gmc.batch import RolloutGroup
from lit_gmc.data.tasks.base import Prompt


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


@runtime_checkable
class RolloutEngine(Protocol):
    """The one interface the DataModule and the evaluation callback use.

    An engine is built from its own options (a LightningCLI component, ``data.engine``); the DataModule then
    calls :meth:`start` with the actor, and reads :attr:`tokenizer` to decode and pad.
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

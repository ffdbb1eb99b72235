"""Verifiable tasks and the resumable prompt stream that feeds the rollout engine.

A task is a list of training prompts, a list of held-out prompts and a reward function; the stream
walks the training prompts in a seeded order, epoch after epoch, and can be checkpointed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lit_gmc.data.components import check_options


@dataclass(frozen=True)
class Prompt:
    """One verifiable problem: ``text`` is what the engine sees, ``answer`` what the reward checks."""

    id: int
    text: str
    answer: str


@runtime_checkable
class Task(Protocol):
    """What the DataModule needs from a task (``data.task``): any class with these three methods works.

    A task may also define ``setup(tokenizer)``: the DataModule calls it once, with the rollout engine's
    tokenizer, before it reads the prompts (e.g. to cut prompts to a token budget counted in the tokens the
    engine will see). The task's own ``score`` is the reward unless ``--data.reward`` names another function.
    """

    def train_prompts(self) -> Sequence[Prompt]:
        """Training prompts, in a fixed order (the stream shuffles)."""

    def test_prompts(self) -> Sequence[Prompt]:
        """Held-out prompts, never trained on."""

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        """Rewards of the completions of one prompt, each in ``[0, 1]``."""


class Addition(Task):
    """``"a+b="`` with ``a, b`` in ``0..max_operand``; the answer is the decimal sum, one to three digits.

    The answer's length varies with the operands, so response lengths differ across prompts (what the
    length-coupled virtual clock couples to). One pair in ten, chosen by a fixed rule, is held out.

    Args:
        max_operand: Largest operand.
    """

    def __init__(self, max_operand: int = 69) -> None:
        check_options("Addition", self.option_problems(max_operand))
        pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        rows = [Prompt(i, f"{a}+{b}=", str(a + b)) for i, (a, b) in enumerate(pairs)]
        held_out = {i for i, (a, b) in enumerate(pairs) if (7 * a + 3 * b) % 10 == 0}
        self._train = [p for p in rows if p.id not in held_out]
        self._test = [p for p in rows if p.id in held_out]

    @staticmethod
    def option_problems(max_operand: int) -> list[str]:
        """Every problem with the options, named by their init args."""
        return [f"max_operand={max_operand} must be >= 1"] if max_operand < 1 else []

    def train_prompts(self) -> Sequence[Prompt]:
        """The training prompts (sums not held out)."""
        return self._train

    def test_prompts(self) -> Sequence[Prompt]:
        """The held-out prompts, those with ``(7a + 3b) % 10 == 0``."""
        return self._test

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        """Reward 1.0 for each completion equal to ``answer`` after stripping whitespace, else 0.0."""
        return [float(c.strip() == answer) for c in completions]


class PromptStream:
    """Endless seeded walk over a task's training prompts: a fresh permutation every epoch.

    Args:
        prompts: The prompts to walk.
        seed: Seed of the permutations (epoch ``e`` uses ``seed + e``, so the order is reproducible).
    """

    def __init__(self, prompts: Sequence[Prompt], seed: int = 0) -> None:
        if not prompts:
            raise ValueError("the prompt stream needs at least one prompt")
        self.prompts = prompts
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[Prompt]:
        """The next ``k`` prompts."""
        out = []
        for _ in range(k):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.prompts[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: seed, epoch and position in the epoch's permutation."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` and rebuild the epoch's permutation."""
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)


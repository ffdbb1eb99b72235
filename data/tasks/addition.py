"""The embedded default's task: ``"a+b="``, verifiable, generated in code, answers of one to three digits."""

from __future__ import annotations

from collections.abc import Sequence

from lit_gmc.actor import addition_problems
from lit_gmc.data.tasks.base import Prompt, Task
from lit_gmc.options import check_options


class Addition(Task):
    """``"a+b="`` with ``a, b`` in ``0..max_operand``; the answer is the decimal sum, one to three digits.

    The answer's length varies with the operands, so response lengths differ across prompts (what the
    length-coupled virtual clock couples to). One pair in ten, chosen by a fixed rule, is held out.

    Args:
        max_operand: Largest operand.
    """

    def __init__(self, max_operand: int = 69) -> None:
        check_options("Addition", self.option_problems(max_operand))
        train, test = addition_problems(max_operand)
        self._train = [Prompt(*row) for row in train]
        self._test = [Prompt(*row) for row in test]

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

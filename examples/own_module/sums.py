"""The example's task, apart from its training code so that its scorer has an import path (``sums.exact_match``).

Questions are ``"a+b"`` with one-digit operands whose sum is one digit; the prompt is the question followed by
``=`` and the answer is the sum's digit.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

MAX_OPERAND = 4


def questions(count: int, seed: int) -> list[tuple[str, str]]:
    """``count`` seeded ``(question, answer)`` pairs, e.g. ``("3+4", "7")``."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)) for _ in range(count)]
    return [(f"{a}+{b}", str(a + b)) for a, b in pairs]


def prompt(question: str) -> str:
    """The training prompt; the evaluation reaches the same text through its template ``"{question}="``."""
    return f"{question}="


def exact_match(completions: Sequence[str], answer: str) -> list[float]:
    """1.0 for a completion that is exactly the answer, else 0.0: the training reward and the evaluation scorer."""
    return [float(completion.strip() == answer) for completion in completions]


def write_benchmark(path: Path, count: int = 12, seed: int = 1234) -> Path:
    """A held-out benchmark file in the columns a project of its own would choose (``expr``, ``sum``)."""
    rows = [{"expr": question, "sum": int(answer)} for question, answer in questions(count, seed)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path

"""The tiny actor's character tokenizer."""

from __future__ import annotations

import pytest
from run_helpers import fit, write_config

from lit_gmc.errors import UserError

WORDY_TASK = """
from collections.abc import Sequence

from lit_gmc.data.tasks.base import Prompt


class Wordy:
    def train_prompts(self) -> Sequence[Prompt]:
        return [Prompt(0, "2+2=", "4"), Prompt(1, "What is 3 times 4?", "12")]

    def test_prompts(self) -> Sequence[Prompt]:
        return self.train_prompts()

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        return [float(c.strip() == answer) for c in completions]
"""


def test_the_tiny_tokenizer_refuses_characters_it_cannot_encode(tmp_path, monkeypatch):
    (tmp_path / "wordy.py").write_text(WORDY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as caught:
        fit(write_config(tmp_path, "wordy", total=1, task={"class_path": "wordy.Wordy"}))
    assert str(caught.value).startswith(
        "--model.actor tiny: its character tokenizer encodes only '0123456789+-=*() abcdefghijklmnopqrstuvwxyz', and "
        "the task's prompts also hold '?W' (first in prompt 1: 'What is 3 times 4?'), which it would read as <unk>; "
        "choose a model with a real tokenizer (--model.actor"
    )

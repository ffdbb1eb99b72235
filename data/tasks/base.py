"""The task protocol: prompts and their check, the chat-template wrapping and prompt budget every task gets, the stream.

A task is training prompts, held-out prompts and a reward; the stream walks the training prompts in a seeded,
checkpointable order, epoch after epoch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from lit_gmc.errors import UserError


@dataclass(frozen=True)
class Prompt:
    """One verifiable problem, as a task gives it.

    Attributes:
        id: An ``int``, unique among the task's training prompts; it becomes a tensor (``RolloutBatch.prompt_ids``).
        text: The prompt, a non-empty ``str``, never in a chat template (the DataModule applies one if asked).
        answer: The reference answer given to the reward, a ``str`` (may be empty for a reward that ignores it).
    """

    id: int
    text: str
    answer: str


@runtime_checkable
class Task(Protocol):
    """What the DataModule needs from a task (``data.task``): any class with these three methods works.

    No subclassing or registration; its init args become ``--data.task.<name>`` options. Once the engine has started,
    the DataModule (rank 0, once) calls the optional ``setup(tokenizer)``, checks every training prompt, applies
    ``--data.chat_template`` and ``--data.max_prompt_tokens``, and checks the longest against the actor's context.
    ``score`` is the reward unless ``--data.reward`` names another; ``test_prompts`` is for evaluation only.
    """

    def train_prompts(self) -> Sequence[Prompt]:
        """Training prompts, in a fixed order (the stream shuffles)."""

    def test_prompts(self) -> Sequence[Prompt]:
        """Held-out prompts, never trained on."""

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        """Rewards of the completions of one prompt: any finite numbers (``None`` for one: skip it, as in TRL).

        Not bounded to ``[0, 1]``: every rule's gradient depends only on the differences of rewards within a
        group, so a constant added to every reward changes nothing, and rewards multiplied by ``a`` multiply the
        gradient by ``a`` (as SGD's learning rate would; Adam's normalisation mostly undoes it), except for VCPO and
        CISPO, which divide by the group's std. The paper's reward bound ``R`` is then the range's width. Rewards
        travel as float32 (24 bits): far from 0 their differences lose digits (near 1,000, steps below 6e-5).
        """


def prompt_problem(task: str, prompts: Sequence[Any]) -> str | None:
    """Why the first bad one of ``task``'s training ``prompts`` breaks the :class:`Prompt` contract, or ``None``."""
    if not prompts:
        return f"task {task} gave no training prompts (train_prompts() is empty)"
    seen: dict[int, int] = {}
    for index, prompt in enumerate(prompts):
        where = f"task {task}: training prompt {index}"
        if not all(hasattr(prompt, name) for name in ("id", "text", "answer")):
            return f"{where} is a {type(prompt).__name__}, not a lit_gmc.data.tasks.base.Prompt(id, text, answer)"
        where += f" (id {prompt.id!r})"
        if isinstance(prompt.id, bool) or not isinstance(prompt.id, int):
            return f"{where}: Prompt.id must be an int, got {type(prompt.id).__name__} (number your prompts 0, 1, ...)"
        if prompt.id in seen:
            return f"{where}: Prompt.id repeats that of training prompt {seen[prompt.id]}; ids must be unique"
        seen[prompt.id] = index
        if not isinstance(prompt.text, str) or not prompt.text:
            return f"{where}: Prompt.text must be a non-empty str, got {short_repr(prompt.text)}"
        if not isinstance(prompt.answer, str):
            return (
                f"{where}: Prompt.answer must be a str, got {type(prompt.answer).__name__} {short_repr(prompt.answer)}"
            )
    return None


def short_repr(value: Any, width: int = 40) -> str:
    """``repr`` of a value, cut to ``width`` characters."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def prompts_in_chat_template(prompts: Sequence[Any], tokenizer: Any, option: str = "--data.chat_template") -> list[Any]:
    """``prompts`` (dataclasses with a ``text``), each text a user turn in ``tokenizer``'s chat template.

    The template's special tokens are then part of the text, which no engine tokenizes with special tokens.
    """
    turns = [[{"role": "user", "content": prompt.text}] for prompt in prompts]
    try:
        texts = [tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) for turn in turns]
    except (ValueError, AttributeError) as err:  # transformers: "Cannot use chat template functions ... not set"
        raise UserError(
            f"{option}: the actor's tokenizer has no chat template ({type(tokenizer).__name__}); leave {option} "
            "off for a base model, or choose an instruction-tuned actor"
        ) from err
    return [replace(prompt, text=text) for prompt, text in zip(prompts, texts, strict=True)]


class PromptStream:
    """Endless seeded walk over a task's training prompts: a fresh permutation every epoch, seeded ``seed + epoch``."""

    def __init__(self, prompts: Sequence[Prompt], seed: int = 0) -> None:
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


def truncate_prompt(text: str, tokenizer: Any, max_tokens: int) -> str:
    """``text`` with its beginning cut so that it tokenizes to at most ``max_tokens`` tokens.

    The end holds the question and the cue the model continues from. Only a tail window is tokenized (widened as
    needed); the cut falls on a token boundary, then moves right until the kept text re-tokenizes within budget
    (BPE merges can differ at the new start). Needs a fast tokenizer (character offsets).
    """
    if max_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_tokens}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("prompt truncation needs a fast tokenizer (character offsets of tokens)")
    window = 8 * max_tokens
    while True:
        start = max(0, len(text) - window)
        piece = text[start:]
        offsets = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) > max_tokens or start == 0:
            break
        window *= 4
    if len(offsets) <= max_tokens:
        return text
    for index in range(len(offsets) - max_tokens, len(offsets)):
        kept = piece[offsets[index][0] :]
        if len(tokenizer(kept, add_special_tokens=False)["input_ids"]) <= max_tokens:
            return kept
    return ""

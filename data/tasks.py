"""Verifiable tasks and the resumable prompt stream that feeds the rollout engine.

A task is a list of training prompts, a list of held-out prompts and a reward function; the stream
walks the training prompts in a seeded order, epoch after epoch, and can be checkpointed.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import random
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from lit_gmc.data.components import check_options
from lit_gmc.errors import UserError


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
    tokenizer, before it reads the prompts (e.g. to wrap them in the tokenizer's chat template). The DataModule then
    cuts every task's training prompts to ``--data.max_prompt_tokens`` and checks the longest against the actor's
    context. The task's own ``score`` is the reward unless ``--data.reward`` names another function.
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
        chat_template: Wrap each prompt in the actor tokenizer's chat template, as a user turn followed by the
            assistant's opening (for an instruction-tuned ``--model.actor``; the tiny actor has none).
    """

    def __init__(self, max_operand: int = 69, chat_template: bool = False) -> None:
        check_options("Addition", self.option_problems(max_operand))
        self.chat_template = chat_template
        pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        rows = [Prompt(i, f"{a}+{b}=", str(a + b)) for i, (a, b) in enumerate(pairs)]
        held_out = {i for i, (a, b) in enumerate(pairs) if (7 * a + 3 * b) % 10 == 0}
        self._train = [p for p in rows if p.id not in held_out]
        self._test = [p for p in rows if p.id in held_out]

    @staticmethod
    def option_problems(max_operand: int) -> list[str]:
        """Every problem with the options, named by their init args."""
        return [f"max_operand={max_operand} must be >= 1"] if max_operand < 1 else []

    def setup(self, tokenizer: Any) -> None:
        """With ``chat_template``, wrap every prompt in ``tokenizer``'s chat template (:func:`in_chat_template`)."""
        if self.chat_template:
            self._train = prompts_in_chat_template(self._train, tokenizer)
            self._test = prompts_in_chat_template(self._test, tokenizer)

    def train_prompts(self) -> Sequence[Prompt]:
        """The training prompts (sums not held out)."""
        return self._train

    def test_prompts(self) -> Sequence[Prompt]:
        """The held-out prompts, those with ``(7a + 3b) % 10 == 0``."""
        return self._test

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        """Reward 1.0 for each completion equal to ``answer`` after stripping whitespace, else 0.0."""
        return [float(c.strip() == answer) for c in completions]


def in_chat_template(text: str, tokenizer: Any, option: str = "--data.task.chat_template") -> str:
    """``text`` as a user turn in ``tokenizer``'s chat template, followed by the assistant's opening.

    The template's own special tokens are part of the text, so the engine must not add them again (neither engine
    does: prompts are tokenized without special tokens).
    """
    try:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    except (ValueError, AttributeError) as err:  # transformers: "Cannot use chat template functions ... not set"
        raise UserError(
            f"{option}: the actor's tokenizer has no chat template ({type(tokenizer).__name__}); leave {option} "
            "off for a base model, or choose an instruction-tuned actor"
        ) from err


def prompts_in_chat_template(
    prompts: Sequence[Any], tokenizer: Any, option: str = "--data.task.chat_template"
) -> list[Any]:
    """``prompts`` (dataclasses with a ``text``, e.g. :class:`Prompt`), each text :func:`in_chat_template`."""
    return [replace(prompt, text=in_chat_template(prompt.text, tokenizer, option)) for prompt in prompts]


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


def function_name(function: Callable) -> str:
    """``module.qualname`` of a function or bound method (``Addition.score``), for messages."""
    owner = getattr(function, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{getattr(function, '__name__', 'score')}"
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"{module}.{name}" if module and module != "__main__" else name


def calling_convention(function: Callable, name: str) -> str:
    """``"native"`` for ``(completions, answer)``, ``"trl"`` for TRL's ``(prompts, completions, **kwargs)``.

    A function that has a ``prompts`` parameter, or that cannot take two positional arguments but takes keywords,
    is called as TRL calls its reward functions: by keyword, ``prompts`` and ``completions`` lists and one list per
    extra column, here ``answer`` (the prompt's reference answer, repeated for each completion).
    """
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: called as documented
        return "native"
    params = signature.parameters
    with contextlib.suppress(TypeError):
        if "prompts" in params:
            signature.bind(prompts=[], completions=[], answer=[])
            return "trl"
        signature.bind([], "")
        return "native"
    with contextlib.suppress(TypeError):
        signature.bind(prompts=[], completions=[], answer=[])
        return "trl"
    raise UserError(
        f"reward {name}{signature} takes neither (completions, answer) nor TRL's (prompts, completions, **kwargs)"
    )


class Reward:
    """The run's reward function, called one way whatever its form, its result checked before it is used.

    ``Reward(function, name)(completions, answer, prompt, prompt_id)`` returns one float per completion.
    ``function`` is the task's ``score`` or ``--data.reward``, of either form of :func:`calling_convention`. A result
    that is not one number per completion (None, a number, a list of the wrong length, an entry that is no number)
    raises one :class:`UserError` naming the function, and so does a NaN or infinite reward (naming the prompt id
    too): checked where rewards enter, since one would make every rule's gradient non-finite. Rewards outside
    ``[0, 1]`` (where ``Task.score`` documents them) are used as they are, with one warning that shows the values.

    Args:
        function: The reward function.
        name: How messages name it (``--data.reward my_project.rewards.exact_match``, ``Addition.score``).
    """

    def __init__(self, function: Callable, name: str) -> None:
        if not callable(function):
            raise UserError(f"reward {name} is not callable (got {type(function).__name__})")
        self.function = function
        self.name = name
        self.convention = calling_convention(function, name)
        self.warned_scale = False

    @classmethod
    def of(cls, reward: Callable | None, task: Task) -> Reward:
        """``--data.reward`` when given, else the task's own ``score``."""
        if reward is not None:
            return cls(reward, f"--data.reward {function_name(reward)}")
        return cls(task.score, f"{type(task).__name__}.score (the task's reward)")

    def __call__(
        self, completions: Sequence[str], answer: str, prompt: str = "", prompt_id: int | None = None
    ) -> list[float]:
        """One finite float reward per completion of one prompt (``prompt_id`` names it in messages)."""
        completions = list(completions)
        if self.convention == "trl":
            count = len(completions)
            result = self.function(prompts=[prompt] * count, completions=completions, answer=[answer] * count)
        else:
            result = self.function(completions, answer)
        return self.checked(result, len(completions), prompt_id)

    def checked(self, result: Any, count: int, prompt_id: int | None = None) -> list[float]:
        """``result`` as ``count`` finite floats, or one :class:`UserError` naming the function and what it returned."""
        expected = f"it must return a list of {count} numbers, one reward per completion"
        if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
            raise UserError(f"reward {self.name} returned {short(result)} for {count} completions; {expected}")
        values = list(result)
        if len(values) != count:
            raise UserError(f"reward {self.name} returned {len(values)} values for {count} completions; {expected}")
        rewards = []
        for value in values:
            try:
                rewards.append(float(value))  # bool, numpy and 0-dim torch numbers too
            except (TypeError, ValueError):
                raise UserError(f"reward {self.name} returned {short(value)} among its rewards; {expected}") from None
        for index, value in enumerate(rewards):
            if not math.isfinite(value):
                where = f"response {index}" + (f" of prompt {prompt_id}" if prompt_id is not None else "")
                raise UserError(
                    f"reward {self.name} gave {short(values[index])} for {where} (rewards {short(values)}): rewards "
                    "must be finite numbers"
                )
        outside = [value for value in rewards if math.isfinite(value) and not 0.0 <= value <= 1.0]
        if outside and not self.warned_scale:
            self.warned_scale = True
            warnings.warn(
                f"reward {self.name} returned {outside[:4]} outside [0, 1], the range Task.score documents; they "
                "are used as they are (this warning is shown once)",
                stacklevel=2,
            )
        return rewards


def short(value: Any) -> str:
    """``repr`` of a value, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

"""The run's reward: the task's ``score`` or ``--data.reward``, called one way whatever its form, its result checked."""

from __future__ import annotations

import inspect
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from typing import Any

from lit_gmc.data.tasks.base import Task, short_repr
from lit_gmc.distributed import Interrupted
from lit_gmc.errors import UserError, first_line

# How often a wait for a reward looks at the clock and at ``stop``: a SIGTERM is acted on within this.
POLL_S = 0.1


def function_name(function: Callable) -> str:
    """``module.qualname`` of a function or bound method (``Addition.score``), for messages."""
    owner = getattr(function, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{getattr(function, '__name__', 'score')}"
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"{module}.{name}" if module and module != "__main__" else name


TRL_ONLY_NAMES = ("prompts", "solution", "completion_ids")
"""Parameters only a TRL reward function has: one of them (or ``**kwargs``) means it is called the TRL way."""

TRL_ANSWER_NAMES = ("answer", "solution")
"""The names the reference answer is passed under, TRL's way: ours, and the column TRL's own rewards read
(``trl.rewards.accuracy_reward(completions, solution, **kwargs)`` and its siblings)."""

TRL_KEYWORDS = ("prompts", "completions", "completion_ids", *TRL_ANSWER_NAMES)


def trl_keywords(function: Callable, name: str) -> frozenset[str] | None:
    """The keywords of :data:`TRL_KEYWORDS` a TRL-style ``function`` takes; ``None``: it is ``f(completions, answer)``.

    A function with ``**kwargs`` (every keyword) or a parameter only TRL passes (:data:`TRL_ONLY_NAMES`) is called as
    TRL's ``GRPOTrainer`` calls one (:meth:`Reward.trl_arguments`); any other must take ``(completions, answer)``.
    """
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: called as documented
        return None
    params = signature.parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    trl = takes_kwargs or any(trl_name in params for trl_name in TRL_ONLY_NAMES)
    keywords = frozenset(key for key in TRL_KEYWORDS if takes_kwargs or key in params)
    try:
        if trl:
            signature.bind(**dict.fromkeys(keywords, []))
        else:
            signature.bind([], "")
    except TypeError:
        raise UserError(
            f"reward {name}{signature} takes neither (completions, answer) nor TRL's keywords (prompts, completions, "
            "completion_ids, answer, solution, **kwargs)"
        ) from None
    return keywords if trl else None


class Reward:
    """The run's reward function, called one way whatever its form, its result checked before it is used.

    ``Reward(function, name)(completions, answer, prompt, prompt_id)`` returns one float per completion, for the
    task's ``score`` or ``--data.reward`` in either form of :func:`trl_keywords` (TRL's: :meth:`trl_arguments`).

    ``None`` is TRL's "skip this example": the mean of its group's other rewards (0.0 for a group of ``None``), with
    one warning. A wrong count or type, a non-finite reward, a call that raises or one past ``timeout_s`` is one
    :class:`UserError` naming the function. Any finite reward is used as it is (why: ``Task.score``).

    ``name`` is how messages name it (``--data.reward my_project.rewards.exact_match``, ``Addition.score``); ``chat``
    says prompts are in the chat template; ``timeout_s`` ``None`` is no limit, the call then made in the caller's
    thread; a ``stop`` that turns true (a SIGTERM) ends a wait with :class:`RewardInterrupted`.
    """

    def __init__(
        self,
        function: Callable,
        name: str,
        chat: bool = False,
        timeout_s: float | None = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> None:
        if not callable(function):
            raise UserError(f"reward {name} is not callable (got {type(function).__name__})")
        self.function = function
        self.name = name
        self.chat = chat
        self.keywords = trl_keywords(function, name)  # None: called as f(completions, answer)
        self.warned: set[str] = set()  # the kinds of warning given, each once
        self.timeout_s = timeout_s
        self.stop = stop

    @classmethod
    def of(
        cls,
        reward: Callable | None,
        task: Task,
        chat: bool = False,
        timeout_s: float | None = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> Reward:
        """``--data.reward`` when given, else the task's own ``score``."""
        if reward is not None:
            return cls(reward, f"--data.reward {function_name(reward)}", chat, timeout_s, stop)
        return cls(task.score, f"{type(task).__name__}.score (the task's reward)", chat, timeout_s, stop)

    @property
    def convention(self) -> str:
        """``"native"`` for ``f(completions, answer)``, ``"trl"`` for TRL's ``f(prompts=, completions=, **kwargs)``."""
        return "native" if self.keywords is None else "trl"

    @property
    def called_as(self) -> str:
        """How the function is called, for messages."""
        if self.keywords is None:
            return "called as f(completions, answer)"
        form = "message lists" if self.chat else "strings"
        return f"called the TRL way, by keyword: prompts, completions ({form}), completion_ids, answer, solution"

    def __call__(
        self,
        completions: Sequence[str],
        answer: str,
        prompt: str = "",
        prompt_id: int | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[float]:
        """One finite float reward per completion of one prompt; ``prompt`` is the task's text, before any template."""
        completions = list(completions)
        if self.keywords is None:
            result = self.timed(lambda: self.function(completions, answer), prompt_id)
        else:
            arguments = self.trl_arguments(completions, answer, prompt, completion_ids)
            result = self.timed(lambda: self.function(**arguments), prompt_id)
        return self.checked(result, len(completions), prompt_id)

    def trl_arguments(
        self, completions: list[str], answer: str, prompt: str, completion_ids: Sequence[Sequence[int]] | None
    ) -> dict[str, list[Any]]:
        """What TRL passes by keyword, one entry per completion, of the names the function takes.

        ``prompts`` and ``completions`` (message lists under ``--data.chat_template``), ``completion_ids``, and the
        reference as ``answer`` and ``solution``.
        """
        count = len(completions)
        ids = [list(row) for row in completion_ids] if completion_ids is not None else [[] for _ in completions]
        messages = [[{"role": "assistant", "content": text}] for text in completions]  # a conversational prompt's
        arguments: dict[str, list[Any]] = {
            "prompts": [[{"role": "user", "content": prompt}] if self.chat else prompt] * count,
            "completions": messages if self.chat else completions,
            "completion_ids": ids,
            **{key: [answer] * count for key in TRL_ANSWER_NAMES},
        }
        return {key: value for key, value in arguments.items() if key in self.keywords}

    def timed(self, call: Callable[[], Any], prompt_id: int | None) -> Any:
        """``call()``, its error and its time limit reported as one :class:`UserError` naming the function."""
        where = f" on prompt {prompt_id}" if prompt_id is not None else ""
        outcome: Future = Future()

        def run() -> None:
            try:
                outcome.set_result(call())
            except BaseException as err:  # reported in the waiting thread
                outcome.set_exception(err)

        if self.timeout_s is None:
            run()  # no limit: in the caller's thread
        else:  # a daemon thread: one that never returns is left behind, and does not keep the process alive at exit
            threading.Thread(target=run, name="lit_gmc-reward", daemon=True).start()
            deadline = time.monotonic() + self.timeout_s
            while not wait([outcome], timeout=min(POLL_S, max(deadline - time.monotonic(), 0.0))).done:
                if self.stop():
                    raise RewardInterrupted(f"reward {self.name}: the wait for it was interrupted{where}")
                if time.monotonic() >= deadline:
                    raise UserError(
                        f"reward {self.name} did not return within {self.timeout_s:g} s{where} "
                        "(--data.reward_timeout_s): the run stops here; make the reward faster or raise the limit"
                    )
        try:
            return outcome.result()
        except Exception as err:
            raise self.raised(err, where) from err

    def raised(self, err: Exception, where: str) -> UserError:
        """The one-line error for a reward call that raised ``err`` (a ``UserError`` of its own stays as it is)."""
        if isinstance(err, UserError):
            return err
        return UserError(f"reward {self.name} raised {type(err).__name__}{where}: {first_line(err)}")

    def checked(self, result: Any, count: int, prompt_id: int | None = None) -> list[float]:
        """``result`` as ``count`` finite floats (``None``: the others' mean), or one :class:`UserError`."""
        expected = f"it must return a list of {count} numbers, one reward per completion"
        who = f"reward {self.name}, {self.called_as},"
        of_prompt = f" of prompt {prompt_id}" if prompt_id is not None else ""
        if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
            raise UserError(f"{who} returned {short_repr(result, 60)} for {count} completions; {expected}")
        values = list(result)
        if len(values) != count:
            raise UserError(f"{who} returned {len(values)} values for {count} completions; {expected}")
        rewards: list[float | None] = []
        for value in values:
            try:
                rewards.append(None if value is None else float(value))  # bool, numpy and 0-dim torch numbers too
            except (TypeError, ValueError):
                raise UserError(f"{who} returned {short_repr(value, 60)} among its rewards; {expected}") from None
        for index, value in enumerate(rewards):
            if value is not None and not math.isfinite(value):
                raise UserError(
                    f"{who} gave {short_repr(values[index], 60)} for response {index}{of_prompt} (rewards "
                    f"{short_repr(values, 60)}): rewards must be finite numbers (or None, TRL's 'skip this example')"
                )
        given = [value for value in rewards if value is not None]
        if len(given) < count:
            self.warn_once("skip", f"reward {self.name} returned None for {count - len(given)} of {count} completions"
                           f"{of_prompt}: taken as TRL's 'skip this example' (each gets its group's mean reward, so no "
                           "advantage; 0.0 when the whole group is None); this warning is shown once")  # fmt: skip
        baseline = sum(given) / len(given) if given else 0.0
        return [baseline if value is None else value for value in rewards]

    def warn_once(self, kind: str, message: str) -> None:
        """Warn with ``message`` unless a warning of this ``kind`` was given already."""
        if kind not in self.warned:
            self.warned.add(kind)
            warnings.warn(message, stacklevel=3)


class RewardInterrupted(Interrupted):
    """A wait for a reward ended because ``stop`` turned true (a SIGTERM): the run is stopping."""

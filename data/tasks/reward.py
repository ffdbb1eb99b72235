"""The run's reward: the task's ``score`` or ``--data.reward``, called one way whatever its form, its result checked."""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lit_gmc.data.tasks.base import Task
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

    A call that raises is one :class:`UserError` naming the function and its error (the traceback stays chained
    for ``python -X dev``-style debugging). A call that takes longer than ``timeout_s`` is one :class:`UserError`
    naming the function and the option: the call runs in a daemon thread while the caller waits for it, so a
    reward that hangs stops the run, and a ``stop`` that turns true (a SIGTERM) ends the wait at once.

    Args:
        function: The reward function.
        name: How messages name it (``--data.reward my_project.rewards.exact_match``, ``Addition.score``).
        timeout_s: Longest one call may take (``--data.reward_timeout_s``); ``None``: no limit, called in the
            caller's thread.
        stop: Polled while waiting; true: the wait ends with :class:`RewardInterrupted`.
    """

    def __init__(
        self,
        function: Callable,
        name: str,
        timeout_s: float | None = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> None:
        if not callable(function):
            raise UserError(f"reward {name} is not callable (got {type(function).__name__})")
        self.function = function
        self.name = name
        self.convention = calling_convention(function, name)
        self.warned_scale = False
        self.timeout_s = timeout_s
        self.stop = stop

    @classmethod
    def of(
        cls,
        reward: Callable | None,
        task: Task,
        timeout_s: float | None = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> Reward:
        """``--data.reward`` when given, else the task's own ``score``."""
        if reward is not None:
            return cls(reward, f"--data.reward {function_name(reward)}", timeout_s, stop)
        return cls(task.score, f"{type(task).__name__}.score (the task's reward)", timeout_s, stop)

    def __call__(
        self, completions: Sequence[str], answer: str, prompt: str = "", prompt_id: int | None = None
    ) -> list[float]:
        """One finite float reward per completion of one prompt (``prompt_id`` names it in messages)."""
        completions = list(completions)
        if self.convention == "trl":
            count = len(completions)
            kwargs = {"prompts": [prompt] * count, "completions": completions, "answer": [answer] * count}
            result = self.timed(lambda: self.function(**kwargs), prompt_id)
        else:
            result = self.timed(lambda: self.function(completions, answer), prompt_id)
        return self.checked(result, len(completions), prompt_id)

    def timed(self, call: Callable[[], Any], prompt_id: int | None) -> Any:
        """``call()``, its error and its time limit reported as one :class:`UserError` naming the function."""
        where = f" on prompt {prompt_id}" if prompt_id is not None else ""
        if self.timeout_s is None:
            try:
                return call()
            except Exception as err:
                raise self.raised(err, where) from err
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["result"] = call()
            except BaseException as err:  # reported in the waiting thread
                outcome["error"] = err
            finally:
                done.set()

        # A daemon thread: one that never returns is left behind and does not keep the process alive at exit.
        threading.Thread(target=run, name="lit_gmc-reward", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not done.wait(min(POLL_S, max(deadline - time.monotonic(), 0.0))):
            if self.stop():
                raise RewardInterrupted(f"reward {self.name}: the wait for it was interrupted{where}")
            if time.monotonic() >= deadline:
                raise UserError(
                    f"reward {self.name} did not return within {self.timeout_s:g} s{where} "
                    "(--data.reward_timeout_s): the run stops here; make the reward faster or raise the limit"
                )
        if "error" in outcome:
            err = outcome["error"]
            if not isinstance(err, Exception):
                raise err
            raise self.raised(err, where) from err
        return outcome["result"]

    def raised(self, err: Exception, where: str) -> UserError:
        """The one-line error for a reward call that raised ``err`` (a ``UserError`` of its own stays as it is)."""
        if isinstance(err, UserError):
            return err
        return UserError(f"reward {self.name} raised {type(err).__name__}{where}: {first_line(err)}")

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


class RewardInterrupted(Exception):
    """A wait for a reward ended because ``stop`` turned true (a SIGTERM): the run is stopping."""


def short(value: Any) -> str:
    """``repr`` of a value, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

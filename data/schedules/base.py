"""Delay schedules (DESIGN.md §4): which generated batch the learner consumes at each optimizer step.

A schedule decides when to ask the producer for batches, which always come from the *current* policy, so the
schedule alone sets the delay ``tau = n - s`` of every consumed batch. It never drops one: everything produced is
consumed. Its ``state_dict`` holds plain containers and tensors, so checkpoints load with ``weights_only=True``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, ClassVar

from lit_gmc.batch import RolloutGroup
from lit_gmc.options import check_options

Batch = list[RolloutGroup]
Producer = Callable[..., list[Batch]]
"""``produce(k)``: ``k`` batches of B groups from the current policy, in launch order; ``produce(1, prompts=k)``: one
launch of ``k`` groups (``Live``'s workers). Thread-safe."""


def batch_state(batch: Batch) -> list[dict[str, Any]]:
    """A batch as plain dicts (one per group, every field kept), for checkpoints."""
    return [{f.name: getattr(group, f.name) for f in fields(group)} for group in batch]


def batch_from_state(state: list[dict[str, Any]]) -> Batch:
    """Inverse of :func:`batch_state`."""
    return [RolloutGroup(**group) for group in state]


class DelaySchedule(ABC):
    """Base of the delay schedules: a step counter against the planned number of updates, and the background work.

    The plan (:meth:`plan`) is always this run's (``--trainer.max_steps``); a checkpoint restores the step reached and
    records the plan and ``drain_step`` (:func:`extension_problem`). It owns every thread that generates for it.
    Subclasses call ``super().__init__()``, implement :meth:`next_batch` (launching through :meth:`launch`) and
    extend :meth:`state_dict`/:meth:`load_state_dict`.
    """

    overlap: bool = False
    """Whether :meth:`launch` generates in a background thread and returns futures of batches."""

    refill_on_extend: bool = True
    """Whether a resume planning more updates from a checkpoint taken in the drain goes on by generating again from
    the checkpoint's policy (``False``: it is refused; see :func:`extension_problem`). The schedules that drain take
    it as an option."""

    step: int = 0
    total_updates: int = 0
    batch_prompts: int = 1
    drain_step: int | None = None
    """The first update at which the schedule acted on the run's end (``None``: not yet, or never)."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None  # overlapped generation: one thread, launches in order
        self._pending: list[Future[Batch]] = []  # its launches not yet known to be finished

    def plan(self, total_updates: int, batch_prompts: int = 1) -> DelaySchedule:
        """Set the run's planned number of updates and ``B`` (prompts per update); returns the schedule."""
        if total_updates < 1:
            raise ValueError(f"total_updates must be >= 1, got {total_updates}")
        if batch_prompts < 1:
            raise ValueError(f"batch_prompts must be >= 1, got {batch_prompts}")
        self.total_updates, self.batch_prompts = total_updates, batch_prompts
        return self

    @property
    def exhausted(self) -> bool:
        """Whether every planned update has been served."""
        return self.step >= self.total_updates

    @property
    def remaining(self) -> int:
        """Updates still to serve."""
        return self.total_updates - self.step

    @abstractmethod
    def next_batch(self, produce: Producer) -> tuple[Batch, dict[str, float]]:
        """The batch of the next update and what the schedule logs about it (``schedule/*``)."""

    def launch(self, produce: Producer, count: int) -> list[Batch] | list[Future[Batch]]:
        """``count`` batches from the current policy: generated now, or with ``overlap`` futures of them (in order)."""
        if not self.overlap:
            return produce(count)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lit_gmc-generate")
        self._pending = [future for future in self._pending if not future.done()]
        futures = [self._executor.submit(lambda: produce(1)[0]) for _ in range(count)]
        self._pending.extend(futures)
        return futures

    @property
    def running(self) -> bool:
        """Whether generation runs on its own beside the learner (``Live``), so published weights are staged."""
        return False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No generation in progress inside the block (a failed launch raises): to publish weights or snapshot."""
        for future in self._pending:
            future.result()
        self._pending.clear()
        yield

    def close(self) -> None:
        """Stop and join every thread of the schedule (each finishes its current call first); idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (plain containers and tensors), with the plan it was taken under."""
        return {"step": self.step, "planned": self.total_updates, "drain_step": self.drain_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the plan (:meth:`plan`) stays this run's."""
        self.step = state["step"]
        self.drain_step = state.get("drain_step")


class _QueueSchedule(DelaySchedule):
    """Shared bookkeeping of ``Sync`` and ``FixedDelay``: a FIFO of batches."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: deque[Batch] = deque()

    def _pop(self, info: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        batch = self.queue.popleft()
        self.step += 1
        info["queue_depth"] = float(len(self.queue))
        return batch, info

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "queue": [batch_state(b) for b in self.queue]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.queue = deque(batch_from_state(b) for b in state["queue"])


class Sync(_QueueSchedule):
    """Algorithm 1: freeze the policy, generate ``K`` batches, take ``K`` updates (delays ``0..K-1``).

    The paper's synchronous baseline (its ``D = 0`` column) is ``Sync(inner_steps=4)``.

    Args:
        inner_steps: ``K``, updates per generation round; the last round generates only what is left.
        refill_on_extend: A resume planning more updates (``--trainer.max_steps`` raised) from a checkpoint taken
            after the drain began (a finished run's ``last.ckpt``) refills the schedule from the checkpoint's
            policy, as at a start, and says so in one log line: its records then differ from a run planned that
            long. ``false``: such a resume is refused. A checkpoint before the drain always extends exactly.
    """

    may_change_on_resume: ClassVar[frozenset[str]] = frozenset({"refill_on_extend"})  # a resume's own choice

    def __init__(self, inner_steps: int = 1, refill_on_extend: bool = True) -> None:
        super().__init__()
        check_options("Sync", self.option_problems(inner_steps))
        self.inner_steps, self.refill_on_extend = inner_steps, refill_on_extend

    @staticmethod
    def option_problems(inner_steps: int) -> list[str]:
        """Every problem with the options, named by their init args (also used by the CLI's one-pass check)."""
        return [f"inner_steps={inner_steps} must be >= 1"] if inner_steps < 1 else []

    def next_batch(self, produce: Producer) -> tuple[Batch, dict[str, float]]:
        """The next queued batch and its info; an empty queue first generates the next round."""
        if self.exhausted:
            raise StopIteration
        if not self.queue:
            count = min(self.inner_steps, self.remaining)
            # the run's end cuts this round short, where a longer run would not
            self.drain_step = self.step if count < self.inner_steps else None
            self.queue.extend(self.launch(produce, count))
        return self._pop({"draining": 0.0})


class FixedDelay(_QueueSchedule):
    """Fixed delay ``D``: a FIFO of ``D`` batches, filled from ``theta_0`` before the first update.

    At step ``n`` a batch from ``theta_n`` is appended (consumed at ``n + D``) and the oldest is consumed. Once the
    queue holds every batch still needed, generation stops and the queue drains (``drain_step``). ``D = 0`` is one
    on-policy update per batch (the paper's ``D = 0`` column is :class:`Sync` with 4 inner steps).

    Args:
        delay: ``D >= 0``, updates between generating a batch and consuming it.
        refill_on_extend: A resume planning more updates (``--trainer.max_steps`` raised) from a checkpoint taken
            after the drain began (a finished run's ``last.ckpt``) refills the schedule from the checkpoint's
            policy, as at a start, and says so in one log line: its records then differ from a run planned that
            long. ``false``: such a resume is refused. A checkpoint before the drain always extends exactly.
    """

    may_change_on_resume: ClassVar[frozenset[str]] = frozenset({"refill_on_extend"})  # a resume's own choice

    def __init__(self, delay: int = 8, refill_on_extend: bool = True) -> None:
        super().__init__()
        check_options("FixedDelay", self.option_problems(delay))
        self.delay, self.refill_on_extend = delay, refill_on_extend

    @staticmethod
    def option_problems(delay: int) -> list[str]:
        """Every problem with the options, named by their init args."""
        return [f"delay={delay} must be >= 0"] if delay < 0 else []

    def next_batch(self, produce: Producer) -> tuple[Batch, dict[str, float]]:
        """The oldest queued batch and its info, after topping the FIFO up with the current policy."""
        if self.exhausted:
            raise StopIteration
        fill = min(self.delay, self.remaining) - len(self.queue)
        if fill > 0:  # the start, or a drained run resumed with more updates planned: refill from this policy
            self.queue.extend(self.launch(produce, fill))
            self.drain_step = None
        if len(self.queue) < self.remaining:
            self.queue.extend(self.launch(produce, 1))
        elif self.drain_step is None:
            self.drain_step = self.step
        return self._pop({"draining": float(self.drain_step is not None)})


def extension_problem(state: dict[str, Any], total_updates: int, name: str) -> str | None:
    """Why a checkpoint's schedule ``state`` cannot go on to ``total_updates`` as a run planned that long would.

    ``None`` when it can: the plan is not longer, or the schedule had not yet acted on the planned end (no
    ``drain_step``). Checkpoints from before the plan was recorded are not judged. The message is the refusal of a
    schedule with ``refill_on_extend`` off; :func:`refill_notice` is the log line of one with it on.
    """
    planned, drain_step = state.get("planned"), state.get("drain_step")
    if planned is None or total_updates <= planned or drain_step is None:
        return None
    return (
        f"--trainer.max_steps {total_updates} extends a run planned for {planned} updates, but its checkpoint (at "
        f"update {state['step']}) was taken after {name} began its drain at update {drain_step} (it stopped "
        f"generating for the planned end), a state no run planned for {total_updates} updates reaches. To extend it "
        f"as if planned for {total_updates} from the start, resume from a checkpoint at or before update "
        f"{drain_step} (kept by --checkpoint.every_n_train_steps or --checkpoint.at_steps); or leave "
        "--data.schedule.refill_on_extend true (the default) to refill the schedule from the checkpoint's policy, as "
        "at a start (delays restart from 0)"
    )


def refill_notice(state: dict[str, Any], total_updates: int, name: str) -> str:
    """The one log line of a resume that :func:`extension_problem` finds past the drain and that refills instead."""
    return (
        f"extending a run planned for {state['planned']} updates to {total_updates} from its checkpoint at update "
        f"{state['step']}, taken after {name} began its drain at update {state['drain_step']}: the schedule is "
        "refilled from the checkpoint's policy (delays restart from 0), so the records differ from a run planned for "
        f"{total_updates} updates from the start, which a checkpoint at or before update {state['drain_step']} "
        "would give (--data.schedule.refill_on_extend false refuses this resume)"
    )

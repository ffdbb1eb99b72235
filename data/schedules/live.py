"""The ``live`` schedule: the paper's Algorithm 2 for real, rollout workers running beside the learner.

Worker threads generate with the latest published weights into a buffer; each update pops the next ``B`` groups
(of any versions). Lossless: workers stop once every group the run needs is claimed; a worker's exception is
re-raised, chained, in the learner.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from lit_gmc.batch import RolloutGroup
from lit_gmc.data.schedules.base import Batch, DelaySchedule, Producer, batch_from_state, batch_state
from lit_gmc.options import check_options

THREAD_PREFIX = "lit_gmc-rollout-worker"


class RolloutWorkerError(RuntimeError):
    """A rollout worker thread raised; ``__cause__`` is the worker's exception, with its traceback."""


class Live(DelaySchedule):
    """Rollout workers generate exactly ``total_updates * B`` groups while the learner trains, ``B`` per update.

    Args:
        workers: Worker threads. A second overlaps one call's scoring with the next call's generation; more help
            only an engine that serves concurrent requests.
        chunk_prompts: Prompts per generation call (``None``: ``B``); a call never spans two updates.
        max_staleness: Optional gate, off by default: a worker claims prompts only if they will be consumed at most
            this many updates after the newest published version, which bounds every delay with one worker (several
            may reorder by up to ``workers - 1``). It delays generation, never drops rollouts (that biases the data
            toward short responses).
        join_timeout_s: How long :meth:`close` waits for a worker to finish its current generation call.
    """

    # Options a resume may change (lit_gmc.resume asks the class): how long a stop waits for the workers.
    may_change_on_resume: ClassVar[frozenset[str]] = frozenset({"join_timeout_s"})

    def __init__(
        self, workers: int = 1, chunk_prompts: int | None = None, max_staleness: int | None = None,
        join_timeout_s: float = 60.0,
    ) -> None:  # fmt: skip
        check_options("Live", self.option_problems(workers, chunk_prompts, max_staleness, join_timeout_s))
        super().__init__()
        self.workers = workers
        self.chunk_prompts = chunk_prompts
        self.max_staleness = max_staleness
        self.join_timeout_s = join_timeout_s
        self.claimed = 0  # groups handed to workers so far (generated or generating)
        self.buffer: deque[RolloutGroup] = deque()  # completed, not yet consumed, in completion order
        self._cond = threading.Condition()  # guards everything below and the counters above
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._paused = 0
        self._generating = 0  # calls in progress
        self._published = 0  # step of the learner's latest request: the engine holds at least this version
        self._error: tuple[str, BaseException] | None = None

    @staticmethod
    def option_problems(
        workers: int, chunk_prompts: int | None, max_staleness: int | None, join_timeout_s: float
    ) -> list[str]:
        """Every problem with the options, named by their init args."""
        problems = []
        if workers < 1:
            problems.append(f"workers={workers} must be >= 1")
        if chunk_prompts is not None and chunk_prompts < 1:
            problems.append(f"chunk_prompts={chunk_prompts} must be >= 1 (or null for --data.batch_prompts)")
        if max_staleness is not None and max_staleness < 0:
            problems.append(f"max_staleness={max_staleness} must be >= 0 (or null for no gate)")
        if not join_timeout_s > 0:
            problems.append(f"join_timeout_s={join_timeout_s} must be > 0")
        return problems

    @property
    def running(self) -> bool:
        """Whether any worker thread is alive (published weights are then staged for the workers)."""
        return any(t.is_alive() for t in self._threads)

    def next_batch(self, produce: Producer) -> tuple[Batch, dict[str, float]]:
        """The next ``B`` completed groups; starts the workers on the first call, re-raises a worker's error."""
        if self.exhausted:
            raise StopIteration
        with self._cond:
            self._published = self.step
            self._cond.notify_all()
            if not self._threads:
                self._start(produce)
            while len(self.buffer) < self.batch_prompts:
                self._raise_worker_error()
                if not self.running:
                    raise RuntimeError("live: every rollout worker has stopped, yet the batch is incomplete")
                self._cond.wait(timeout=1.0)
            self._raise_worker_error()
            batch = [self.buffer.popleft() for _ in range(self.batch_prompts)]
            self.step += 1
            info = {
                "buffered_groups": float(len(self.buffer)),
                "generating_calls": float(self._generating),
                "claimed_groups": float(self.claimed),
            }
        return batch, info

    def _start(self, produce: Producer) -> None:
        self._stopping, self._error = False, None
        for i in range(self.workers):
            thread = threading.Thread(target=self._work, args=(produce,), name=f"{THREAD_PREFIX}-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            name, err = self._error
            raise RolloutWorkerError(f"rollout worker {name} failed: {type(err).__name__}: {err}") from err

    def _admit(self) -> int:
        """Wait (holding the lock) until a worker may claim a chunk; its size, or 0 when the worker should exit."""
        b = self.batch_prompts
        while True:
            left = self.total_updates * b - self.claimed  # of the groups the whole run consumes
            if self._stopping or self._error is not None or left == 0:
                return 0
            size = min(self.chunk_prompts or b, left, b - self.claimed % b)  # never across an update boundary
            last_step = (self.claimed + size - 1) // b  # the update that will consume the chunk's last group
            gated = self.max_staleness is not None and last_step - self._published > self.max_staleness
            if not self._paused and not gated:
                return size
            self._cond.wait()

    def _work(self, produce: Producer) -> None:
        name = threading.current_thread().name
        try:
            while True:
                with self._cond:
                    size = self._admit()
                    if not size:
                        return
                    self.claimed += size
                    self._generating += 1
                groups: Batch = []
                try:
                    (groups,) = produce(1, prompts=size)
                finally:
                    with self._cond:  # both at once: a snapshot (paused) never sees a call ended, its groups missing
                        self.buffer.extend(groups)
                        self._generating -= 1
                        self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the learner's thread, which re-raises it
            with self._cond:
                self._error = (name, err)
                self._cond.notify_all()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No new claims, and every generation call in progress finished: a consistent snapshot point."""
        with self._cond:
            self._paused += 1
            while self._generating and self._error is None:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the workers and join them (each finishes its current generation call first); idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(self.join_timeout_s)
            if thread.is_alive():
                warnings.warn(f"{thread.name} did not stop within {self.join_timeout_s} s", stacklevel=2)
        self._threads = []
        super().close()

    def state_dict(self) -> dict[str, Any]:
        """Counters and the completed-but-unconsumed groups; taken between generation calls."""
        with self.paused():
            return {**super().state_dict(), "claimed": self.claimed, "buffer": batch_state(list(self.buffer))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters and buffered groups saved by :meth:`state_dict`; workers must be stopped."""
        if self.running:
            raise RuntimeError("live: cannot load a state while rollout workers are running")
        super().load_state_dict(state)
        self.claimed = state["claimed"]
        self.buffer = deque(batch_from_state(state["buffer"]))

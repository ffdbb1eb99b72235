"""The paper's simulated asynchrony (Appendix B.1): a length-coupled virtual clock over a hidden in-flight buffer."""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lit_gmc.data.schedules.base import Batch, DelaySchedule, Producer, batch_from_state, batch_state
from lit_gmc.options import check_options


def launch_bound(lam: float, c_gen: float, max_new_tokens: int | str) -> str | int:
    """Most launches one refill can need: ``ceil(lam * T / c_gen) + 1`` (the formula, for a symbolic ``T``).

    A batch launched at ``t`` is visible by ``t + lam * T``; each launch advances the clock by ``c_gen``.
    """
    if isinstance(max_new_tokens, str):
        return f"ceil({lam:g} * {max_new_tokens} / {c_gen:g}) + 1"
    return math.ceil(lam * max_new_tokens / c_gen) + 1


def mean_completion_length(batch: Batch) -> float:
    """Mean number of response tokens over every response of the batch (the ``L`` of the virtual clock)."""
    return float(torch.cat([group.lengths for group in batch]).double().mean())


MIN_MEAN_LENGTH = 1.0
"""Every response holds at least one token (EOS counts), so no batch can be visible before ``t + lam``."""


@dataclass
class _Launch:
    """One launched batch on the virtual clock; ``ready_at`` is known once its generation has finished."""

    index: int  # launch order, which breaks ties between equal completion times
    launched_at: float
    batch: Batch | Future
    ready_at: float | None = None


class VirtualClock(DelaySchedule):
    """The paper's simulated asynchrony (Appendix B.1): a hidden in-flight buffer on a length-coupled clock.

    A launch at clock ``t`` advances the clock by ``c_gen`` and becomes visible at ``t + lam * L`` (``L`` its mean
    completion length); an update advances it by ``c_update``. Visible batches are consumed in completion order;
    while none is, one batch at a time is launched, or, once everything still needed is in flight, the clock idles
    to the next completion (the drain). The steady-state delay is about ``lam * E[L] / (c_gen + c_update)``.
    With ``overlap``, a batch is waited for only once it could be visible, so launches and consumptions are the same.

    Args:
        c_gen: Clock cost of launching one batch (> 0; the paper's 85).
        lam: Clock time per token of a batch's mean completion length ``L`` (>= 0; the paper's 28).
        c_update: Clock cost of one optimizer update (>= 0; the paper's 1).
        max_launches: Most launches in one refill (the warm-up included) before a clear error.
        overlap: Generate in a background thread while the learner trains (it pays off when ``lam > c_gen``).
            With ``--model.gradient_checkpointing`` (which restores torch's global generator in backward)
            ``HFEngine``'s overlapped samples stop being reproducible: turn it off there if runs must repeat.
        refill_on_extend: A resume planning more updates (``--trainer.max_steps`` raised) from a checkpoint taken
            after the drain began (a finished run's ``last.ckpt``) refills the schedule from the checkpoint's
            policy, as at a start, and says so in one log line: its records then differ from a run planned that
            long. ``false``: such a resume is refused. A checkpoint before the drain always extends exactly.
    """

    # Options a resume may change (lit_gmc.resume asks the class): they do not change the delays, or (the last) are
    # the resume's own choice.
    may_change_on_resume: ClassVar[frozenset[str]] = frozenset({"overlap", "max_launches", "refill_on_extend"})

    def __init__(
        self, c_gen: float = 85.0, lam: float = 28.0, c_update: float = 1.0, max_launches: int = 400,
        overlap: bool = True, refill_on_extend: bool = True,
    ) -> None:  # fmt: skip
        check_options("VirtualClock", self.option_problems(c_gen, lam, c_update, max_launches))
        super().__init__()
        self.c_gen, self.lam, self.c_update, self.max_launches = float(c_gen), float(lam), float(c_update), max_launches
        self.overlap, self.refill_on_extend = overlap, refill_on_extend
        self.clock = 0.0
        self.hidden: list[_Launch] = []  # launched, not yet visible (possibly still generating)
        self.visible: list[_Launch] = []  # completed by the clock, sorted by (ready_at, index)

    @staticmethod
    def option_problems(c_gen: float, lam: float, c_update: float, max_launches: int) -> list[str]:
        """Every problem with the clock's constants, named by their init args."""
        problems = []
        if not c_gen > 0:
            problems.append(f"c_gen={c_gen} must be > 0 (each launch must advance the clock)")
        if not lam >= 0:
            problems.append(f"lam={lam} must be >= 0")
        if not c_update >= 0:
            problems.append(f"c_update={c_update} must be >= 0")
        if max_launches < 1:
            problems.append(f"max_launches={max_launches} must be >= 1")
        return problems

    @property
    def in_flight(self) -> int:
        """Launched batches not yet consumed (hidden or visible)."""
        return len(self.hidden) + len(self.visible)

    def next_batch(self, produce: Producer) -> tuple[Batch, dict[str, float]]:
        """The earliest-completed visible batch, after launching (or idling) until one is visible."""
        if self.exhausted:
            raise StopIteration
        launches = 0
        self._reveal()
        while not self.visible:
            if self.in_flight < self.remaining:
                if launches == self.max_launches:
                    raise RuntimeError(self._too_many_launches())
                self._launch(produce)
                launches += 1
            else:
                self._idle_until_next_completion()
            self._reveal()
        entry = self.visible.pop(0)
        info = {
            "clock": self.clock, "launches": float(launches), "in_flight": float(self.in_flight),
            "launched_at": entry.launched_at, "ready_at": entry.ready_at,
            "mean_length": mean_completion_length(entry.batch),
            "delay_per_length": self.lam / (self.c_gen + self.c_update),
            "draining": float(self.drain_step is not None),
        }  # fmt: skip
        self.step += 1
        self.clock += self.c_update
        return entry.batch, info

    def _launch(self, produce: Producer) -> None:
        self.drain_step = None  # launching again: only a resume planning more updates ends a drain
        (batch,) = self.launch(produce, 1)
        launched = self.step + self.in_flight  # lossless: every launch is consumed or still in flight
        self.hidden.append(_Launch(launched, self.clock, batch))
        self.clock += self.c_gen

    def _resolve(self, entry: _Launch) -> None:
        if entry.ready_at is not None:
            return
        if isinstance(entry.batch, Future):
            entry.batch = entry.batch.result()  # re-raises a generation error here, with its traceback
        length = mean_completion_length(entry.batch)
        if length < MIN_MEAN_LENGTH:
            raise ValueError(f"virtual_clock: launched batch {entry.index} has a mean completion length {length} < 1")
        entry.ready_at = entry.launched_at + self.lam * length

    def _reveal(self) -> None:
        """Move every batch whose completion time has passed to the visible queue."""
        still_hidden = []
        for entry in self.hidden:
            if entry.ready_at is None and entry.launched_at + self.lam * MIN_MEAN_LENGTH > self.clock:
                still_hidden.append(entry)  # cannot be complete whatever its length: let it keep generating
                continue
            self._resolve(entry)
            (self.visible if entry.ready_at <= self.clock else still_hidden).append(entry)
        self.hidden = still_hidden
        self.visible.sort(key=lambda e: (e.ready_at, e.index))

    def _idle_until_next_completion(self) -> None:
        for entry in self.hidden:
            self._resolve(entry)
        if self.drain_step is None:
            self.drain_step = self.step
        self.clock = max(self.clock, min(e.ready_at for e in self.hidden))

    def _too_many_launches(self) -> str:
        for entry in self.hidden:
            self._resolve(entry)
        first = min(self.hidden, key=lambda e: e.ready_at)
        needed = self.max_launches + math.ceil((first.ready_at - self.clock) / self.c_gen)
        return (
            f"VirtualClock: {self.max_launches} launches at step {self.step} and no batch is visible yet (clock "
            f"{self.clock:g}; the earliest, of mean completion length {mean_completion_length(first.batch):g}, "
            f"completes at {first.ready_at:g} = launch + lam * L). Set --data.schedule.max_launches to at least "
            f"{needed} for these lengths; no refill ever needs more than "
            f"{launch_bound(self.lam, self.c_gen, '--data.max_new_tokens')}. Or lower --data.schedule.lam relative "
            f"to --data.schedule.c_gen (lam={self.lam:g}, c_gen={self.c_gen:g})"
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything in flight, generated batches and completion times included (waits for background work)."""
        for entry in self.hidden:
            self._resolve(entry)
        entries = [
            {"index": e.index, "launched_at": e.launched_at, "ready_at": e.ready_at, "batch": batch_state(e.batch)}
            for e in self.hidden + self.visible
        ]
        return {
            **super().state_dict(), "clock": self.clock, "entries": entries,
            "visible": [e.index for e in self.visible],
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the clock, counters and in-flight batches saved by :meth:`state_dict` (the plan stays this run's)."""
        super().load_state_dict(state)
        self.clock = state["clock"]
        entries = [
            _Launch(e["index"], e["launched_at"], batch_from_state(e["batch"]), e["ready_at"]) for e in state["entries"]
        ]
        visible = set(state["visible"])
        self.hidden = [e for e in entries if e.index not in visible]
        self.visible = sorted((e for e in entries if e.index in visible), key=lambda e: (e.ready_at, e.index))

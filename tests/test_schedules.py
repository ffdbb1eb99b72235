"""Delay schedules: the delay of every consumed batch, fill, drain, losslessness, resumable state.

A schedule's job is queue logic alone, so these tests drive it with a producer that stamps each batch with
the learner's current version (the number of updates taken so far), as the engine does after WeightSync.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from lit_gmc.batch import RolloutGroup
from lit_gmc.data.schedules.base import DelaySchedule, FixedDelay, Sync, extension_problem
from lit_gmc.data.schedules.virtual_clock import VirtualClock


class VersionedProducer:
    """Produces batches of one group stamped with ``self.version`` and a running batch id."""

    def __init__(self) -> None:
        self.version = 0
        self.launched = 0
        self.calls: list[tuple[int, int]] = []  # (version, how many batches)

    def __call__(self, count: int) -> list[list[RolloutGroup]]:
        self.calls.append((self.version, count))
        out = []
        for _ in range(count):
            group = RolloutGroup(0, "", "", torch.zeros(1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long),
                                 torch.ones(2, 1, dtype=torch.bool), torch.zeros(2, 1), ["stop"] * 2, torch.zeros(2),
                                 version=self.version, batch_id=self.launched)  # fmt: skip
            out.append([group])
            self.launched += 1
        return out


def run(schedule, producer: VersionedProducer):
    """Consume every batch; after each update the producer's version advances (the optimizer step)."""
    records = []
    while not schedule.exhausted:
        batch, info = schedule.next_batch(producer)
        records.append({"step": producer.version, "version": batch[0].version, "id": batch[0].batch_id, **info})
        producer.version += 1
    return records


@pytest.mark.parametrize("delay", [0, 1, 3, 8])
def test_fixed_delay_is_exactly_d_after_the_fill_and_drains_at_the_end(delay):
    total = 20
    producer = VersionedProducer()
    records = run(FixedDelay(delay).plan(total), producer)
    assert len(records) == total
    delays = [r["step"] - r["version"] for r in records]
    assert delays[:delay] == list(range(delay))  # fill: all from theta_0, consumed at steps 0..D-1
    assert delays[delay:] == [delay] * (total - delay)  # steady state: exactly D
    assert producer.calls[0] == ((0, delay) if delay else (0, 1))  # the fill is one call from theta_0
    # lossless: every launched batch is consumed exactly once, in launch order
    assert [r["id"] for r in records] == list(range(total)) and producer.launched == total
    # the last D updates generate nothing: the queue drains
    drain_start = total - delay
    assert [r["draining"] for r in records] == [0.0] * drain_start + [1.0] * delay
    assert [r["queue_depth"] for r in records[drain_start:]] == list(range(delay - 1, -1, -1))


def test_fixed_delay_longer_than_the_run_uses_only_the_fill():
    producer = VersionedProducer()
    records = run(FixedDelay(50).plan(5), producer)
    assert producer.calls == [(0, 5)]
    assert [r["step"] - r["version"] for r in records] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("inner", [1, 2, 4])
def test_sync_gives_delays_zero_to_k_minus_one(inner):
    total = 10
    producer = VersionedProducer()
    records = run(Sync(inner).plan(total), producer)
    delays = [r["step"] - r["version"] for r in records]
    assert delays == [i % inner for i in range(total)]
    # one generation round per K updates, all from the version at the start of the round; the last is cut short
    rounds = [(v, c) for v, c in producer.calls]
    assert rounds == [(k, min(inner, total - k)) for k in range(0, total, inner)]


def test_schedule_state_round_trips_mid_run():
    producer = VersionedProducer()
    schedule = FixedDelay(3).plan(12)
    first = [schedule.next_batch(producer)[0][0].batch_id for _ in range(5)]
    producer.version = 5
    state = schedule.state_dict()
    resumed = FixedDelay(3).plan(12)
    resumed.load_state_dict(state)
    rest_a = [resumed.next_batch(producer)[0][0].batch_id for _ in range(7)]
    assert first + rest_a == list(range(12))


def test_bad_schedule_arguments_are_named():
    with pytest.raises(ValueError, match="FixedDelay options: delay=-1 must be >= 0"):
        FixedDelay(-1)
    with pytest.raises(ValueError, match="Sync options: inner_steps=0 must be >= 1"):
        Sync(0)
    with pytest.raises(ValueError, match="total_updates must be >= 1"):
        FixedDelay(2).plan(0)


def test_the_plan_comes_from_the_run_not_the_checkpoint():
    """A resumed schedule keeps this run's planned updates: a longer run continues, a shorter one stops."""
    producer = VersionedProducer()
    first = FixedDelay(2).plan(6)
    for _ in range(4):
        first.next_batch(producer)
        producer.version += 1
    longer = FixedDelay(2).plan(10)
    longer.load_state_dict(first.state_dict())
    assert (longer.step, longer.total_updates, longer.remaining) == (4, 10, 6)
    shorter = FixedDelay(2).plan(4)
    shorter.load_state_dict(first.state_dict())
    assert shorter.exhausted


class OverlappedFifo(DelaySchedule):
    """The smallest schedule that launches in the background: one launch per update, consumed in order."""

    overlap = True

    def __init__(self) -> None:
        super().__init__()
        self.futures = []

    def next_batch(self, produce):
        self.futures.extend(self.launch(produce, 1))
        self.step += 1
        return self.futures.pop(0).result(), {}


def test_the_base_protocol_is_a_no_op_without_background_work():
    schedule = Sync().plan(2)
    assert not schedule.running
    with schedule.paused():
        pass
    schedule.close()
    schedule.close()  # idempotent
    producer = VersionedProducer()
    assert [schedule.next_batch(producer)[0][0].batch_id for _ in range(2)] == [0, 1]


def test_overlapped_launches_run_in_one_thread_in_order_and_close_joins_it():
    producer = VersionedProducer()
    schedule = OverlappedFifo().plan(4)
    ids = []
    while not schedule.exhausted:
        ids.append(schedule.next_batch(producer)[0][0].batch_id)
        with schedule.paused():  # publishing: the launch in progress finishes at the old version
            producer.version += 1
    assert ids == [0, 1, 2, 3] and producer.calls == [(v, 1) for v in range(4)]
    assert any(t.name.startswith("lit_gmc-generate") for t in threading.enumerate())
    schedule.close()
    assert not any(t.name.startswith("lit_gmc-generate") for t in threading.enumerate())


def test_a_failed_background_launch_raises_where_the_schedule_pauses():
    def fail(count):
        raise ValueError("generation exploded")

    schedule = OverlappedFifo().plan(2)
    schedule.launch(fail, 1)
    with pytest.raises(ValueError, match="generation exploded"), schedule.paused():
        pass
    schedule.close()


def snapshots(make, total: int) -> tuple[list[tuple[dict, int]], list[tuple[int, int, int]]]:
    """Run a schedule planned for ``total`` updates: its state (and the producer's launch count) before each
    update and at the end, and the (step, version, batch id) of each consumed batch."""
    schedule, producer = make().plan(total), VersionedProducer()
    states, consumed = [], []
    while True:
        states.append((copy.deepcopy(schedule.state_dict()), producer.launched))
        if schedule.exhausted:
            return states, consumed
        batch, _ = schedule.next_batch(producer)
        consumed.append((producer.version, batch[0].version, batch[0].batch_id))
        producer.version += 1


@pytest.mark.parametrize(
    "make",
    [lambda: Sync(inner_steps=3), lambda: FixedDelay(delay=2), lambda: VirtualClock(lam=120.0, overlap=False)],
    ids=["Sync", "FixedDelay", "VirtualClock"],
)
def test_a_longer_plan_is_refused_exactly_where_the_checkpoint_cannot_continue_as_it(make):
    short, longer = 5, 9
    states, _ = snapshots(make, short)
    _, planned_long = snapshots(make, longer)
    refused = []
    for state, launched in states:
        schedule = make().plan(longer)
        schedule.load_state_dict(state)
        producer = VersionedProducer()
        producer.version, producer.launched = state["step"], launched
        continued = [(r["step"], r["version"], r["id"]) for r in run(schedule, producer)]
        problem = extension_problem(state, longer, "S")
        assert (problem is None) == (continued == planned_long[state["step"] :]), state["step"]
        refused.append(problem is not None)
    assert refused[0] is False and refused[-1] is True  # a fresh start extends; a finished run has drained
    assert extension_problem(states[-1][0], short, "S") is None  # the same plan: a plain resume

"""The length-coupled virtual clock (DESIGN.md §4, the paper's Appendix B.1).

Queue logic is driven by a producer that stamps each batch with the learner's current version and a chosen
mean completion length, without the overlap thread (:func:`clock`); the overlap tests turn it on, and the last
test runs the real tiny actor with generation overlap on and off.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from run_helpers import component, fit, records, write_config

from lit_gmc.batch import RolloutGroup
from lit_gmc.data.schedules.base import batch_from_state, batch_state
from lit_gmc.data.schedules.virtual_clock import VirtualClock, launch_bound, mean_completion_length


def make_batch(version: int, batch_id: int, length: int, rows: int = 2) -> list[RolloutGroup]:
    """One group of ``rows`` responses that all have ``length`` tokens (so the batch's mean length is ``length``)."""
    width = max(length, 1)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[:, :length] = True
    return [RolloutGroup(batch_id, "", "", torch.zeros(1, dtype=torch.long), torch.zeros(rows, width, dtype=torch.long),
                         mask, torch.zeros(rows, width), ["stop"] * rows, torch.zeros(rows), version=version,
                         batch_id=batch_id)]  # fmt: skip


class LengthProducer:
    """Batch ``i`` has mean completion length ``lengths[i]`` and the version the learner has reached."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.version = 0
        self.launched = 0

    def __call__(self, count: int) -> list[list[RolloutGroup]]:
        out = []
        for _ in range(count):
            out.append(make_batch(self.version, self.launched, self.lengths[self.launched]))
            self.launched += 1
        return out


def clock(**options) -> VirtualClock:
    """A clock without the overlap thread: queue logic alone."""
    return VirtualClock(overlap=False, **options)


def publish(schedule: VirtualClock, producer, version: int) -> None:
    """The optimizer step, as the DataModule publishes it: launches in progress finish at the old version first."""
    with schedule.paused():
        producer.version = version


def drive(schedule: VirtualClock, producer) -> list[dict]:
    records_ = []
    step = 0
    while not schedule.exhausted:
        batch, info = schedule.next_batch(producer)
        records_.append({"step": step, "id": batch[0].batch_id, "version": batch[0].version, **info})
        step += 1
        publish(schedule, producer, step)
    schedule.close()
    return records_


def reference_clock(lengths, total, c_gen, lam, c_update):
    """The clock written out as the paper states it, one event at a time, with no lazy evaluation."""
    t, launched, waiting, out = 0.0, 0, [], []
    for n in range(total):
        while not any(ready <= t for ready, _, _ in waiting):
            if len(waiting) < total - n:  # launch from the current policy theta_n
                waiting.append((t + lam * lengths[launched], launched, n))
                launched += 1
                t += c_gen
            else:  # everything still needed is in flight: wait for the next completion
                t = max(t, min(ready for ready, _, _ in waiting))
        ready, index, version = min(w for w in waiting if w[0] <= t)
        waiting.remove((ready, index, version))
        out.append((n, index, version))
        t += c_update
    return out, launched


def test_hand_computed_sequence():
    # c_gen 10, lam 10, c_update 1; lengths 3, 1, 1. Launch #0 at t=0 (ready 30), #1 at t=10 (ready 20): #1 is
    # visible at t=20 and consumed at step 0. Step 1 (t=21): launch #2 (ready 31), t=31: #0 and #2 are both
    # visible, #0 completed first. Step 2 (t=32): #2.
    producer = LengthProducer([3, 1, 1])
    out = drive(clock(c_gen=10, lam=10, c_update=1).plan(3), producer)
    assert [(r["id"], r["version"]) for r in out] == [(1, 0), (0, 0), (2, 1)]
    assert [r["launches"] for r in out] == [2.0, 1.0, 0.0]
    assert [r["clock"] for r in out] == [20.0, 31.0, 32.0]
    assert [r["ready_at"] for r in out] == [20.0, 30.0, 31.0]
    assert [r["launched_at"] for r in out] == [10.0, 0.0, 21.0]
    assert producer.launched == 3


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_event_by_event_reference(seed):
    rng = random.Random(seed)
    c_gen, lam, c_update = rng.choice([(85, 28, 1), (10, 40, 2), (5, 3, 0), (30, 100, 1)])
    total = rng.randint(1, 60)
    lengths = [rng.randint(1, 40) for _ in range(500)]
    producer = LengthProducer(lengths)
    out = drive(clock(c_gen=c_gen, lam=lam, c_update=c_update, max_launches=500).plan(total), producer)
    want, launched = reference_clock(lengths, total, c_gen, lam, c_update)
    assert [(r["step"], r["id"], r["version"]) for r in out] == want
    # lossless: every launch consumed exactly once
    assert producer.launched == launched == total
    assert sorted(r["id"] for r in out) == list(range(total))


@pytest.mark.parametrize("mean_length", [30, 300])
def test_steady_state_delay_matches_lam_mean_length_over_costs(mean_length):
    rng = random.Random(0)
    lengths = [rng.randint(mean_length // 3, 5 * mean_length // 3) for _ in range(4000)]  # E[L] = mean_length
    producer = LengthProducer(lengths)
    out = drive(clock(c_gen=85, lam=28, c_update=1, max_launches=1000).plan(3000), producer)
    delays = [r["step"] - r["version"] for r in out[1000:-1000]]  # away from the warm-up and the drain
    predicted = 28 * mean_length / (85 + 1)
    # Updates are discrete: a batch is consumed at the first update after it completes, and its own launch
    # takes c_gen, so the measured mean sits within one update of the continuous prediction.
    assert abs(sum(delays) / len(delays) - predicted) < 1.0
    assert out[0]["delay_per_length"] == pytest.approx(28 / 86)


def test_warm_up_launches_from_theta_0_until_one_is_visible():
    producer = LengthProducer([20] * 100)  # each batch needs 20 * 28 = 560 = 6.6 launches to complete
    out = drive(clock(c_gen=85, lam=28, c_update=1).plan(30), producer)
    assert out[0]["launches"] == 7.0 and out[0]["version"] == 0  # 7 launches from theta_0 at step 0
    assert all(r["launches"] <= 1 for r in out[1:])  # then at most the one launch that exposes the next


def test_drain_stops_launching_when_everything_needed_is_in_flight():
    producer = LengthProducer([20] * 100)
    out = drive(clock(c_gen=85, lam=28, c_update=1).plan(5), producer)
    assert producer.launched == 5  # the warm-up would want 7, but only 5 updates are planned
    assert [r["draining"] for r in out] == [1.0] * 5
    assert [r["in_flight"] for r in out] == [4.0, 3.0, 2.0, 1.0, 0.0]


def test_max_launches_is_a_clear_error():
    producer = LengthProducer([100] * 100)
    with pytest.raises(RuntimeError, match=r"10 launches at step 0 .*--data\.schedule\.max_launches to at least 33"):
        clock(c_gen=85, lam=28, c_update=1, max_launches=10).plan(50).next_batch(producer)


def test_a_long_completion_warm_up_fits_under_the_launch_bound():
    """Qwen3-length first batches (all 4,096 tokens): 400 launches cannot expose one, the bound always does."""
    lam, c_gen, budget = 28.0, 85.0, 4096
    bound = launch_bound(lam, c_gen, budget)
    assert bound == 1351  # ceil(28 * 4096 / 85) + 1, the value configs/experiment/simulated_async.yaml sets
    message = r"400 launches .*at least 1350.*ceil\(28 \* --data.max_new_tokens / 85\) \+ 1"
    with pytest.raises(RuntimeError, match=message):
        clock(c_gen=c_gen, lam=lam, max_launches=400).plan(2000).next_batch(LengthProducer([budget] * 2000))
    batch, info = clock(c_gen=c_gen, lam=lam, max_launches=bound).plan(2000).next_batch(LengthProducer([budget] * 2000))
    assert info["launches"] == 1350  # launched at 0, 85, ...: the first is visible at 28 * 4096 = 114,688
    assert info["clock"] >= lam * budget and batch[0].batch_id == 0


def test_bad_constants_are_named():
    with pytest.raises(ValueError, match=r"VirtualClock options: c_gen=0 must be > 0.*max_launches=0"):
        VirtualClock(c_gen=0, max_launches=0)


class SlowProducer(LengthProducer):
    """Takes a random pause per batch, like a generation call; called from the overlap thread."""

    def __init__(self, lengths, seed: int) -> None:
        super().__init__(lengths)
        self.rng = random.Random(seed)
        self.threads: set[str] = set()

    def __call__(self, count: int) -> list[list[RolloutGroup]]:
        self.threads.add(threading.current_thread().name)
        time.sleep(self.rng.uniform(0, 0.003) * count)
        return super().__call__(count)


@pytest.mark.parametrize("seed", range(3))
def test_background_generation_gives_the_same_sequence(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 30) for _ in range(300)]
    plain = drive(clock(c_gen=40, lam=60, c_update=1).plan(80), LengthProducer(lengths))
    producer = SlowProducer(lengths, seed)
    threaded = drive(VirtualClock(c_gen=40, lam=60, c_update=1, overlap=True).plan(80), producer)
    assert plain == threaded
    assert producer.threads == {"lit_gmc-generate_0"}  # generated in the schedule's one background thread


def test_a_fresh_launch_is_not_waited_for_when_it_cannot_be_visible_yet():
    # lam 100 > c_gen 85: a batch launched now cannot complete before the next update, whatever its length.
    release = threading.Event()
    launched = []

    def produce(count):
        assert count == 1
        launched.append(len(launched))
        if len(launched) > 1:  # the warm-up batch is ready at once; the next one generates until released
            release.wait(timeout=30)
        return [make_batch(0, launched[-1], 1)]

    schedule = VirtualClock(c_gen=85, lam=100, c_update=1, overlap=True).plan(10)
    started = time.monotonic()
    batch, info = schedule.next_batch(produce)  # launches #0 (t=0, ready 100) and #1 (t=85); #0 visible at 170
    assert time.monotonic() - started < 1.0
    assert batch[0].batch_id == 0 and info["launches"] == 2.0
    (still_generating,) = schedule.hidden
    assert not still_generating.batch.done()  # #1 was launched and left generating
    release.set()
    with schedule.paused():  # publishing waits for it
        assert still_generating.batch.done()
    schedule.close()


def test_state_round_trip_keeps_in_flight_batches_and_the_clock():
    rng = random.Random(1)
    lengths = [rng.randint(1, 30) for _ in range(300)]
    unbroken = drive(clock(c_gen=20, lam=30, c_update=1).plan(40), LengthProducer(lengths))
    producer = LengthProducer(lengths)
    first = clock(c_gen=20, lam=30, c_update=1).plan(40)
    head = []
    for step in range(17):
        batch, info = first.next_batch(producer)
        head.append({"step": step, "id": batch[0].batch_id, "version": batch[0].version, **info})
        publish(first, producer, step + 1)
    state = first.state_dict()
    assert state["entries"], "the test should cut the run with batches in flight"
    resumed = clock(c_gen=20, lam=30, c_update=1).plan(40)
    resumed.load_state_dict(state)
    tail = drive(resumed, producer)
    for r in tail:
        r["step"] += 17
    assert head + tail == unbroken


def test_state_is_plain_and_loads_with_weights_only(tmp_path):
    producer = LengthProducer([5] * 50)
    schedule = clock(c_gen=10, lam=30, c_update=1).plan(20)
    for _ in range(3):
        schedule.next_batch(producer)
    torch.save(schedule.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    again = clock(c_gen=10, lam=30, c_update=1).plan(20)
    again.load_state_dict(state)
    assert again.clock == schedule.clock and again.in_flight == schedule.in_flight


def test_batch_state_round_trip_and_mean_length():
    batch = make_batch(3, 7, 4) + make_batch(3, 7, 2)
    again = batch_from_state(batch_state(batch))
    assert [g.version for g in again] == [3, 3] and torch.equal(again[1].response_mask, batch[1].response_mask)
    assert mean_completion_length(batch) == 3.0


def test_tiny_run_is_identical_with_and_without_overlap(tmp_path):
    """Real tiny actor: same consumed batch ids, launch versions, rewards and losses with overlap on and off."""
    # lam > c_gen, so the overlap thread runs ahead
    fit(write_config(tmp_path, "on", total=8, schedule=component("VirtualClock", lam=120.0, overlap=True)))
    fit(write_config(tmp_path, "off", total=8, schedule=component("VirtualClock", lam=120.0, overlap=False)))
    on, off = records(tmp_path / "on"), records(tmp_path / "off")
    assert sorted(on) == list(range(8))
    assert on == off
    assert [on[s]["schedule/launch_version"] for s in range(8)] != [0.0] * 8  # later launches use newer policies
    assert not [t.name for t in threading.enumerate() if t.name.startswith("lit_gmc")]  # the overlap thread is joined

"""Exact resume: a run stopped at step k and resumed from its checkpoint has the unbroken run's step records.

Records compared per step: consumed batch id, its launch version, mean reward and loss (to 1e-6), and the
schedule and delay scalars (virtual clock, queue depth, running delay moments). The DataModule's state
(queues, in-flight batches with versions and behaviour log-probs, clock, counters, stream position) and the
callbacks' states travel in the Lightning checkpoint, which loads with ``weights_only=True``.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from run_helpers import (
    assert_same_records,
    component,
    fit,
    fit_command,
    records,
    run_subprocess,
    write_config,
)

TOTAL, EVERY = 9, 3
SCHEDULES = {
    "fixed_delay": {"schedule": component("FixedDelay", delay=3)},
    "virtual_clock": {"schedule": component("VirtualClock", lam=120.0, overlap=False)},
    "virtual_clock_overlap": {"schedule": component("VirtualClock", lam=120.0, overlap=True)},
}


class CrashAt(pl.Callback):
    """Fail at the start of update ``step`` (after the checkpoint at ``EVERY`` was written)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


@pytest.mark.parametrize(
    "schedule", [s if s != "virtual_clock_overlap" else pytest.param(s, marks=pytest.mark.slow) for s in SCHEDULES]
)
def test_crash_and_resume_gives_the_unbroken_records(tmp_path, schedule):
    options = SCHEDULES[schedule]
    fit(write_config(tmp_path, "unbroken", total=TOTAL, every=EVERY, **options))
    config = write_config(tmp_path, "broken", total=TOTAL, every=EVERY, **options)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(config, callbacks=[CrashAt(EVERY + 2)])
    last = tmp_path / "broken" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)  # plain containers and tensors only
    assert checkpoint["global_step"] == EVERY
    data_state = checkpoint["RolloutDataModule"]
    queued = data_state["schedule"]["queue" if schedule == "fixed_delay" else "entries"]
    assert queued, "the checkpoint should hold batches generated but not yet consumed"
    group = (queued[0] if schedule == "fixed_delay" else queued[0]["batch"])[0]
    assert group["behavior_logprobs"].dtype == torch.float32 and group["version"] <= EVERY
    fit(config, "--ckpt_path", "last")
    assert_same_records(records(tmp_path / "broken"), records(tmp_path / "unbroken"))


def test_live_resume_loses_and_repeats_no_batch(tmp_path):
    config = write_config(tmp_path, "live", total=TOTAL, every=EVERY, schedule=component("Live"))
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(config, callbacks=[CrashAt(EVERY + 2)])
    fit(config, "--ckpt_path", "last")
    rec = records(tmp_path / "live")
    # One worker generating whole batches: update n consumes launch n, whatever happened in between.
    assert [rec[s]["schedule/batch_id"] for s in range(TOTAL)] == [float(s) for s in range(TOTAL)]


@pytest.mark.slow
def test_kill_9_then_ckpt_path_last_gives_the_unbroken_records(tmp_path):
    """A virtual_clock run killed with SIGKILL mid-way and resumed with ``--ckpt_path last`` from the shell."""
    total = 12
    options = {"schedule": component("VirtualClock", lam=120.0)}
    unbroken = run_subprocess(write_config(tmp_path, "unbroken", total=total, every=EVERY, **options))
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    config = write_config(tmp_path, "killed", total=total, every=EVERY, **options)
    # Killed as soon as last.ckpt appears (atomically, once the first checkpoint is written): the step records up to
    # the checkpoint must already be on disk, since the resumed run starts after them.
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    process = subprocess.Popen(fit_command(config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not last.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.kill()  # SIGKILL: no handler, no teardown, no final checkpoint
    _, stderr = process.communicate()
    assert process.returncode == -9, f"the run ended before it could be killed:\n{stderr[-3000:]}"
    steps_logged = records(tmp_path / "killed")
    assert max(steps_logged) < total - 1, "the kill should interrupt the run"
    resumed = run_subprocess(config, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stderr + resumed.stdout
    assert_same_records(records(tmp_path / "killed"), records(tmp_path / "unbroken"))


def test_ckpt_path_last_without_a_checkpoint_starts_fresh(tmp_path):
    """``--ckpt_path last`` is safe to always pass: with no checkpoint yet, the run simply starts."""
    config = write_config(tmp_path, "fresh", total=2, every=EVERY, schedule=component("FixedDelay", delay=1))
    fit(config, "--ckpt_path", "last")
    assert sorted(records(tmp_path / "fresh")) == [0, 1]
    assert Path(tmp_path / "fresh" / "checkpoints" / "last.ckpt").exists()


def test_a_finished_run_resumed_with_more_steps_continues_its_schedule(tmp_path):
    """The planned updates come from this run's config: a 4-step run resumed with max_steps 7 takes 3 more.

    The finished run drained its FIFO, so the extension refills it from its current policy, as a run starts."""
    config = write_config(tmp_path, "extend", total=4, every=2, schedule=component("FixedDelay", delay=2))
    fit(config)
    fit(config, "--trainer.max_steps", "7", "--ckpt_path", "last")
    rec = records(tmp_path / "extend")
    assert sorted(rec) == list(range(7))
    # every launch consumed once, in order; the delays of a start (0, 1, then D = 2), twice
    assert [rec[s]["schedule/batch_id"] for s in range(7)] == [float(s) for s in range(7)]
    assert [rec[s]["delay/max"] for s in range(7)] == [0.0, 1.0, 2.0, 2.0, 0.0, 1.0, 2.0]
    assert [rec[s]["schedule/draining"] for s in range(7)] == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]

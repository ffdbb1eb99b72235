"""Exact resume: a run stopped at step k and resumed from its checkpoint has the unbroken run's step records.

Records compared per step: consumed batch id, its launch version, mean reward and loss (to 1e-6), and the
schedule and delay scalars (virtual clock, queue depth, running delay moments). The DataModule's state
(queues, in-flight batches with versions and behaviour log-probs, clock, counters, stream position) and the
callbacks' states travel in the Lightning checkpoint, which loads with ``weights_only=True``.
"""

from __future__ import annotations

import subprocess
import time
import warnings
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


@pytest.mark.slow
def test_a_run_extended_from_before_its_drain_has_the_records_of_a_run_planned_that_long(tmp_path, monkeypatch):
    """A 4-update run resumed with --trainer.max_steps 7: from its last checkpoint (taken in FixedDelay's drain)
    the resume is refused, saying how to extend; from its checkpoint at update 2 (before the drain) it gives the
    records of a 7-update run; --data.refill_on_extend true goes on from a drained checkpoint with a new fill.

    The learning rate follows ``--lr_scheduler.total_steps`` (else each invocation's --trainer.max_steps), set to
    the final length here so that the rates, and so the records, match the 7-update run."""
    from test_first_hour import main_error_line

    options = {"every": 2, "schedule": component("FixedDelay", delay=2)}
    lr = ("--lr_scheduler.total_steps", "7")
    fit(write_config(tmp_path, "planned", total=7, **options), *lr)
    config = write_config(tmp_path, "extended", total=4, **options)
    fit(config, *lr)
    assert main_error_line(monkeypatch, "fit", "--config", str(config), *lr, "--trainer.max_steps", "7",
                           "--ckpt_path", "last") == (
        "lit_gmc: error: --trainer.max_steps 7 extends a run planned for 4 updates, but its checkpoint (at update 4) "
        "was taken after FixedDelay began its drain at update 2 (it stopped generating for the planned end), a state "
        "no run planned for 7 updates reaches. To extend it as if planned for 7 from the start, resume from a "
        "checkpoint at or before update 2 (kept by --checkpoint.every_n_train_steps or --checkpoint.at_steps); or "
        "add --data.refill_on_extend true to refill the schedule from the current policy, as at a start (delays "
        "restart from 0)"
    )  # fmt: skip
    (before_drain,) = (tmp_path / "extended" / "checkpoints").glob("*step=2.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(config, *lr, "--trainer.max_steps", "7", "--ckpt_path", str(before_drain))
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]  # its own folder: no warning
    assert_same_records(records(tmp_path / "extended"), records(tmp_path / "planned"))

    fit(config, *lr, "--trainer.max_steps", "9", "--data.refill_on_extend", "true", "--ckpt_path", "last")
    rec = records(tmp_path / "extended")
    assert [rec[s]["schedule/batch_id"] for s in range(9)] == [float(s) for s in range(9)]  # each launch once
    # the drained queue is refilled from the current policy: delays 0, 1 after update 7, as at a start
    assert [rec[s]["delay/max"] for s in range(9)] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0]
    assert [rec[s]["schedule/draining"] for s in range(9)] == [0.0] * 5 + [1.0, 1.0, 1.0, 1.0]


def test_lightning_s_non_empty_folder_warning_is_kept_for_a_run_that_does_not_resume(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lit_gmc.checkpoint import RunCheckpoint

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "other.ckpt").write_text("")
    trainer = pl.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[RunCheckpoint(dirpath=tmp_path / "ckpt")], default_root_dir=tmp_path)  # fmt: skip
    with pytest.warns(UserWarning, match=f"Checkpoint directory {tmp_path / 'ckpt'} exists and is not empty"):
        trainer.fit(BoringModel())

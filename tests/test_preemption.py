"""Preemption: SIGTERM (a cluster reclaiming the node) saves ``last.ckpt`` between two updates and exits with 143;
``--ckpt_path last`` then gives the step records of the run that was never stopped."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch
from run_helpers import Ranks, assert_same_records, component, fit, fit_command, records, write_config

TOTAL = 12
OPTIONS = {"schedule": component("FixedDelay", delay=2)}


def logged_steps(run_dir) -> int:
    """Steps whose records are on disk so far (0 before the event file exists)."""
    try:
        return len(records(run_dir))
    except FileNotFoundError:
        return 0


def test_sigterm_saves_last_ckpt_and_the_resumed_run_has_the_unbroken_records(tmp_path):
    fit(write_config(tmp_path, "unbroken", total=TOTAL, **OPTIONS))
    # No periodic checkpoint and save_last off: the checkpoint to resume from can only be SIGTERM's.
    config = write_config(tmp_path, "preempted", total=TOTAL, **OPTIONS)
    process = subprocess.Popen(fit_command(config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while logged_steps(tmp_path / "preempted") < 3 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # most likely mid-update: the run finishes that update first
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 143, f"exit status {process.returncode}:\n{stderr[-3000:]}"
    folder = tmp_path / "preempted" / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"], "only the checkpoint, no temporary file"
    checkpoint = torch.load(folder / "last.ckpt", weights_only=True)
    stopped = checkpoint["global_step"]
    assert 3 <= stopped < TOTAL and f"SIGTERM: saved {folder / 'last.ckpt'} at step {stopped}" in stderr
    assert max(records(tmp_path / "preempted")) == stopped - 1, "records up to the checkpoint, none after"

    fit(config, "--ckpt_path", "last")
    assert_same_records(records(tmp_path / "preempted"), records(tmp_path / "unbroken"))


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    root = tmp_path_factory.mktemp("unbroken")
    fit(write_config(root, "unbroken", total=TOTAL, batch_prompts=4, **OPTIONS))
    return records(root / "unbroken")


SHARDED = ("--trainer.strategy", "lit_gmc.strategies.FSDP2Strategy",
           "--trainer.strategy.save_distributed_checkpoint", "true")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signalled", "strategy"), [("every rank", ("--trainer.strategy", "ddp")), ("rank 1", SHARDED)]
)
def test_sigterm_stops_two_processes_at_one_step_and_the_resume_gives_the_unbroken_records(
    tmp_path, unbroken, signalled, strategy
):
    """SIGTERM to both processes (a preempted node) or to one: both stop after the same update, the checkpoint
    (a file, or a folder of shards) is written once, both exit with 143, and two processes resume from it."""
    config = write_config(tmp_path, "preempted", total=TOTAL, batch_prompts=4, **OPTIONS)
    ranks = Ranks(config, *strategy, logs=tmp_path)
    rank0, deadline = ranks.processes[0], time.monotonic() + 240
    while logged_steps(tmp_path / "preempted") < 3 and rank0.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in ranks.processes if signalled == "every rank" else ranks.processes[1:]:
        process.send_signal(signal.SIGTERM)
    codes, stderr = ranks.wait(timeout=240), ranks.stderr()
    assert codes == [143, 143], f"exit statuses {codes}:\n{stderr[-3000:]}\n{ranks.stderr(1)[-2000:]}"
    folder = tmp_path / "preempted" / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"], "only the checkpoint, no temporary file"
    meta = folder / "last.ckpt" / "meta.pt" if "--trainer.strategy.save_distributed_checkpoint" in strategy else None
    stopped = torch.load(meta or folder / "last.ckpt", weights_only=True)["global_step"]
    assert 3 <= stopped < TOTAL and stderr.count("SIGTERM: saved") == 1
    assert max(records(tmp_path / "preempted")) == stopped - 1, "records up to the checkpoint, none after"

    resumed = Ranks(config, *strategy, "--ckpt_path", "last", logs=tmp_path)
    assert resumed.wait(timeout=300) == [0, 0], resumed.stderr()[-3000:]
    assert_same_records(records(tmp_path / "preempted"), unbroken, tol=1e-5)

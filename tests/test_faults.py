"""Faults end in one ``lit_gmc: error:`` line, or in a saved checkpoint, and lose nothing.

Each fault is met through ``lit_gmc.__main__.main`` on the shipped ``configs/tiny.yaml`` (``run_helpers``): a reward
that raises, a reward that never returns (``--data.reward_timeout_s``), SIGTERM while a reward hangs (the run stops
within seconds, saves ``last.ckpt`` of the last update and the resume gives the unbroken records), an actor whose
tokenizer has no EOS token, and a disk that fills while a checkpoint is written (a real tmpfs of a few MiB, in a
mount namespace of its own).
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from run_helpers import (
    assert_same_records,
    component,
    config_args,
    digit_fraction,
    fit,
    fit_command,
    records,
    write_config,
)

from lit_gmc.__main__ import PREEMPTED, main

HANG = threading.Event()  # set: the next reward call signals SIGTERM to this process and hangs
RELEASE = threading.Event()  # set after each test: the hung rewards return, so no test leaves their threads behind


@pytest.fixture(autouse=True)
def release_hung_rewards():
    yield
    RELEASE.set()
    for thread in threading.enumerate():
        if thread.name == "lit_gmc-reward":
            thread.join(timeout=10)
    RELEASE.clear()


def raises(completions: list[str], answer: str) -> list[float]:
    """``--data.reward test_faults.raises``: a plug-in reward with a bug."""
    return [len(text) / (len(answer) - len(answer)) for text in completions]  # ZeroDivisionError


def sleeps(completions: list[str], answer: str) -> list[float]:
    """``--data.reward test_faults.sleeps``: a reward that never returns (a verifier stuck on one answer)."""
    RELEASE.wait()
    return []


def hangs_once_signalled(completions: list[str], answer: str) -> list[float]:
    """:func:`~run_helpers.digit_fraction`, except that the call after :data:`HANG` is set sends SIGTERM to this
    process (a preemption) and then hangs until the test ends."""
    if HANG.is_set():
        HANG.clear()
        os.kill(os.getpid(), signal.SIGTERM)
        RELEASE.wait()
    return digit_fraction(completions, answer)


def main_exit(monkeypatch, *argv: str) -> tuple[int, list[str]]:
    """``lit_gmc`` on ``argv`` in this process: its exit status and the lines it printed on stderr."""
    monkeypatch.setattr("sys.argv", ["lit_gmc", *argv])
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    with pytest.raises(SystemExit) as stop:
        main()
    return stop.value.code, stderr.getvalue().strip().splitlines()


def test_a_plug_in_reward_that_raises_is_one_line_naming_it(tmp_path, monkeypatch):
    config = write_config(tmp_path, "raises", total=2, reward="test_faults.raises")
    code, lines = main_exit(monkeypatch, "fit", *config_args(config))
    assert code == 2
    assert re.fullmatch(
        r"lit_gmc: error: reward --data.reward test_faults.raises raised ZeroDivisionError on prompt \d+: "
        r"division by zero",
        lines[-1],
    ), lines[-1]
    assert not any(line.startswith("Traceback") for line in lines)


def test_a_reward_that_never_returns_stops_the_run_at_its_time_limit(tmp_path, monkeypatch):
    config = write_config(tmp_path, "sleeps", total=2, reward="test_faults.sleeps")
    started = time.monotonic()
    code, lines = main_exit(monkeypatch, "fit", *config_args(config), "--data.reward_timeout_s", "0.5")
    assert code == 2 and time.monotonic() - started < 60
    assert lines[-1].startswith("lit_gmc: error: reward --data.reward test_faults.sleeps did not return within 0.5 s")
    assert lines[-1].endswith(
        "(--data.reward_timeout_s): the run stops here; make the reward faster or raise the limit"
    )


def test_a_reward_time_limit_of_zero_is_refused_with_its_name(tmp_path, monkeypatch):
    config = write_config(tmp_path, "zero", total=2)
    code, lines = main_exit(monkeypatch, "fit", *config_args(config), "--data.reward_timeout_s", "0")
    assert code == 2 and "reward_timeout_s=0.0 must be > 0 (or null: no limit)" in lines[-1]


class HangAfter(pl.Callback):
    """Sets :data:`HANG` once update ``step`` has ended: the generation for the next update meets the hang."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            HANG.set()


def test_sigterm_while_a_reward_hangs_saves_the_last_update_and_the_resume_is_exact(tmp_path, monkeypatch):
    """The generation for update 4 (FixedDelay(2) launching from theta_4) is preempted while its reward hangs."""
    total = 8
    options = {"schedule": component("FixedDelay", delay=2), "reward": "test_faults.hangs_once_signalled"}
    fit(write_config(tmp_path, "unbroken", total=total, **options))
    hang = {"class_path": "test_faults.HangAfter", "init_args": {"step": 4}}
    config = write_config(tmp_path, "preempted", total=total, extra_callbacks=[hang], **options)
    started = time.monotonic()
    code, lines = main_exit(monkeypatch, "fit", *config_args(config))
    assert code == PREEMPTED and time.monotonic() - started < 60, lines[-5:]
    last = tmp_path / "preempted" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 4
    assert max(records(tmp_path / "preempted")) == 3, "records up to the checkpoint, none after"
    fit(config, "--ckpt_path", "last")
    assert_same_records(records(tmp_path / "preempted"), records(tmp_path / "unbroken"))


def test_an_actor_whose_tokenizer_has_no_eos_token_is_one_line_naming_it(tmp_path, monkeypatch, tiny_actor_dir):
    settings = tiny_actor_dir / "tokenizer_config.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "eos_token": None}))
    config = write_config(tmp_path, "no_eos", total=2)
    code, lines = main_exit(monkeypatch, "fit", *config_args(config), "--model.actor", str(tiny_actor_dir))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        f"lit_gmc: error: --model.actor {tiny_actor_dir}: its tokenizer has no eos_token; "
        "HFEngine ends a response at EOS and pads with the padding token (the EOS when none is set): set "
        '"eos_token" in the actor\'s tokenizer_config.json'
    )


def can_mount_a_tmpfs() -> bool:
    """Whether this machine lets a process mount a tmpfs in a mount namespace of its own (``unshare -rm``)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m none /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not can_mount_a_tmpfs(), reason="needs unshare -rm and tmpfs mounts in user namespaces")
def test_a_disk_that_fills_during_a_checkpoint_is_one_line_naming_it_and_the_earlier_one_resumes(tmp_path):
    """Checkpoints (about 3.5 MiB each, written twice per save: the step's file and last.ckpt) go to a 9 MiB tmpfs:
    the save at step 2 fits, the one at step 4 fills the disk. The run ends in one line naming the file; last.ckpt
    of step 2 is intact and resumes the run exactly."""
    total, every = 6, 2
    fit(write_config(tmp_path, "unbroken", total=total, every=every))
    config = write_config(tmp_path, "full", total=total, every=every)
    disk, kept = Path("/mnt"), tmp_path / "kept"
    fit_args = " ".join(shlex.quote(arg) for arg in fit_command(config, "--checkpoint.dirpath", str(disk)))
    script = f"mount -t tmpfs -o size=9m none {disk} && {fit_args}; status=$?; cp -r {disk} {kept}; exit $status"
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.fullmatch(
        rf"lit_gmc: error: checkpoint {disk}/epoch=0-step=4.ckpt could not be written \(.*\); earlier checkpoints are "
        r"intact \(a checkpoint is written under a temporary name, then renamed\): free some space and resume with "
        r"--ckpt_path last",
        lines[-1],
    ), lines[-1]
    assert sorted(p.name for p in kept.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # no temporary file left
    assert torch.load(kept / "last.ckpt", weights_only=True)["global_step"] == every
    fit(config, "--ckpt_path", str(kept / "last.ckpt"), "--checkpoint.dirpath", str(tmp_path / "room"))
    assert_same_records(records(tmp_path / "full"), records(tmp_path / "unbroken"))

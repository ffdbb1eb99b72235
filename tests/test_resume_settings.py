"""A resume checks its checkpoint: settings that change the run are refused by flag, a non-checkpoint is named.

The allowed changes (``--trainer.max_steps``, memory and speed knobs, logging, callbacks) are listed in
``lit_gmc/resume.py`` and docs/usage.md.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from run_helpers import assert_same_records, component, fit, main_error_line, records, write_config
from test_cli import parse

import lit_gmc.resume
from lit_gmc.cli import OPTION_OWNERS
from lit_gmc.errors import UserError
from lit_gmc.resume import (
    SETTINGS_KEY,
    changed_settings,
    check_resume,
    checkpoint_file,
    read_checkpoint,
    run_settings,
    saved_settings,
)

DELAY2 = {"schedule": component("FixedDelay", delay=2)}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 4-step G = 4 run with checkpoints at steps 2 and 4: its config and its folder."""
    root = tmp_path_factory.mktemp("settings")
    config = write_config(root, "run", total=4, every=2, **DELAY2)
    fit(config)
    return config, root / "run"


def test_every_checkpoint_records_the_runs_settings(finished):
    _, run = finished
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    settings = checkpoint[SETTINGS_KEY]
    assert settings["--data.group_size"] == 4 and settings["--model.correction"] == "lit_gmc.rules.GMC"
    assert settings["--model.correction.cap"] == 0.28 and settings["--lr_scheduler.warmup_fraction"] == 0.0
    assert settings["--data.schedule"] == "lit_gmc.data.schedules.base.FixedDelay"
    assert settings["--data.schedule.delay"] == 2
    assert settings["--data.task"] == "lit_gmc.data.tasks.addition.Addition" and "--data.engine.batch_rows" in settings


def test_a_resume_with_another_group_size_is_refused_naming_each_change(finished):
    config, run = finished
    with pytest.raises(UserError) as refused:
        fit(config, "--data.group_size", "2", "--model.correction.cap", "0.3", "--data.schedule.delay", "3",
            "--ckpt_path", "last")  # fmt: skip
    message = str(refused.value)
    assert "last.ckpt was saved with other settings" in message
    for line in ("--data.group_size: 4 in the checkpoint, 2 now",
                 "--model.correction.cap: 0.28 in the checkpoint, 0.3 now",
                 "--data.schedule.delay: 2 in the checkpoint, 3 now"):  # fmt: skip
        assert line in message, message
    assert "--trainer.max_steps" not in message and "--data.total_updates" not in message


def test_another_schedule_class_is_one_line(finished):
    config, run = finished
    with pytest.raises(UserError) as refused:
        fit(config, "--data.schedule", "Sync", "--ckpt_path", str(run / "checkpoints" / "epoch=0-step=2.ckpt"))
    lines = str(refused.value).splitlines()[1:-1]
    assert lines == ["  --data.schedule: 'lit_gmc.data.schedules.base.FixedDelay' in the checkpoint, "
                     "'lit_gmc.data.schedules.base.Sync' now"]  # fmt: skip


def test_allowed_changes_resume(tmp_path):
    """More steps (from a drained checkpoint, with the refill a resume may turn on), other memory knobs, threads,
    display and checkpoint options: the run goes on from its checkpoint."""
    schedule = component("FixedDelay", delay=2, refill_on_extend=False)  # a resume may turn it on
    config = write_config(tmp_path, "grow", total=2, every=2, schedule=schedule)
    fit(config)
    fit(config, "--trainer.max_steps", "3", "--model.micro_batch_groups", "1", "--model.logit_chunk_tokens", "2",
        "--torch_num_threads", "1", "--trainer.enable_model_summary", "true", "--checkpoint.every_n_train_steps", "1",
        "--data.schedule.refill_on_extend", "true", "--ckpt_path", "last")  # fmt: skip
    assert sorted(records(tmp_path / "grow")) == [0, 1, 2]


def test_the_user_sees_one_line_and_status_2(finished):
    config, _ = finished
    done = subprocess.run([sys.executable, "-m", "lit_gmc", "fit", "--config", str(config), "--data.group_size", "8",
                           "--ckpt_path", "last"], capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "lit_gmc: error: --ckpt_path" in done.stderr
    assert "--data.group_size: 4 in the checkpoint, 8 now" in done.stderr


# Unit checks of the comparison (no run).


def settings_of(*args: str) -> dict:
    return run_settings(parse(*args))


def test_what_may_change_is_not_compared():
    saved = settings_of("--data.schedule", "VirtualClock")
    now = settings_of("--data.schedule", "VirtualClock", "--data.schedule.overlap", "false", "--trainer.max_steps",
                      "9", "--model.micro_batch_groups", "2", "--model.gradient_checkpointing", "true")  # fmt: skip
    assert changed_settings(saved, now, OPTION_OWNERS) == []
    now = settings_of("--data.schedule", "VirtualClock", "--data.schedule.lam", "5", "--trainer.precision", "64-true",
                      "--model.dtype", "float64", "--data.engine.batch_rows", "8")  # fmt: skip
    changed = [line.split(":")[0] for line in changed_settings(saved, now, OPTION_OWNERS)]
    assert changed == ["--model.dtype", "--data.engine.batch_rows", "--data.schedule.lam", "--trainer.precision"]


def test_rule_optimizer_and_schedule_options_are_compared_flag_by_flag():
    saved = settings_of("--model.correction", "GRPO", "--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.1",
                        "--lr_scheduler.warmup_fraction", "0.1")  # fmt: skip
    now = settings_of("--model.correction", "GRPO", "--model.correction.clip", "0.25", "--optimizer",
                      "torch.optim.SGD", "--optimizer.lr", "0.2", "--lr_scheduler.warmup_fraction", "0.2",
                      "--trainer.max_steps", "9")  # fmt: skip
    assert changed_settings(saved, now, OPTION_OWNERS) == [
        "--model.correction.clip: 0.2 in the checkpoint, 0.25 now",
        "--optimizer.lr: 0.1 in the checkpoint, 0.2 now",
        "--lr_scheduler.warmup_fraction: 0.1 in the checkpoint, 0.2 now",
    ]  # the schedule's total_steps follows --trainer.max_steps, which may change
    other = settings_of("--model.correction", "TIC", "--optimizer", "torch.optim.AdamW")
    assert changed_settings(saved, other, OPTION_OWNERS) == [
        "--model.correction: 'lit_gmc.rules.GRPO' in the checkpoint, 'lit_gmc.rules.TIC' now",
        "--optimizer: 'torch.optim.SGD' in the checkpoint, 'torch.optim.AdamW' now",
        "--lr_scheduler.warmup_fraction: 0.1 in the checkpoint, 0.0 now",
    ]


def test_a_checkpoint_from_before_the_options_moved_compares_them_under_their_new_flags():
    """Issue 51 moved four ``--data`` options into the components they belong to; a checkpoint written before (its
    settings under the old flags) resumes, and a change of one of them is still refused, by its new flag."""
    now = settings_of("--data.engine.recompute_behavior_logprobs", "true")
    old_flags = {new: old for old, new in lit_gmc.resume.RENAMED.items()}
    written_before = {old_flags.get(flag, flag): value for flag, value in now.items()}
    assert {"--data.temperature", "--data.top_p", "--data.recompute_behavior_logprobs"} <= set(written_before)
    saved = saved_settings({SETTINGS_KEY: written_before})
    assert saved == now and changed_settings(saved, now, OPTION_OWNERS) == []
    other = settings_of("--data.sampling.temperature", "0.7", "--data.schedule.refill_on_extend", "false")
    assert changed_settings(saved, other, OPTION_OWNERS) == [
        "--data.engine.recompute_behavior_logprobs: True in the checkpoint, False now",
        "--data.sampling.temperature: 1.0 in the checkpoint, 0.7 now",
    ]  # refill_on_extend is the resume's own choice


def test_a_checkpoint_from_before_the_settings_compares_its_hyperparameters(tmp_path):
    old = {"pytorch-lightning_version": "2.6.6", "state_dict": {}, "RolloutDataModule": {},
           "hyper_parameters": {"correction": "gmc", "lr": 2e-4, "_instantiator": "x"},
           "datamodule_hyper_parameters": {"group_size": 8, "total_updates": 100}}  # fmt: skip
    torch.save(old, tmp_path / "old.ckpt")
    now = settings_of("--data.group_size", "4", "--trainer.max_steps", "7")
    with pytest.raises(UserError, match="--data.group_size: 8 in the checkpoint, 4 now") as refused:
        check_resume(str(tmp_path / "old.ckpt"), None, now, OPTION_OWNERS)
    assert "--model.lr" not in str(refused.value) and "total_updates" not in str(refused.value)


def test_last_is_the_newest_last_checkpoint_and_none_before_the_first(tmp_path):
    assert checkpoint_file("last", str(tmp_path)) is None
    assert checkpoint_file("last", str(tmp_path / "absent")) is None
    (tmp_path / "epoch=0-step=2.ckpt").write_bytes(b"")
    assert checkpoint_file("last", str(tmp_path)) is None
    for age, name in enumerate(("last-v1.ckpt", "last.ckpt")):
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (1e9 - age, 1e9 - age))
    assert checkpoint_file("last", str(tmp_path)) == tmp_path / "last-v1.ckpt"
    sharded = tmp_path / "last-v2.ckpt"  # a folder of shards (FSDP2 save_distributed_checkpoint), read by its meta.pt
    sharded.mkdir()
    assert checkpoint_file("last", str(tmp_path)) == sharded and checkpoint_file(str(sharded), None) == sharded
    with pytest.raises(UserError, match=r"last-v2.ckpt is not a lit_gmc checkpoint \(a folder without meta.pt\)"):
        read_checkpoint(sharded)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"hello\n", "torch.load cannot read it as one"),
        (bytes(range(256)) * 4, "torch.load cannot read it as one"),
        ([1, 2], "it holds a list"),
        ({"a": 1}, "it has no pytorch-lightning_version, state_dict, hyper_parameters, RolloutDataModule"),
    ],
    ids=["text", "bytes", "list", "dict"],
)
def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path, content, why):
    path = tmp_path / "thing.ckpt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(UserError, match=f"--ckpt_path {path} is not a lit_gmc checkpoint") as refused:
        parse("--ckpt_path", str(path))
    assert why in str(refused.value)


def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"--ckpt_path {tmp_path / 'gone.ckpt'}: no such file"):
        parse("--ckpt_path", str(tmp_path / "gone.ckpt"))


def test_each_class_declares_the_options_a_resume_may_change_and_resume_names_no_class():
    """The class that owns an option says whether a resume may change it; a renamed option fails here, not silently."""
    import inspect

    from lit_gmc.data.engines.vllm import VLLMEngine
    from lit_gmc.data.engines.vllm_serve import VLLMServers
    from lit_gmc.data.schedules.base import FixedDelay, Sync
    from lit_gmc.data.schedules.live import Live
    from lit_gmc.data.schedules.virtual_clock import VirtualClock
    from lit_gmc.data.tasks.math import Math

    for owner in (*OPTION_OWNERS.values(), FixedDelay, Sync, VirtualClock, Live, VLLMEngine, VLLMServers, Math):
        parameters = inspect.signature(owner.__init__).parameters
        assert owner.may_change_on_resume and owner.may_change_on_resume <= set(parameters), owner.__name__
    assert '"lit_gmc.' not in inspect.getsource(lit_gmc.resume)  # no class path kept as a string
    saved = settings_of("--data.schedule", "Live")
    now = settings_of("--data.schedule", "Live", "--data.schedule.join_timeout_s", "5", "--data.schedule.workers", "2")
    assert changed_settings(saved, now, OPTION_OWNERS) == ["--data.schedule.workers: 1 in the checkpoint, 2 now"]


def test_ckpt_path_last_without_a_checkpoint_starts_fresh(tmp_path):
    """``--ckpt_path last`` is safe to always pass: with no checkpoint yet, the run simply starts."""
    config = write_config(tmp_path, "fresh", total=2, every=3, schedule=component("FixedDelay", delay=1))
    fit(config, "--ckpt_path", "last")
    assert sorted(records(tmp_path / "fresh")) == [0, 1]
    assert Path(tmp_path / "fresh" / "checkpoints" / "last.ckpt").exists()


class LightningLines(logging.Handler):
    """The lines Lightning's console logger prints (``rank_zero_info``), while installed with ``with``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> LightningLines:
        logging.getLogger("lightning.pytorch").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("lightning.pytorch").removeHandler(self)


@pytest.mark.slow
def test_a_run_extended_from_before_its_drain_has_the_records_of_a_run_planned_that_long(tmp_path, monkeypatch):
    """A 4-update run resumed with --trainer.max_steps 7 from its checkpoint at update 2 (before FixedDelay's drain)
    gives the records of a 7-update run, with the schedule's refill_on_extend on (the default); from its last
    checkpoint (in the drain) that resume is refused with refill_on_extend false, saying how to extend. The 7-update
    run's own last.ckpt (drained) extended to 9 updates refills the queue from its policy, and one log line says so.

    The learning rate follows ``--lr_scheduler.total_steps`` (else each invocation's --trainer.max_steps), set to
    the final length here so that the rates, and so the records, match the 7-update run."""
    options = {"every": 2, "schedule": component("FixedDelay", delay=2)}
    lr = ("--lr_scheduler.total_steps", "7")
    fit(write_config(tmp_path, "planned", total=7, **options), *lr)
    config = write_config(tmp_path, "extended", total=4, **options)
    fit(config, *lr)
    assert main_error_line(monkeypatch, "fit", "--config", str(config), *lr, "--trainer.max_steps", "7",
                           "--data.schedule.refill_on_extend", "false", "--ckpt_path", "last") == (
        "lit_gmc: error: --trainer.max_steps 7 extends a run planned for 4 updates, but its checkpoint (at update 4) "
        "was taken after FixedDelay began its drain at update 2 (it stopped generating for the planned end), a state "
        "no run planned for 7 updates reaches. To extend it as if planned for 7 from the start, resume from a "
        "checkpoint at or before update 2 (kept by --checkpoint.every_n_train_steps or --checkpoint.at_steps); or "
        "leave --data.schedule.refill_on_extend true (the default) to refill the schedule from the checkpoint's "
        "policy, as at a start (delays restart from 0)"
    )  # fmt: skip
    (before_drain,) = (tmp_path / "extended" / "checkpoints").glob("*step=2.ckpt")
    with warnings.catch_warnings(record=True) as caught, LightningLines() as log:
        warnings.simplefilter("always")
        fit(config, *lr, "--trainer.max_steps", "7", "--ckpt_path", str(before_drain))
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]  # its own folder: no warning
    assert not [line for line in log.lines if "refilled" in line]  # the exact path: nothing to say
    assert_same_records(records(tmp_path / "extended"), records(tmp_path / "planned"))

    with LightningLines() as log:
        fit(config, *lr, "--trainer.max_steps", "9", "--ckpt_path", "last")
    assert [line for line in log.lines if "refilled" in line] == [
        "extending a run planned for 7 updates to 9 from its checkpoint at update 7, taken after FixedDelay began its "
        "drain at update 5: the schedule is refilled from the checkpoint's policy (delays restart from 0), so the "
        "records differ from a run planned for 9 updates from the start, which a checkpoint at or before update 5 "
        "would give (--data.schedule.refill_on_extend false refuses this resume)"
    ]  # fmt: skip
    rec = records(tmp_path / "extended")
    assert [rec[s]["schedule/batch_id"] for s in range(9)] == [float(s) for s in range(9)]  # each launch once
    # the drained queue is refilled from the current policy: delays 0, 1 after update 7, as at a start
    assert [rec[s]["delay/max"] for s in range(9)] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0]
    assert [rec[s]["schedule/launch_version"] for s in range(7, 9)] == [7.0, 7.0]  # both from the checkpoint's policy
    assert [rec[s]["schedule/draining"] for s in range(9)] == [0.0] * 5 + [1.0, 1.0, 1.0, 1.0]

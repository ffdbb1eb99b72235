"""Exact resume: a run stopped part-way and resumed from its checkpoint has the unbroken run's per-step records.

One matrix of stopped runs, rule x schedule x strategy x engine x how the run stops, each cell compared with a run
that was never stopped. Records compared per step: consumed batch id and launch version (exactly), mean reward and
loss (to 1e-6 in one process, 1e-5 across two), and the schedule and delay scalars; two-process kill -9 cells compare
the scale-out tags of ``run_helpers.assert_reproduces``. The DataModule's state (queues, in-flight batches with
versions and behaviour log-probs, clock, counters, stream position), the rule's and the callbacks' states travel in
the Lightning checkpoint, which loads with ``weights_only=True``.

Pairs of axes that can differ, and the cells that cover them:

- schedule x stop: each schedule keeps a different state (FixedDelay's queue, VirtualClock's entries and clock, the
  overlapped clock's in-flight launch, Live's claimed chunks); an exception and kill -9 resume from a periodic
  checkpoint taken mid-queue, SIGTERM from the one it writes where it lands. FixedDelay x exception, SIGTERM and
  kill -9 (two processes); VirtualClock, the overlapped VirtualClock and Live x exception. A kill -9 resumes from
  the same periodic checkpoint as an exception, with only the records on disk to differ, which
  ``tests/test_loggers.py`` kills one process for; VirtualClock x kill -9 of one process is ``extended``.
- strategy x stop: two processes must stop at one step and write one checkpoint (a file under DDP, a folder of shards
  under FSDP2 whose metadata comes last). DDP x kill -9 of both; FSDP2 sharded x SIGTERM to every rank and kill -9
  in the middle of a save over the previous checkpoint; one process x all three. SIGTERM to one rank, which the
  others learn of on the rank-0 channel whatever the strategy, is ``tests/test_sigterm_waits.py``'s (DDP, rank 1,
  with an exact resume) and ``tests/test_vllm_serve.py``'s; DDP x SIGTERM to every rank and FSDP2 sharded x
  SIGTERM to rank 1 are ``extended``.
- rule x strategy and rule x stop: GMC keeps no state between updates, GAC keeps the previous update's gradient
  (sharded under FSDP2). GAC x FSDP2 sharded x kill -9, GMC elsewhere; GAC x FSDP2 with one checkpoint file is
  ``extended``. The two kill -9 cells are also CI's two-process runs of the shipped config against one process
  (their records, half written before the kill and half after the resume, are compared with the single-process
  run's); ``tests/test_scale_out.py``'s uninterrupted ones are ``extended``.
- engine: every cell runs the in-process HF engine, whose only state is its weights and version, restored through
  ``WeightSync`` from the learner's. The server engine's resume (weights re-sent to restarted servers) is
  ``tests/test_vllm_serve.py``'s; the own-process HF runner holds the same state as the in-process one.

Reference runs are shared: one per (schedule, config) in this module, and the two-process runs' single-process
references (``single_process_runs`` in ``conftest.py``) with ``tests/test_scale_out.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from run_helpers import (
    MICRO,
    SCALE_OUT,
    Ranks,
    assert_reproduces,
    assert_same_records,
    component,
    fit,
    fit_command,
    records,
    run_subprocess,
    write_config,
)

TOTAL, EVERY = 12, 3
# batch_prompts 4: the one-process cells share their reference with the two-process SIGTERM cells (2 groups a rank)
SCHEDULES = {
    "fixed_delay": {"schedule": component("FixedDelay", delay=2), "batch_prompts": 4},
    "virtual_clock": {"schedule": component("VirtualClock", lam=120.0, overlap=False), "batch_prompts": 4},
    "virtual_clock_overlap": {"schedule": component("VirtualClock", lam=120.0, overlap=True), "batch_prompts": 4},
    "live": {"schedule": component("Live"), "batch_prompts": 4},
}
STRATEGIES = {
    "one": (),
    "ddp": ("--trainer.devices", "2", "--trainer.strategy", "ddp"),
    "fsdp2": ("--trainer.devices", "2", "--trainer.strategy", "fsdp2"),
    # FSDP2 with a folder of per-rank shards per checkpoint (Lightning's distributed checkpoint)
    "fsdp2_sharded": ("--trainer.devices", "2", "--trainer.strategy", "lit_gmc.strategies.FSDP2Strategy",
                      "--trainer.strategy.save_distributed_checkpoint", "true"),
}  # fmt: skip


@dataclass(frozen=True)
class Cell:
    rule: str
    schedule: str  # a key of SCHEDULES, or "shipped" (configs/tiny.yaml's FixedDelay(8), the scale-out runs')
    strategy: str  # a key of STRATEGIES
    stop: str  # "exception", "kill -9", "SIGTERM" (to every rank), "SIGTERM rank 1"
    engine: str = "hf"

    def __str__(self) -> str:
        return "-".join((self.rule, self.schedule, self.strategy, self.engine, self.stop.replace(" ", "")))


def cell(*args: str, marks=()) -> pytest.param:
    case = Cell(*args)
    return pytest.param(case, id=str(case), marks=marks)


MATRIX = [
    cell("gmc", "fixed_delay", "one", "exception"),
    cell("gmc", "virtual_clock", "one", "exception"),
    cell("gmc", "virtual_clock_overlap", "one", "exception", marks=pytest.mark.slow),
    cell("gmc", "live", "one", "exception"),
    cell("gmc", "fixed_delay", "one", "SIGTERM"),
    cell("gmc", "fixed_delay", "fsdp2_sharded", "SIGTERM", marks=pytest.mark.slow),
    cell("gmc", "shipped", "ddp", "kill -9", marks=pytest.mark.slow),
    # killed in the middle of a save of last.ckpt over the previous one (KillWhileSaving)
    cell("gac", "shipped", "fsdp2_sharded", "kill -9", marks=pytest.mark.slow),
    # Left to the extended run for CI's time, each covered as said in the module's docstring:
    cell("gac", "shipped", "fsdp2", "kill -9", marks=(pytest.mark.slow, pytest.mark.extended)),
    cell("gmc", "virtual_clock", "one", "kill -9", marks=(pytest.mark.slow, pytest.mark.extended)),
    cell("gmc", "fixed_delay", "ddp", "SIGTERM", marks=(pytest.mark.slow, pytest.mark.extended)),
    cell("gmc", "fixed_delay", "fsdp2_sharded", "SIGTERM rank 1", marks=(pytest.mark.slow, pytest.mark.extended)),
]


class KillWhileSaving(pl.Callback):
    """SIGKILL every process of the run (its process group, as when the node dies) in the middle of its ``save``-th
    checkpoint save, unless the run resumed from a checkpoint.

    The kill lands while global rank 0 pickles the checkpoint into the last file it writes: a sharded save's
    ``meta.pt``, after every rank's shards (a one-file save's only file). Deterministic, unlike a kill from outside
    timed by the files that appear, which lands before, during or after a save of a tiny model."""

    def __init__(self, save: int) -> None:
        self.save, self.saves = save, 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saves += 1
        if self.saves == self.save and trainer.ckpt_path is None and trainer.is_global_zero:
            checkpoint["killed while pickled"] = KilledWhilePickled()


class KilledWhilePickled:
    def __reduce__(self):
        os.killpg(os.getpgrp(), signal.SIGKILL)


class CrashAt(pl.Callback):
    """Fail at the start of update ``step`` (after the checkpoint at ``EVERY`` was written)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """``unbroken(schedule)``: the records of the never-stopped one-process run of a :data:`SCHEDULES` entry (without
    checkpoints: a checkpoint must change no record), made once per module."""
    made: dict[str, dict] = {}

    def get(schedule: str) -> dict:
        if schedule not in made:
            root = tmp_path_factory.mktemp(schedule)
            fit(write_config(root, "unbroken", total=TOTAL, **SCHEDULES[schedule]))
            made[schedule] = records(root / "unbroken")
        return made[schedule]

    return get


def logged_steps(run_dir: Path) -> int:
    """Steps whose records are on disk so far (0 before the event file exists)."""
    try:
        return len(records(run_dir))
    except FileNotFoundError:
        return 0


def wait_for(condition, process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("case", MATRIX)
def test_a_stopped_run_resumed_from_its_checkpoint_has_the_unbroken_records(tmp_path, unbroken, request, case):
    if case.schedule == "shipped":  # the session's references, made only when a cell needs them
        stop_two_processes_with_kill_9(tmp_path, case, request.getfixturevalue("single_process_runs")[case.rule])
    elif case.stop == "exception":
        stop_with_an_exception(tmp_path, case, unbroken)
    elif case.stop == "kill -9":
        stop_one_process_with_kill_9(tmp_path, case, unbroken(case.schedule))
    elif case.strategy == "one":
        stop_one_process_with_sigterm(tmp_path, case, unbroken(case.schedule))
    else:
        stop_two_processes_with_sigterm(tmp_path, case, unbroken(case.schedule))


def stop_with_an_exception(tmp_path: Path, case: Cell, unbroken) -> None:
    """Fails in this process at update ``EVERY + 2``; the checkpoint at ``EVERY`` holds batches generated but not yet
    consumed, with their versions and float32 behaviour log-probs."""
    config = write_config(tmp_path, "broken", total=TOTAL, every=EVERY, **SCHEDULES[case.schedule])
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(config, callbacks=[CrashAt(EVERY + 2)])
    if case.schedule != "live":
        last = tmp_path / "broken" / "checkpoints" / "last.ckpt"
        checkpoint = torch.load(last, weights_only=True)  # plain containers and tensors only
        assert checkpoint["global_step"] == EVERY
        data_state = checkpoint["RolloutDataModule"]
        queued = data_state["schedule"]["queue" if case.schedule == "fixed_delay" else "entries"]
        assert queued, "the checkpoint should hold batches generated but not yet consumed"
        group = (queued[0] if case.schedule == "fixed_delay" else queued[0]["batch"])[0]
        assert group["behavior_logprobs"].dtype == torch.float32 and group["version"] <= EVERY
    fit(config, "--ckpt_path", "last")
    rec = records(tmp_path / "broken")
    if case.schedule == "live":  # threads make Live's records differ from run to run
        # One worker generating whole batches: update n consumes launch n, whatever happened in between.
        assert [rec[s]["schedule/batch_id"] for s in range(TOTAL)] == [float(s) for s in range(TOTAL)]
    else:
        assert_same_records(rec, unbroken(case.schedule))


def stop_one_process_with_kill_9(tmp_path: Path, case: Cell, want: dict) -> None:
    """``python -m lit_gmc fit`` killed with SIGKILL as soon as ``last.ckpt`` appears (atomically, once the first
    checkpoint is written), resumed with ``--ckpt_path last`` from the shell: the step records up to the checkpoint
    must already be on disk, since the resumed run starts after them."""
    config = write_config(tmp_path, "killed", total=TOTAL, every=EVERY, **SCHEDULES[case.schedule])
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    process = subprocess.Popen(fit_command(config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(last.exists, process)
    process.kill()  # SIGKILL: no handler, no teardown, no final checkpoint
    _, stderr = process.communicate()
    assert process.returncode == -9, f"the run ended before it could be killed:\n{stderr[-3000:]}"
    assert max(records(tmp_path / "killed")) < TOTAL - 1, "the kill should interrupt the run"
    resumed = run_subprocess(config, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stderr + resumed.stdout
    assert_same_records(records(tmp_path / "killed"), want)


def stop_one_process_with_sigterm(tmp_path: Path, case: Cell, want: dict) -> None:
    """SIGTERM (a cluster reclaiming the node) saves ``last.ckpt`` between two updates and exits with 143. No periodic
    checkpoint and save_last off: the checkpoint to resume from can only be SIGTERM's."""
    config = write_config(tmp_path, "preempted", total=TOTAL, **SCHEDULES[case.schedule])
    process = subprocess.Popen(fit_command(config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: logged_steps(tmp_path / "preempted") >= 3, process)
    process.send_signal(signal.SIGTERM)  # most likely mid-update: the run finishes that update first
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 143, f"exit status {process.returncode}:\n{stderr[-3000:]}"
    folder = tmp_path / "preempted" / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"], "only the checkpoint, no temporary file"
    stopped = torch.load(folder / "last.ckpt", weights_only=True)["global_step"]
    assert 3 <= stopped < TOTAL and f"SIGTERM: saved {folder / 'last.ckpt'} at step {stopped}" in stderr
    assert max(records(tmp_path / "preempted")) == stopped - 1, "records up to the checkpoint, none after"
    fit(config, "--ckpt_path", "last")
    assert_same_records(records(tmp_path / "preempted"), want)


def stop_two_processes_with_sigterm(tmp_path: Path, case: Cell, want: dict) -> None:
    """SIGTERM to both processes (a preempted node) or to one: both stop after the same update, the checkpoint (a
    file, or a folder of shards) is written once, both exit with 143, and two processes resume from it."""
    config = write_config(tmp_path, "preempted", total=TOTAL, **SCHEDULES[case.schedule])
    strategy = STRATEGIES[case.strategy][2:]  # Ranks passes --trainer.devices
    ranks = Ranks(config, *strategy, logs=tmp_path)
    wait_for(lambda: logged_steps(tmp_path / "preempted") >= 3, ranks.processes[0], seconds=240)
    for process in ranks.processes if case.stop == "SIGTERM" else ranks.processes[1:]:
        process.send_signal(signal.SIGTERM)
    codes, stderr = ranks.wait(timeout=240), ranks.stderr()
    assert codes == [143, 143], f"exit statuses {codes}:\n{stderr[-3000:]}\n{ranks.stderr(1)[-2000:]}"
    folder = tmp_path / "preempted" / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"], "only the checkpoint, no temporary file"
    meta = folder / "last.ckpt" / "meta.pt" if case.strategy == "fsdp2_sharded" else None
    stopped = torch.load(meta or folder / "last.ckpt", weights_only=True)["global_step"]
    assert 3 <= stopped < TOTAL and stderr.count("SIGTERM: saved") == 1
    assert max(records(tmp_path / "preempted")) == stopped - 1, "records up to the checkpoint, none after"
    resumed = Ranks(config, *strategy, "--ckpt_path", "last", logs=tmp_path)
    assert resumed.wait(timeout=300) == [0, 0], resumed.stderr()[-3000:]
    assert_same_records(records(tmp_path / "preempted"), want, tol=1e-5)


def stop_two_processes_with_kill_9(tmp_path: Path, case: Cell, want: Path) -> None:
    """Both processes killed (the node dies), resumed from the shell, and compared with the single-process run of
    the same config. A run writing one file per checkpoint is killed once the checkpoint at step ``2 * every`` is
    written; one writing folders of shards in the middle of the save of ``last.ckpt`` that follows it, over the
    ``last.ckpt`` of step ``every``, which the resume must then start from."""
    total, every = SCALE_OUT["total"], SCALE_OUT["every"]
    sharded = case.strategy == "fsdp2_sharded"
    # saves 1-4: epoch=0-step=4.ckpt, last.ckpt, epoch=0-step=8.ckpt, then last.ckpt again (top-k first, as Lightning)
    killer = [{"class_path": "test_resume.KillWhileSaving", "init_args": {"save": 4}}] if sharded else []
    config = write_config(tmp_path, "killed", extra_callbacks=killer, **SCALE_OUT)
    args = (*STRATEGIES[case.strategy], *MICRO, "--model.correction", case.rule.upper())
    folder = tmp_path / "killed" / "checkpoints"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        fit_command(config, *args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,  # its own process group: rank 0 and the rank 1 it launches die together
    )  # fmt: skip
    if not sharded:
        wait_for((folder / f"epoch=0-step={2 * every}.ckpt").exists, process)
        os.killpg(process.pid, signal.SIGKILL)
    _, stderr = process.communicate(timeout=400)
    assert process.returncode == -9, f"the run ended before it could be killed:\n{stderr[-3000:]}"
    assert max(records(tmp_path / "killed")) < total - 1, "the kill should interrupt the run"
    resumed = subprocess.run(fit_command(config, *args, "--ckpt_path", "last"), capture_output=True, text=True,
                             timeout=400, env=env)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stderr + resumed.stdout
    assert_reproduces(tmp_path / "killed", want)
    if sharded:
        assert (
            f"--ckpt_path {folder / 'last.ckpt'}: resuming from its step {every}; a later save of it was killed "
            "before it was put in place (.last.ckpt.staging, removed at the next save)"
        ) in resumed.stderr
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("epoch=")) == ["last.ckpt"]

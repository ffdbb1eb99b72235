"""Loggers are flushed before every checkpoint: a run killed right after one has the records of every step it covers.

Lightning's stock ``TensorBoardLogger`` hands records to a writer thread through a queue (and, on a remote file
system, a buffer flushed every two minutes), and a run resumed with ``--ckpt_path last`` starts after the
checkpoint's step, so records still queued when a ``kill -9`` lands would be lost for good. ``RunCheckpoint``
saves every logger before a checkpoint file is written. (The end-to-end form, a ``python -m lit_gmc`` run killed
and resumed, is in ``test_resume.py``'s matrix.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_gmc.checkpoint import AtomicCheckpointIO, RunCheckpoint
from lit_gmc.tblog import read_scalars

KILLED_RUN = """
import os, signal, sys, time
import lightning.pytorch as pl, torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lit_gmc.checkpoint import AtomicCheckpointIO, RunCheckpoint
from tensorboard.summary.writer.record_writer import RecordWriter

root, checkpoint_class, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
write = RecordWriter.write


def slow_write(self, data):
    # A slow disk (or a network file system): the writer thread lags, and records wait in its queue.
    time.sleep(0.25)
    write(self, data)


RecordWriter.write = slow_write


class Learner(pl.LightningModule):
    '''Logs each update's scalars straight to the loggers in training_step, as GMCModule does.'''

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        for logger in self.loggers:
            logger.log_metrics({"train/loss": float(self.global_step)}, step=self.global_step)
        return (self.w - batch).pow(2).sum()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # The module's hook runs after every callback's, ModelCheckpoint's included: the file is there now.
        if self.global_step == kill_at:
            assert os.path.exists(os.path.join(root, "checkpoints", "last.ckpt"))
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(20, 1), batch_size=None)


class Accounting(pl.Callback):
    '''Logs in on_train_batch_end at the update's index, as DelayAccounting does.'''

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for logger in trainer.loggers:
            logger.log_metrics({"delay/mean": 2.0 * (trainer.global_step - 1)}, step=trainer.global_step - 1)


saver = {"RunCheckpoint": RunCheckpoint, "ModelCheckpoint": ModelCheckpoint}[checkpoint_class](
    dirpath=os.path.join(root, "checkpoints"), every_n_train_steps=3, save_last=True, save_top_k=-1)
trainer = pl.Trainer(max_steps=20, max_epochs=1, logger=TensorBoardLogger(root, name="", version=""),
                     callbacks=[saver, Accounting()], enable_progress_bar=False, enable_model_summary=False,
                     plugins=[AtomicCheckpointIO()])
trainer.fit(Learner())
"""


def run_killed_after_a_checkpoint(tmp_path, checkpoint_class: str, kill_at: int = 6) -> subprocess.CompletedProcess:
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(KILLED_RUN))
    command = [sys.executable, str(script), str(tmp_path / "run"), checkpoint_class, str(kill_at)]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_a_kill_9_right_after_a_checkpoint_loses_no_record_of_its_steps(tmp_path):
    done = run_killed_after_a_checkpoint(tmp_path, "RunCheckpoint", kill_at=6)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    scalars = read_scalars(tmp_path / "run")
    assert scalars["train/loss"] == [(s, float(s)) for s in range(6)]  # steps 0..5: what the checkpoint covers
    assert scalars["delay/mean"] == [(s, 2.0 * s) for s in range(6)]


@pytest.mark.slow
def test_without_the_flush_the_stock_logger_loses_them(tmp_path):
    """The control: Lightning's own ModelCheckpoint and the same kill, and records still queued are gone."""
    done = run_killed_after_a_checkpoint(tmp_path, "ModelCheckpoint", kill_at=6)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    try:
        logged = read_scalars(tmp_path / "run").get("train/loss", [])
    except FileNotFoundError:
        logged = []
    assert len(logged) < 6


class RecordingLogger(Logger):
    """Notes each ``save`` (a flush) in a shared event list."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.events.append(f"log {step}")

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def save(self) -> None:
        self.events.append("flush")


class RecordingIO(AtomicCheckpointIO):
    """Notes each checkpoint file written, after it is in place."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.events.append(f"write {os.path.basename(path)}")


class Learner(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        for logger in self.loggers:
            logger.log_metrics({"x": 1.0}, step=self.global_step)
        return (self.w - batch).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(7, 1), batch_size=None)


class SigtermAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler notes it; the update finishes first


def fit_recorded(tmp_path, events: list[str], saver: RunCheckpoint, *callbacks: pl.Callback) -> None:
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=7, max_epochs=1, logger=RecordingLogger(events),
                         callbacks=[saver, *callbacks], enable_progress_bar=False, enable_model_summary=False,
                         plugins=[RecordingIO(events)])  # fmt: skip
    trainer.fit(Learner())


def assert_flushed_before_each_write(events: list[str]) -> None:
    for index, event in enumerate(events):
        if event.startswith("write"):
            assert events[index - 1] == "flush", events[: index + 1]
            last_log = max(i for i in range(index) if events[i].startswith("log"))
            assert last_log < index - 1, f"a record logged after the flush, before {event}: {events[: index + 1]}"


def test_every_save_flushes_the_loggers_first(tmp_path):
    """Periodic saves, ``at_steps`` saves, ``last.ckpt`` and the end-of-run save: a flush right before each file."""
    saver = RunCheckpoint(dirpath=tmp_path, every_n_train_steps=3, at_steps=[2], save_last=True, save_top_k=-1)
    events: list[str] = []
    fit_recorded(tmp_path, events, saver)
    writes = [e for e in events if e.startswith("write")]
    assert writes == ["write epoch=0-step=2.ckpt", "write last.ckpt", "write epoch=0-step=3.ckpt",
                      "write last.ckpt", "write epoch=0-step=6.ckpt", "write last.ckpt", "write last.ckpt"]  # fmt: skip
    assert_flushed_before_each_write(events)
    assert events.index("write epoch=0-step=3.ckpt") > events.index("log 2")  # the step's record came before


def test_the_sigterm_checkpoint_flushes_the_loggers_first(tmp_path):
    saver = RunCheckpoint(dirpath=tmp_path, every_n_train_steps=0, save_last=False, save_top_k=0)
    events: list[str] = []
    with pytest.raises(SIGTERMException):
        fit_recorded(tmp_path, events, saver, SigtermAt(3))
    assert [e for e in events if e.startswith("write")] == ["write last.ckpt"]
    assert_flushed_before_each_write(events)
    assert events.index("write last.ckpt") > events.index("log 3")  # the update SIGTERM let finish

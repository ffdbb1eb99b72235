"""Checkpoint files: atomic replacement, a last.ckpt that holds the end of the run (or the step SIGTERM ended), and
Lightning's warning for a folder in use kept for a run that does not resume."""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_gmc.checkpoint import AtomicCheckpointIO, RunCheckpoint
from lit_gmc.errors import UserError


def test_a_crash_while_saving_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, path)

    def crash_half_way(obj, handle, *args, **kwargs):
        handle.write(b"partial bytes of a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_half_way)
    with pytest.raises(
        UserError, match=rf"checkpoint {path} could not be written \(disk full; [\d.]+ MiB free there\)"
    ):
        io.save_checkpoint({"global_step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == {"global_step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "a temporary file was left behind"


def test_the_bytes_reach_the_disk_before_the_rename(tmp_path, monkeypatch):
    """A rename that lands before the data would leave, after a power cut, a complete name over incomplete bytes."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(source, target):
        events.append(("replace", os.path.basename(source), os.path.basename(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, tmp_path / "last.ckpt")
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"], events
    assert events[0][1] == events[1][1] != "last.ckpt" and events[1][2] == "last.ckpt", events
    assert events[2][1] == tmp_path.name, "the folder is synced after the rename, or a power cut may undo it"


def test_save_replaces_and_creates_folders(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "a" / "b" / "x.ckpt"
    io.save_checkpoint({"v": 1}, path)
    io.save_checkpoint({"v": 2}, path)
    assert io.load_checkpoint(path)["v"] == 2


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.w - batch).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(7, 1), batch_size=None)


def test_last_checkpoint_is_the_end_of_the_run_between_periodic_saves(tmp_path):
    saver = RunCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_last=True, save_top_k=-1)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=7, max_epochs=1, logger=False, callbacks=[saver],
                         enable_progress_bar=False, enable_model_summary=False,
                         plugins=[AtomicCheckpointIO()])  # fmt: skip
    trainer.fit(Tiny())
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [
        "epoch=0-step=3.ckpt",
        "epoch=0-step=6.ckpt",
        "last.ckpt",
    ]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 7


class Interrupt(pl.Callback):
    """At the start of update ``step`` (0-based), send this process SIGTERM, or raise ``error``."""

    def __init__(self, step: int, error: Exception | None = None) -> None:
        self.step, self.error = step, error

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != self.step:
            return
        if self.error is not None:
            raise self.error
        # Lightning's handler only notes the signal; without it this would end the test process.
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        os.kill(os.getpid(), signal.SIGTERM)


def fit_tiny(tmp_path, interrupt: Interrupt, save_last: bool) -> None:
    saver = RunCheckpoint(dirpath=tmp_path, every_n_train_steps=0, save_last=save_last, save_top_k=0)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=7, max_epochs=1, logger=False,
                         callbacks=[saver, interrupt], enable_progress_bar=False, enable_model_summary=False,
                         plugins=[AtomicCheckpointIO()])  # fmt: skip
    trainer.fit(Tiny())


@pytest.mark.parametrize("save_last", [True, False])
def test_sigterm_saves_last_ckpt_once_the_update_in_progress_is_done(tmp_path, save_last):
    with pytest.raises(SIGTERMException):
        fit_tiny(tmp_path, Interrupt(3), save_last)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 4  # update 3 was under way when the signal came: it finished first
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert progress["ready"] == progress["completed"] == 4


def test_other_exceptions_save_nothing(tmp_path):
    """A crash may stop an update half-way: its state is not a checkpoint to resume from."""
    with pytest.raises(RuntimeError, match="crash"):
        fit_tiny(tmp_path, Interrupt(3, RuntimeError("crash")), save_last=True)
    assert list(tmp_path.iterdir()) == []


def test_lightning_s_non_empty_folder_warning_is_kept_for_a_run_that_does_not_resume(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lit_gmc.checkpoint import RunCheckpoint

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "other.ckpt").write_text("")
    trainer = pl.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[RunCheckpoint(dirpath=tmp_path / "ckpt")], default_root_dir=tmp_path)  # fmt: skip
    with pytest.warns(UserWarning, match=f"Checkpoint directory {tmp_path / 'ckpt'} exists and is not empty"):
        trainer.fit(BoringModel())

"""Checkpoint files: atomic replacement, a last.ckpt that holds the end of the run (or the step SIGTERM ended), and
Lightning's warning for a folder in use kept for a run that does not resume."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_gmc.checkpoint import AtomicCheckpointIO, RunCheckpoint
from lit_gmc.errors import UserError
from lit_gmc.resume import check_resume, checkpoint_file, read_checkpoint
from lit_gmc.strategies import FSDP2Strategy


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


def sharded(step: int) -> dict:
    """What Lightning gives a strategy to save, in small: one tensor holding ``step``, and the keys of a lit_gmc
    checkpoint's metadata."""
    keys = {"pytorch-lightning_version": "2.6", "hyper_parameters": {}, "RolloutDataModule": {}}
    return {"state_dict": {"w": torch.full((4,), float(step))}, "optimizer_states": [], "global_step": step, **keys}


def resumed_step(folder) -> int:
    """The step ``--ckpt_path last`` resumes ``folder`` from, its shards checked against its metadata."""
    import torch.distributed.checkpoint as dcp

    path = checkpoint_file("last", str(folder))
    step = read_checkpoint(path)["global_step"]
    state = {"state_dict": {"w": torch.zeros(4)}}
    dcp.load(state, checkpoint_id=path)
    assert torch.equal(state["state_dict"]["w"], torch.full((4,), float(step))), f"{path}: shards of another step"
    return step


class Snapshots:
    """Copies of ``folder`` before and after every file write, rename, fsync and deletion, the deletions inside a
    folder's removal included: what a kill -9 at that moment would leave on disk (a copy once a call is made stands
    for a kill anywhere up to the next call). ``events``: the calls, outermost only, by path under ``folder``."""

    def __init__(self, monkeypatch, folder, out) -> None:
        self.folder, self.out, self.copies, self.events, self.depth = folder, out, [], [], 0
        for module, name in ((os, "rename"), (os, "replace"), (os, "fsync"), (os, "unlink"), (os, "rmdir"),
                             (shutil, "rmtree"), (torch, "save")):  # fmt: skip
            monkeypatch.setattr(module, name, self.recorded(name, getattr(module, name)))

    def recorded(self, name, call):
        def wrapper(*args, **kwargs):
            if name == "save" and not isinstance(args[1], (str, os.PathLike)):
                return call(*args, **kwargs)  # into a buffer (torch.distributed.checkpoint's), not a file
            target = {"fsync": lambda: os.readlink(f"/proc/self/fd/{args[0]}"), "save": lambda: args[1]}
            if self.depth == 0:
                self.events.append((name, os.path.relpath(target.get(name, lambda: args[0])(), self.folder)))
            self.copy()
            self.depth += 1
            try:
                return call(*args, **kwargs)
            finally:
                self.depth -= 1
                self.copy()

        return wrapper

    def copy(self) -> None:
        self.copies.append(self.out / str(len(self.copies)))
        shutil.copytree(self.folder, self.copies[-1], symlinks=True)


def test_a_kill_at_any_moment_of_a_sharded_save_leaves_the_previous_or_the_new_checkpoint(tmp_path, monkeypatch):
    folder, strategy = tmp_path / "checkpoints", FSDP2Strategy(save_distributed_checkpoint=True)
    strategy.save_checkpoint(sharded(4), folder / "last.ckpt")
    snapshots = Snapshots(monkeypatch, folder, tmp_path / "killed")
    strategy.save_checkpoint(sharded(8), folder / "last.ckpt")
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and resumed_step(folder) == 8
    steps, put_back = [], []
    for copy in snapshots.copies:
        with pytest.warns() if not (copy / "last.ckpt").exists() else contextlib.nullcontext() as said:
            steps.append(resumed_step(copy))
        if said is not None:
            put_back.append(copy)
            line = "a save killed while it replaced this checkpoint had set it aside; put it back"
            assert f"{copy / 'last.ckpt'}: {line}" in [str(w.message) for w in said]
            assert resumed_step(copy) == 4, "a second process resuming after the first"
    assert steps == sorted(steps) and steps[0] == 4 and steps[-1] == 8, steps
    assert len(put_back) == 2, "killed between the two renames (both sides of the second one's call)"
    # Against a power cut: the staged folder is on disk before the swap, the swap's renames before the old one goes.
    assert snapshots.events[-7:] == [
        ("save", ".last.ckpt.staging/meta.pt"), ("fsync", ".last.ckpt.staging/meta.pt"),
        ("fsync", ".last.ckpt.staging"), ("rename", "last.ckpt"), ("rename", ".last.ckpt.staging"), ("fsync", "."),
        ("rmtree", ".last.ckpt.previous"),
    ], snapshots.events  # fmt: skip
    assert all(target.startswith(".last.ckpt.staging") for _, target in snapshots.events[:-4]), snapshots.events


def test_a_resume_says_that_it_goes_back_past_a_save_that_was_killed(tmp_path, recwarn):
    folder, strategy = tmp_path / "checkpoints", FSDP2Strategy(save_distributed_checkpoint=True)
    strategy.save_checkpoint(sharded(4), folder / "last.ckpt")
    strategy.save_checkpoint(sharded(8), folder / ".last.ckpt.staging")  # a complete staged save, never put in place
    recwarn.clear()  # torch.distributed.checkpoint's, for a save in a process without a process group
    assert checkpoint_file("last", str(folder)) == folder / "last.ckpt" and not recwarn
    check_resume("last", str(folder), {}, {})
    assert [str(w.message) for w in recwarn] == [
        f"--ckpt_path {folder / 'last.ckpt'}: resuming from its step 4; a later save of it was killed before it was "
        "put in place (.last.ckpt.staging, removed at the next save)"
    ]
    from lightning.pytorch.callbacks import ModelCheckpoint

    assert ModelCheckpoint(dirpath=folder)._find_last_checkpoints(None) == {str(folder / "last.ckpt")}  # Lightning's
    strategy.save_checkpoint(sharded(12), folder / "last.ckpt")
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and resumed_step(folder) == 12


@pytest.mark.parametrize("failing", ["a shard", "meta.pt"])
def test_a_sharded_save_that_fails_leaves_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch, failing):
    folder, strategy = tmp_path / "checkpoints", FSDP2Strategy(save_distributed_checkpoint=True)
    strategy.save_checkpoint(sharded(4), folder / "last.ckpt")
    real_save = torch.save

    def crash_half_way(obj, file, *args, **kwargs):
        named = isinstance(file, (str, os.PathLike))  # meta.pt; torch.distributed.checkpoint writes to its stream
        if named != (failing == "meta.pt"):
            return real_save(obj, file, *args, **kwargs)
        (open(file, "wb") if named else file).write(b"partial bytes of a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_half_way)
    path = folder / "last.ckpt"
    with pytest.raises(UserError, match=rf"checkpoint {path} could not be written \(disk full; [\d.]+ MiB free there"):
        strategy.save_checkpoint(sharded(8), path)
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and resumed_step(folder) == 4


def test_a_kill_while_a_sharded_checkpoint_is_removed_leaves_none_of_it_under_its_name(tmp_path, monkeypatch):
    folder, strategy = tmp_path / "checkpoints", FSDP2Strategy(save_distributed_checkpoint=True)
    strategy.save_checkpoint(sharded(4), folder / "last.ckpt")
    snapshots = Snapshots(monkeypatch, folder, tmp_path / "killed")
    strategy.remove_checkpoint(folder / "last.ckpt")  # as ModelCheckpoint removes one that is no longer kept
    monkeypatch.undo()
    assert list(folder.iterdir()) == []
    for copy in snapshots.copies:
        assert checkpoint_file("last", str(copy)) is None or resumed_step(copy) == 4
    killed = snapshots.copies[len(snapshots.copies) // 2]  # half-way through the deletion
    assert [p.name for p in killed.iterdir()] == [".last.ckpt.removing"]
    strategy.save_checkpoint(sharded(8), killed / "last.ckpt")
    assert sorted(p.name for p in killed.iterdir()) == ["last.ckpt"], "the next save removes what was left"


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

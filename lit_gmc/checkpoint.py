"""Checkpoint writing: atomic files (a crash while saving never leaves a truncated ``last.ckpt``), final saves.

``last.ckpt`` is also written when training ends and when SIGTERM (a preemption) stops it; every logger is flushed
before a checkpoint is written, so the records it covers are on disk when its file appears.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_gmc.distributed import any_rank, note_sigterm, open_rank0_channel, rank_and_world, wait_for_rank0
from lit_gmc.errors import UserError, first_line


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the target folder, fsync it, ``os.replace`` it into place, fsync the folder.

    Lightning's ``TorchCheckpointIO`` writes in place, so a kill mid-save leaves a truncated checkpoint where the
    previous good one was. The rename is an entry of the folder: until the folder is synced, a power cut may undo it.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO does not take storage_options, got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(staging, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(staging, path)
            fsync_path(path.parent)
        except (OSError, RuntimeError) as err:  # torch.save reports a failed write as a RuntimeError
            raise write_error(path, err) from err
        finally:
            staging.unlink(missing_ok=True)


def fsync_path(path: Path) -> None:
    """Flush a file's bytes, or a folder's entries (the names a rename made), to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_error(path: Path, err: BaseException) -> UserError:
    """One line for a checkpoint (a file or a folder of shards) that could not be written, naming its path."""
    free = shutil.disk_usage(path.parent).free if path.parent.is_dir() else None
    cause = first_line(err) if not isinstance(err, OSError) or not err.strerror else err.strerror
    space = f"; {free / 2**20:.1f} MiB free there" if free is not None else ""
    return UserError(
        f"checkpoint {path} could not be written ({cause}{space}); earlier checkpoints are intact (a checkpoint is "
        "written under a temporary name, then renamed): free some space and resume with --ckpt_path last"
    )


# Lightning warns that, under manual optimization, a step checkpoint holds the weights *after* that step's update.
# That is the state we want: a checkpoint at global_step n holds theta_n, the policy version n the engine samples.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization", category=UserWarning)


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also saves at listed steps, writes ``last.ckpt`` when training ends, and on SIGTERM.

    Lightning's own writes ``last.ckpt`` at the end only if it never wrote one, so with ``every_n_train_steps`` the
    final updates of a run would be in no checkpoint; ``at_steps`` gives the paper's checkpoints (200/300/400/800).

    Every logger is flushed before a checkpoint is written: a run resumes after its checkpoint's step, so records
    still queued would be lost for good (checkpoint callbacks run after every other callback).

    On SIGTERM (a preemption) Lightning finishes the update in progress; this callback then writes ``last.ckpt``,
    whatever ``save_last`` says, and ``python -m lit_gmc`` exits with 143. Lightning's own handler broadcasts from
    inside the signal handler, which desynchronises ranks: this one only notes the signal, and all ranks vote after
    every update (:func:`~lit_gmc.distributed.any_rank`), after waiting for a busy rank 0 on the rank-0 channel.

    Args:
        at_steps: Optimizer steps at which to save, besides every ``every_n_train_steps``; ``null``: none.
        **kwargs: ``ModelCheckpoint``'s own arguments (``dirpath``, ``every_n_train_steps``, ``save_last``, ...).
    """

    def __init__(self, *args: Any, at_steps: list[int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.at_steps = frozenset(at_steps or ())
        self.sigterm_noted = False
        self._lightning_sigterm_handler: Any = None
        self._held_warnings: list[str] = []  # Lightning's from setup, shown in on_train_start unless resuming

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning warns here that the folder "exists and is not empty", before it knows whether the run resumes
        # (its checkpoint is read after setup); the warning is held until on_train_start and shown only for a run
        # that did not resume from a checkpoint, since a resumed run's folder holds its own checkpoints.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            super().setup(trainer, pl_module, stage)
        self._held_warnings = []
        for warning in caught:
            if "exists and is not empty" in str(warning.message):  # Lightning's about a folder holding files
                self._held_warnings.append(str(warning.message))
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        open_rank0_channel()  # the DataModule's setup has made it, with its timeout, unless another DataModule is used

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.ckpt_path is None:
            for message in self._held_warnings:
                rank_zero_warn(message)
        self._held_warnings = []
        wait_for_rank0()  # the first publish of the weights (WeightSync), before the first update's collectives
        # Lightning has installed its handler just before training starts and restores the previous one at teardown.
        self.sigterm_noted = False
        installed = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        if rank_and_world()[1] > 1 and callable(installed):
            self._lightning_sigterm_handler = installed
            signal.signal(signal.SIGTERM, self._note_sigterm)

    def _note_sigterm(self, signum: int, frame: Any) -> None:
        self.sigterm_noted = True
        note_sigterm()  # for the waits that end at once (lit_gmc.distributed.sigterm_requested)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        wait_for_rank0()  # an evaluation before the update: the other ranks' next collective is in training_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        if any_rank(self.sigterm_noted) and callable(self._lightning_sigterm_handler):
            # Every rank, here: Lightning's handler (its launcher's kill, its broadcast, trainer.received_sigterm)
            # then makes every rank raise SIGTERMException at the end of this update.
            self._lightning_sigterm_handler(signal.SIGTERM, None)
            self._lightning_sigterm_handler = None
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        step = trainer.global_step
        if step in self.at_steps and self._last_global_step_saved != step and not trainer.sanity_checking:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wait_for_rank0()  # a final evaluation
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning calls this while it builds the checkpoint, before the file is written (its own logger.save()
        # comes only when a run stops). TensorBoardLogger.save is rank-zero only, like the writing of the file.
        for logger in trainer.loggers:
            logger.save()
        super().on_save_checkpoint(trainer, pl_module, checkpoint)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Only SIGTERM: Lightning raises it between two updates. Any other exception may stop an update half-way,
        # and a checkpoint of that state would not resume the run exactly.
        if not isinstance(exception, SIGTERMException) or self.dirpath is None or trainer.global_step == 0:
            return
        if self.save_last and self._last_global_step_saved == trainer.global_step:
            return  # last.ckpt already holds this step
        path = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
        trainer.save_checkpoint(path, weights_only=False)  # the full state, whatever save_weights_only says
        self._last_global_step_saved = trainer.global_step
        rank_zero_info(f"SIGTERM: saved {path} at step {trainer.global_step}; resume with --ckpt_path last")

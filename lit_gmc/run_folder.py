"""A run's folders: one run at a time writes a checkpoint folder, and a resumed run goes on in its logger version.

Checkpoints live in one folder per logger name (so that ``--ckpt_path last`` finds them), while each logger start
opens a new ``version_N``: so a new run into a folder with checkpoints is refused and a running one holds a lock,
and every checkpoint records its logger version, which a resume reopens (else TensorBoard shows a second run).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import TextIO

import lightning.pytorch as pl
from typing_extensions import override

from lit_gmc.errors import UserError

VERSION_KEY = "lit_gmc_logger_version"
SETTINGS_KEY = "lit_gmc_settings"
LOCK_SUFFIX = ".lit_gmc.lock"


def lock_folder(folder: str | Path) -> TextIO:
    """An open lock file beside ``folder`` held by this process; a :class:`UserError` if another process holds it.

    Beside the folder, not in it: Lightning warns about a checkpoint folder that is not empty.
    """
    path = Path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path.parent / f".{path.name}{LOCK_SUFFIX}", "a+", encoding="utf-8")  # noqa: SIM115 - held all run
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UserError(
            f"--checkpoint.dirpath {path}: another run ({holder}) is writing its checkpoints there; give this run its "
            "own folder (--trainer.logger.init_args.name NAME, or --checkpoint.dirpath)"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


class RunFolder(pl.Callback):
    """Holds the checkpoint folder's lock while fitting (global rank 0); records what a resume reads back.

    ``fit`` takes the lock (:meth:`hold`) before the logger writes, so a refused run writes nothing, and one that
    fails before its first update removes its version folder. Every checkpoint gets the logger version and the run's
    settings (:func:`lit_gmc.resume.check_resume`).

    Args:
        checkpoint_dir: The run's checkpoint folder (``None``: no lock).
        settings: ``flag -> value`` of this run (:func:`lit_gmc.resume.run_settings`).
    """

    def __init__(self, checkpoint_dir: str | None, settings: dict) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.settings = settings
        self.lock: TextIO | None = None
        self.created_log_dir: Path | None = None

    def hold(self, trainer: pl.Trainer) -> None:
        """Take the lock on global rank 0 (once), and note the logger's folder if this run creates it."""
        if self.checkpoint_dir is None or not trainer.is_global_zero or self.lock is not None:
            return
        self.lock = lock_folder(self.checkpoint_dir)
        log_dir = getattr(trainer.logger, "log_dir", None)
        self.created_log_dir = Path(log_dir) if log_dir is not None and not Path(log_dir).exists() else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.hold(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.lock is not None:
            self.lock.close()  # releases the lock
            self.lock = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.created_log_dir is not None and trainer.global_step == 0:  # nothing trained: not a run to list
            shutil.rmtree(self.created_log_dir, ignore_errors=True)
        self.teardown(trainer, pl_module, "fit")

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint[VERSION_KEY] = trainer.logger.version if trainer.logger is not None else None
        checkpoint[SETTINGS_KEY] = self.settings


def refuse_earlier_checkpoints(folder: str | None) -> None:
    """A :class:`UserError` when a new run (no ``--ckpt_path``) would write beside another run's checkpoints.

    Lightning would write its ``last.ckpt`` as ``last-v1.ckpt`` beside the other's, and ``--ckpt_path last`` would
    then pick whichever was written last.
    """
    found = sorted(path.name for path in Path(folder).glob("*.ckpt")) if folder is not None else []
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise UserError(
            f"--checkpoint.dirpath {folder} holds another run's checkpoints ({shown}); resume that run with "
            "--ckpt_path last, or give this one its own folder (--trainer.logger.init_args.name NAME), or remove them"
        )


def default_run_name(task_class_path: str, actor: str) -> str:
    """``<task>_<model>``, e.g. ``addition_tiny`` or ``math_Qwen3-4B-Base``: a run folder per task and model."""
    task = task_class_path.rpartition(".")[2].lower()
    model = Path(actor.rstrip("/")).name or actor
    return f"{task}_{model}"

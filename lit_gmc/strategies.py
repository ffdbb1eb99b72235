"""``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` as pure data-parallel FSDP2, under the name ``fsdp2``.

Every process is one data-parallel rank (Lightning's default is tensor parallelism within a node). It writes one
full checkpoint file (atomically, through ``AtomicCheckpointIO``), or with ``save_distributed_checkpoint: true`` a
folder of per-rank shards, staged and swapped (:func:`put_in_place`, :func:`restore_set_aside`) so that a
checkpoint's name always holds a complete folder, the new one or the previous one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch.distributed.checkpoint.api import CheckpointException
from typing_extensions import override

from lit_gmc.checkpoint import fsync_path, write_error

# Hidden names beside a checkpoint ``NAME``: no ``.ckpt`` suffix, so neither Lightning nor ``--ckpt_path last``
# (both match ``last*.ckpt``) nor the check for another run's checkpoints takes them for one.
STAGING, SET_ASIDE, REMOVING = ".staging", ".previous", ".removing"
SHARDED_METADATA = "meta.pt"  # what Lightning's distributed checkpoint holds besides the shards, written last


def beside(path: Path, kind: str) -> Path:
    """``.NAME<kind>`` beside ``path``: where a save stages ``path``, sets the previous one aside, or removes it."""
    return path.with_name(f".{path.name}{kind}")


def remove(path: Path) -> None:
    """Delete a folder, a file or a link, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def put_in_place(staging: Path, path: Path) -> None:
    """Make the complete folder ``staging`` be ``path``; at every step ``path`` or its set-aside copy is complete.

    ``os.replace`` cannot put a folder over a non-empty one, so the previous checkpoint is first renamed aside; a
    kill before the second rename leaves no ``path`` but a complete aside, which :func:`restore_set_aside` puts
    back. The aside is removed only once both renames are on disk.
    """
    aside = beside(path, SET_ASIDE)
    fsync_path(staging)  # the shards' names, before a rename can make them the checkpoint
    if os.path.lexists(path):
        os.rename(path, aside)
    os.rename(staging, path)
    fsync_path(path.parent)
    remove(aside)


def restore_set_aside(folder: Path) -> list[str]:
    """Put back every checkpoint (``*.ckpt``) of ``folder`` left aside by a save killed between two renames.

    The renames are :func:`put_in_place`'s; one that another process of the run made first is not an error.
    Returns what was put back, one line each.
    """
    restored = []
    for aside in sorted(folder.glob(f".*.ckpt{SET_ASIDE}")):
        path = aside.with_name(aside.name[1 : -len(SET_ASIDE)])
        if os.path.lexists(path):
            continue  # both renames were made: the aside is the previous checkpoint, removed at the next save
        try:
            os.rename(aside, path)
        except OSError:
            if not os.path.lexists(path):
                raise
            continue
        fsync_path(folder)
        restored.append(f"{path}: a save killed while it replaced this checkpoint had set it aside; put it back")
    return restored


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all processes (``data_parallel_size`` = world size, no tensor parallelism).

    Args:
        save_distributed_checkpoint: Write a folder of per-rank shards instead of one full file.
        **kwargs: ``ModelParallelStrategy``'s other arguments (``process_group_backend``, ``timeout``).
    """

    def __init__(self, save_distributed_checkpoint: bool = False, **kwargs: Any) -> None:
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint, **kwargs,
        )  # fmt: skip

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # resolved here, once devices are known
        super().setup_environment()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """A folder of shards: Lightning's layout written into a staging folder, then put in place by rank 0.

        Given the target itself, a kill mid-save would leave a mix of new and old files under the checkpoint's name.
        """
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        staging = beside(path, STAGING)
        if self.global_rank == 0:
            restore_set_aside(path.parent)  # as a resume does: an aside is removed only once its checkpoint is back
            for leftover in (staging, beside(path, SET_ASIDE), *path.parent.glob(f".*{REMOVING}")):
                remove(leftover)  # of saves or removals killed part-way
        self.barrier("FSDP2Strategy.save_checkpoint: staging folder cleared")
        try:
            super().save_checkpoint(checkpoint, staging, storage_options)
            if self.global_rank == 0:
                fsync_path(staging / SHARDED_METADATA)  # Lightning's torch.save does not
        except (OSError, RuntimeError, CheckpointException) as err:  # a full disk, most often
            if self.global_rank == 0:
                shutil.rmtree(staging, ignore_errors=True)  # the space it took, which the user now needs
            # torch.distributed.checkpoint raises one exception on every rank for what failed on some
            cause = next(iter(err.failures.values()))[0] if isinstance(err, CheckpointException) else err
            raise write_error(path, cause) from err
        self.barrier("FSDP2Strategy.save_checkpoint: every rank's shards written")
        if self.global_rank == 0:
            put_in_place(staging, path)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """A folder is renamed away before it is deleted, so that a kill never leaves part of it under its name."""
        path = Path(filepath)
        if self.is_global_zero and path.is_dir():
            removing = beside(path, REMOVING)
            remove(removing)
            os.rename(path, removing)
            fsync_path(path.parent)
            remove(removing)
        else:
            super().remove_checkpoint(filepath)


if "fsdp2" not in StrategyRegistry:
    StrategyRegistry.register("fsdp2", FSDP2Strategy, description="FSDP2 over every process (lit_gmc)")

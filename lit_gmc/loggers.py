"""A TensorBoard logger whose step records survive ``kill -9``, written without a queue, a thread or a flush.

The learner and ``DelayAccounting`` hand a step's scalars to the loggers before that step's checkpoint is
written (in ``training_step`` and ``on_train_batch_end``; ``ModelCheckpoint`` runs after every other callback).
TensorBoard's own writer would hold them in a queue served by a background thread, and in a file buffer, for up
to two minutes, so a run killed after the checkpoint and resumed from it (the resumed run starts after that step)
could lose them for good.

This logger's event file is written through: every event (all the scalars of one ``log_metrics`` call, or one
histogram) is framed and handed to the operating system by one unbuffered ``write`` before the call returns.
A killed process has nothing left to lose, so no flush is ever needed: not per step, not at checkpoints, not on a
timer. (The page cache, not the disk, holds the bytes, as after TensorBoard's ``flush``; neither survives a power
loss without an ``fsync``.) Flushing the stock writer after every call, as this logger first did, cost 4-6 ms of CPU
an update on the tiny job, mostly handing each scalar to the writer thread through a 10-slot queue and its
pure-Python checksum; writing through costs under 1 ms (``docs/performance.md``).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

import google_crc32c
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from torch import Tensor
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter
from typing_extensions import override

_FILE_IDS = itertools.count()


def fast_masked_crc32c(data: bytes) -> int:
    """TensorBoard's ``masked_crc32c`` (the TFRecord checksum): CRC-32C by ``google-crc32c``'s C code, then masked.

    TensorBoard's own loops over the bytes in Python, ~0.15 us each: ~1.3 ms for a histogram event of ~9 kB, ~90 us
    for an event of 25 scalars (~600 bytes). The mask rotates the CRC right by 15 bits and adds a constant, as
    TFRecord files store it.
    """
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class WriteThroughEventFile:
    """A TensorBoard event file (TFRecord framing, as ``RecordWriter``) written one event per ``os.write``.

    The interface ``torch.utils.tensorboard.writer.FileWriter`` uses: ``add_event``, ``flush``, ``close``,
    ``reopen``, ``get_logdir``. The file is named as TensorBoard names its own.
    """

    def __init__(self, logdir: str, filename_suffix: str = "") -> None:
        os.makedirs(logdir, exist_ok=True)
        self._logdir = logdir
        self._lock = threading.Lock()
        while True:  # a new file, never one another writer of this process made in the same second
            name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_IDS)}"
            self.path = os.path.join(logdir, name + filename_suffix)
            try:
                self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                break
            except FileExistsError:
                continue
        self.add_event(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def get_logdir(self) -> str:
        """The folder of the event file."""
        return self._logdir

    def add_event(self, event: Event) -> None:
        """Frame ``event`` (length, masked CRC-32C of the length, data, masked CRC-32C of the data) and write it."""
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        crcs = struct.pack("<I", fast_masked_crc32c(header)), struct.pack("<I", fast_masked_crc32c(data))
        record = memoryview(header + crcs[0] + data + crcs[1])
        with self._lock:
            if self._fd is None:
                raise ValueError(f"event file {self.path} is closed")
            while record:  # a regular file takes it all at once; a short write would otherwise drop bytes
                record = record[os.write(self._fd, record) :]

    def flush(self) -> None:
        """Nothing to do: every event is in the operating system's hands when ``add_event`` returns."""

    def close(self) -> None:
        """Close the file; idempotent."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def reopen(self) -> None:
        """Append to the same file again after :meth:`close`."""
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)


class WriteThroughFileWriter(FileWriter):
    """torch's ``FileWriter`` (summaries, graphs, steps and wall times) on a :class:`WriteThroughEventFile`."""

    def __init__(self, log_dir: str, filename_suffix: str = "") -> None:  # no super(): it would start a thread
        self.event_writer = WriteThroughEventFile(str(log_dir), filename_suffix)


class WriteThroughSummaryWriter(SummaryWriter):
    """``SummaryWriter`` (same arguments; ``max_queue`` and ``flush_secs`` are moot) writing through to its file.

    Also adds :meth:`add_scalar_dict`, several scalars in one event, and keeps the default histogram bins as an
    array, which spares ``numpy.histogram`` converting 1,500 floats on every call (same bins, same histogram).
    ``add_scalars`` still writes its per-tag sub-folders through torch's buffered writers.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.default_bins = np.asarray(self.default_bins, dtype=np.float64)

    @override
    def _get_file_writer(self) -> FileWriter:
        if self.all_writers is None or self.file_writer is None:
            self.file_writer = WriteThroughFileWriter(self.log_dir, self.filename_suffix)
            self.all_writers = {self.file_writer.get_logdir(): self.file_writer}
            if self.purge_step is not None:  # as SummaryWriter does: TensorBoard drops the later steps of older files
                self.file_writer.add_event(Event(step=self.purge_step, file_version="brain.Event:2"))
                self.file_writer.add_event(Event(step=self.purge_step, session_log=SessionLog(status=SessionLog.START)))
                self.purge_step = None
        return self.file_writer

    def add_scalar_dict(self, scalars: Mapping[str, float], global_step: int | None = None) -> None:
        """Write ``tag -> value`` as one event of float32 scalars (what ``add_scalar`` writes, one per event).

        The values are added to the event in place: building them apart and wrapping them in a ``Summary`` then
        an ``Event``, as ``FileWriter.add_summary`` does, copies every value twice (a third of the call's time).
        """
        event = Event()
        add = event.summary.value.add
        for tag, value in scalars.items():
            add(tag=tag, simple_value=value)
        self._get_file_writer().add_event(event, global_step)  # stamps the wall time and the step


class DurableTensorBoardLogger(TensorBoardLogger):
    """``TensorBoardLogger`` whose records are on disk (in the page cache) when each logging call returns.

    Same arguments. The experiment is a :class:`WriteThroughSummaryWriter`; ``log_metrics`` writes the scalars of
    one call as one event. Scalars read back as with ``TensorBoardLogger``: same tags, steps and float32 values.
    A remote ``save_dir`` (``s3://...``), which ``os.write`` cannot reach, gets TensorBoard's own writer, flushed
    after every ``log_metrics`` call.
    """

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> SummaryWriter:
        if self._experiment is None:
            if self.root_dir:
                self._fs.makedirs(self.root_dir, exist_ok=True)
            writer = SummaryWriter if "://" in str(self.log_dir) else WriteThroughSummaryWriter
            self._experiment = writer(log_dir=self.log_dir, **self._kwargs)
        return self._experiment

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not isinstance(self.experiment, WriteThroughSummaryWriter):
            super().log_metrics(metrics, step)
            self.experiment.flush()
            return
        prefix = f"{self._prefix}{self.LOGGER_JOIN_CHAR}" if self._prefix else ""
        scalars, groups = {}, {}
        for key, value in metrics.items():
            value = value.item() if isinstance(value, Tensor) else value
            if isinstance(value, Mapping):
                groups[prefix + key] = value
                continue
            try:
                scalars[prefix + key] = float(value)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{key}: cannot log {value!r}; log a number, a one-element tensor or a dict") from err
        if scalars:
            self.experiment.add_scalar_dict(scalars, step)
        for key, values in groups.items():
            self.experiment.add_scalars(key, dict(values), step)
        if groups:
            self.experiment.flush()  # add_scalars' sub-folder writers are torch's buffered ones

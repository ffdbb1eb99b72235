"""``DurableTensorBoardLogger``: every record is in the operating system's hands when the logging call returns.

The flush policy is "nothing to flush": events are written through, one ``os.write`` each, with no queue, writer
thread or file buffer. So a process killed with SIGKILL right after a ``log_metrics`` call (or a histogram) has
already written it, and no flush is needed at checkpoints or on a timer. What it writes reads back exactly as
Lightning's ``TensorBoardLogger`` output does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from torch.utils.tensorboard import SummaryWriter

from lit_gmc.loggers import DurableTensorBoardLogger, WriteThroughSummaryWriter, fast_masked_crc32c
from lit_gmc.tblog import read_scalars

METRICS = [{"train/loss": 0.25 * s, "train/reward": torch.tensor(s / 7), "schedule/batch_id": s} for s in range(6)]


def event_files(path) -> list:
    return sorted(path.rglob("events.out.tfevents.*"))


def scalars_by_folder(root) -> dict:
    """``folder -> tag -> [(step, value)]``, each event file read on its own.

    ``add_scalars`` writes one sub-folder per key, all under the same tag, so merging folders (as ``read_scalars``
    does for a resumed run) would pick one of them by file time: compare folder by folder instead.
    """
    folders = {}
    for path in event_files(root):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        folders[str(path.parent.relative_to(root))] = {
            tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]
        }
    return folders


def test_records_survive_sigkill_without_any_flush(tmp_path):
    """The child logs scalars and a histogram, then kills itself: no flush, no close, no exit handlers."""
    child = textwrap.dedent(f"""
        import os, signal, torch
        from lit_gmc.loggers import DurableTensorBoardLogger
        logger = DurableTensorBoardLogger({str(tmp_path)!r}, name="killed")
        for step in range(5):
            logger.log_metrics({{"train/loss": step / 4, "delay/mean": float(step)}}, step=step)
        logger.experiment.add_histogram("delay/histogram", torch.arange(8.0), global_step=4)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    scalars = read_scalars(tmp_path / "killed")
    assert scalars["train/loss"] == [(s, s / 4) for s in range(5)]
    assert scalars["delay/mean"] == [(s, float(s)) for s in range(5)]
    (path,) = event_files(tmp_path / "killed")
    accumulator = EventAccumulator(str(path))
    accumulator.Reload()
    (histogram,) = accumulator.Histograms("delay/histogram")
    assert (histogram.step, histogram.histogram_value.num, histogram.histogram_value.sum) == (4, 8, 28.0)


def test_each_call_is_written_before_it_returns_and_no_thread_is_started(tmp_path):
    threads = threading.active_count()
    logger = DurableTensorBoardLogger(tmp_path, name="run")
    assert logger.experiment is not None  # the event file is created with the experiment, on first use
    (path,) = event_files(tmp_path)
    for step, metrics in enumerate(METRICS):
        size = path.stat().st_size
        logger.log_metrics(metrics, step=step)
        assert path.stat().st_size > size  # on the file already: nothing waits in a queue or a buffer
        assert len(read_scalars(tmp_path)["train/loss"]) == step + 1
    assert threading.active_count() == threads  # no writer thread
    logger.finalize("success")


def test_reads_back_as_tensorboard_logger_writes(tmp_path):
    """Same tags (prefix included), steps and float32 values as the stock logger, dict values and hparams too."""
    for cls, name in ((TensorBoardLogger, "stock"), (DurableTensorBoardLogger, "durable")):
        logger = cls(tmp_path, name=name, prefix="p")
        logger.log_hyperparams({"lr": 0.1})
        for step, metrics in enumerate(METRICS):
            logger.log_metrics(metrics, step=step)
        logger.log_metrics({"pair": {"a": 1.0, "b": 2.0}}, step=9)
        logger.finalize("success")
    durable, stock = scalars_by_folder(tmp_path / "durable"), scalars_by_folder(tmp_path / "stock")
    assert durable == stock
    assert durable["version_0"]["p-train/loss"] == [(s, 0.25 * s) for s in range(6)]
    assert durable["version_0/p-pair_b"]["p-pair"] == [(9, 2.0)]


def test_histograms_are_the_stock_writers(tmp_path):
    values = torch.randn(200, generator=torch.Generator().manual_seed(0)) * 3
    for cls, name in ((SummaryWriter, "stock"), (WriteThroughSummaryWriter, "through")):
        writer = cls(str(tmp_path / name))
        writer.add_histogram("h", values, 3)
        writer.close()
    read = []
    for name in ("stock", "through"):
        accumulator = EventAccumulator(str(tmp_path / name))
        accumulator.Reload()
        read.append(accumulator.Histograms("h")[0].histogram_value)
    assert read[0] == read[1]


def test_logging_after_finalize_opens_a_new_file(tmp_path):
    logger = DurableTensorBoardLogger(tmp_path, name="run")
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize("success")
    logger.log_metrics({"x": 2.0}, step=1)  # e.g. a second fit with the same logger
    assert len(event_files(tmp_path)) == 2
    assert read_scalars(tmp_path)["x"] == [(0, 1.0), (1, 2.0)]
    assert all(os.path.getsize(path) > 0 for path in event_files(tmp_path))


def test_fast_crc_is_tensorboards():
    """The C checksum, masked, equals TensorBoard's byte loop (TFRecord's masked CRC-32C) at every length tried."""
    gen = torch.Generator().manual_seed(0)
    for length in [*range(0, 80), 1023, 1024, 1025, 1027, 2048, 2051, 4100, 9000]:
        data = torch.randint(0, 256, (length,), generator=gen, dtype=torch.uint8).numpy().tobytes()
        assert fast_masked_crc32c(data) == masked_crc32c(data), length

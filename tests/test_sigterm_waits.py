"""SIGTERM stops a run within seconds wherever it waits, and saves what a preemption between updates saves.

Two learner processes (DDP, gloo), started as torchrun starts them, on the shipped ``configs/tiny.yaml``: after update
``HANG_AFTER`` rank 0's reward hangs (:func:`hangs`), so rank 0 waits in the reward and rank 1 waits for its share in
the rank-0 channel's collective. SIGTERM to rank 0 (the reward's wait) or to rank 1 (the collective's; both at once
between two updates is a cell of tests/test_resume.py's matrix): every rank exits with 143 within seconds, ``last.ckpt``
holds the last whole update and ``--ckpt_path last`` gives the records of an unbroken run. The time from the signal
to the last rank's exit is printed (``-s``).

The helpers and time limits here are also used by ``tests/test_vllm_serve.py`` (a sync to a stopped server).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from run_helpers import Ranks, assert_same_records, component, digit_fraction, fit, records, write_config

TOTAL, HANG_AFTER = 6, 3
OPTIONS = {"schedule": component("FixedDelay", delay=2), "reward": "test_sigterm_waits.hangs"}
HANG: dict[str, str | None] = {"marker": None}  # a path: the next reward call writes it, then never returns
# From the signal to last.ckpt on disk (measured 0.3 s here), and to the last process's exit, which adds Lightning's
# teardown and the interpreter's (6-20 s measured on 2 cores shared at load 9-16).
SAVED_WITHIN_S, EXITED_WITHIN_S = 10.0, 90.0


def hangs(completions: list[str], answer: str) -> list[float]:
    """``--data.reward test_sigterm_waits.hangs``: :func:`~run_helpers.digit_fraction`, except once
    :class:`HangAfter` has armed it: then it writes the marker file and never returns (a stuck verifier)."""
    marker = HANG["marker"]
    if marker is not None:
        HANG["marker"] = None
        Path(marker).write_text(str(time.time()))
        threading.Event().wait()
    return digit_fraction(completions, answer)


class HangAfter(pl.Callback):
    """Arms :func:`hangs` once update ``step`` has ended (global rank 0 scores): the next generation hangs."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            HANG["marker"] = self.marker


def wait_for_file(path: Path, processes, timeout: float) -> None:
    """Until ``path`` exists; fails if a process ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert all(p.poll() is None for p in processes), "a process ended before the wait began"
        assert time.monotonic() < deadline, f"{path} not written within {timeout} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    root = tmp_path_factory.mktemp("unbroken")
    fit(write_config(root, "unbroken", total=TOTAL, batch_prompts=4, **OPTIONS))
    return records(root / "unbroken")


@pytest.mark.slow
# SIGTERM to rank 1 covers both waits (rank 1's collective, and rank 0's reward, which sees the signal rank 1
# records in the store); to rank 0 alone is `extended`, for CI's time.
@pytest.mark.parametrize("signalled", [pytest.param("rank 0", marks=pytest.mark.extended), "rank 1"])
def test_sigterm_while_rank0_waits_in_a_reward_and_rank1_in_a_collective_stops_both_and_resumes_exactly(
    tmp_path, unbroken, signalled
):
    marker = tmp_path / "hanging"
    hang = component("test_sigterm_waits.HangAfter", step=HANG_AFTER, marker=str(marker))
    config = write_config(tmp_path, "preempted", total=TOTAL, batch_prompts=4, extra_callbacks=[hang], **OPTIONS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    ranks = Ranks(config, "--trainer.strategy", "ddp", logs=tmp_path, env=env)
    try:
        wait_for_file(marker, ranks.processes, timeout=300)
        time.sleep(1.0)  # both ranks well inside their waits
        signalled_at, started = time.time(), time.monotonic()
        ranks.processes[int(signalled[-1])].send_signal(signal.SIGTERM)
        codes = ranks.wait(timeout=120)
        took = time.monotonic() - started
    finally:
        for process in ranks.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert codes == [143, 143], f"{codes}:\n{ranks.stderr()[-3000:]}\n{ranks.stderr(1)[-2000:]}"
    folder = tmp_path / "preempted" / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"]
    saved = (folder / "last.ckpt").stat().st_mtime - signalled_at
    print(f"SIGTERM to {signalled}, rank 0 in a hung reward, rank 1 in a collective: last.ckpt saved {saved:.2f} s "
          f"after it, every rank exited after {took:.2f} s")  # fmt: skip
    assert saved < SAVED_WITHIN_S and took < EXITED_WITHIN_S, (saved, took)
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == HANG_AFTER
    assert ranks.stderr().count("SIGTERM: saved") == 1
    assert max(records(tmp_path / "preempted")) == HANG_AFTER - 1, "records up to the checkpoint, none after"

    resumed = Ranks(config, "--trainer.strategy", "ddp", "--ckpt_path", "last", logs=tmp_path, env=env)
    try:
        assert resumed.wait(timeout=300) == [0, 0], resumed.stderr()[-3000:]
    finally:
        for process in resumed.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert_same_records(records(tmp_path / "preempted"), unbroken, tol=1e-5)


def raises(completions: list[str], answer: str) -> list[float]:
    """``--data.reward test_sigterm_waits.raises``: a plug-in reward with a bug (rank 0 alone scores)."""
    raise ZeroDivisionError("division by zero")


@pytest.mark.slow
def test_a_user_error_on_rank0_while_rank1_waits_ends_every_rank_in_its_one_line(tmp_path):
    """Rank 0 fails where rank 1 waits for its share (a reward that raises; every vLLM server lost is the same path):
    both ranks exit with status 2 and the same ``lit_gmc: error:`` line, not in gloo's "Connection closed by peer"."""
    config = write_config(tmp_path, "raises", total=2, batch_prompts=4, reward="test_sigterm_waits.raises")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    ranks = Ranks(config, "--trainer.strategy", "ddp", logs=tmp_path, env=env)
    try:
        codes = ranks.wait(timeout=300)
    finally:
        for process in ranks.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    last_lines = [ranks.stderr(rank).strip().splitlines()[-1] for rank in (0, 1)]
    assert codes == [2, 2], f"{codes}:\n{ranks.stderr()[-3000:]}\n{ranks.stderr(1)[-2000:]}"
    assert last_lines[0] == last_lines[1], last_lines
    assert last_lines[0].startswith("lit_gmc: error: reward --data.reward test_sigterm_waits.raises raised "
                                    "ZeroDivisionError"), last_lines[0]  # fmt: skip
    for rank in (0, 1):
        assert ranks.stderr(rank).count("lit_gmc: error:") == 1 and "Traceback" not in ranks.stderr(rank)

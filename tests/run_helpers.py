"""Small end-to-end runs of ``python -m lit_gmc fit`` on the tiny actor, in-process or in a subprocess.

Each run is the shipped ``configs/tiny.yaml``, as a user passes it (``--config configs/tiny.yaml``), then a small
YAML of overrides of its own (sizes, TensorBoard and checkpoint folders, callbacks appended to the shipped list with
``callbacks+``), then command-line overrides. So the shipped callbacks (``Samples`` and ``Diagnostics`` included) run
in every run test, on every rank. Runs are read back as per-step records: what was consumed (batch id, launch
version) and what it gave (rewards, loss).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lit_gmc.cli import GMCCLI
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.data.engines.hf import HFEngine
from lit_gmc.data.schedules.base import FixedDelay
from lit_gmc.data.tasks.addition import Addition
from lit_gmc.errors import UserError
from lit_gmc.tblog import read_scalars

TINY_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
RECORD_TAGS = ("schedule/batch_id", "schedule/launch_version", "train/reward", "train/loss")


SCHEDULES = {
    "Sync": "lit_gmc.data.schedules.base.Sync",
    "FixedDelay": "lit_gmc.data.schedules.base.FixedDelay",
    "VirtualClock": "lit_gmc.data.schedules.virtual_clock.VirtualClock",
    "Live": "lit_gmc.data.schedules.live.Live",
}


def tiny_data(delay: int = 8, engine: HFEngine | None = None, **kwargs: Any) -> RolloutDataModule:
    """The embedded default's data side (addition, ``engine`` or an HF engine, ``FixedDelay(delay)``) for direct
    Trainer tests."""
    return RolloutDataModule(Addition(), engine or HFEngine(), FixedDelay(delay), **kwargs)


def component(class_path: str, **init_args: Any) -> dict[str, Any]:
    """A ``class_path`` + ``init_args`` entry; short schedule names expand to their paths."""
    return {"class_path": SCHEDULES.get(class_path, class_path), "init_args": init_args}


def write_config(
    tmp_path: Path,
    name: str,
    *,
    total: int,
    every: int | None = None,
    extra_callbacks: list[dict] | None = None,
    schedule: dict[str, Any] | None = None,
    **data: Any,
) -> Path:
    """Overrides of ``configs/tiny.yaml`` for a small run named ``name``, logged and checkpointed under
    ``tmp_path / name`` (:func:`fit` and :func:`fit_command` pass the shipped file first, then this one).

    ``every``: checkpoint period (None: no checkpoints); ``extra_callbacks``: appended to the shipped callbacks;
    ``schedule``: a :func:`component` (None: the shipped one).
    """
    checkpoint = (
        {"every_n_train_steps": every, "save_last": True, "save_top_k": -1}
        if every is not None
        else {"every_n_train_steps": 0, "save_last": False, "save_top_k": 0}
    )
    config = {
        "trainer": {
            "max_steps": total,
            "enable_progress_bar": False,
            # checkpoints follow the logger: tmp_path / name / checkpoints
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(tmp_path), "name": name}},
            "callbacks+": extra_callbacks or [],
        },
        "checkpoint": checkpoint,
        "data": {"batch_prompts": 2, "group_size": 4, "max_new_tokens": 4, **data,
                 **({"schedule": schedule} if schedule is not None else {})},
    }  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def fit(config: Path, *args: str, callbacks: list | None = None) -> GMCCLI:
    """``lit_gmc fit --config configs/tiny.yaml --config config *args`` in this process; ``callbacks`` are added to
    the config's."""
    defaults = {"callbacks": callbacks} if callbacks else {}
    return GMCCLI(args=["fit", *config_args(config), *args], trainer_defaults=defaults)


def config_args(config: Path) -> list[str]:
    """The shipped ``configs/tiny.yaml``, then the run's overrides ``config``."""
    return ["--config", str(TINY_CONFIG), "--config", str(config)]


def fit_command(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "lit_gmc", "fit", *config_args(config), *args]


def run_subprocess(config: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(fit_command(config, *args), capture_output=True, text=True, timeout=timeout, env=os.environ)
    return done


def records(run_dir: Path) -> dict[int, dict[str, float]]:
    """``step -> {tag: value}`` for :data:`RECORD_TAGS` (and every ``schedule/`` and ``delay/`` tag)."""
    scalars = read_scalars(run_dir)
    out: dict[int, dict[str, float]] = {}
    for tag, points in scalars.items():
        if tag in RECORD_TAGS or tag.startswith(("schedule/", "delay/")):
            for step, value in points:
                out.setdefault(step, {})[tag] = value
    return out


# The scale-out runs (two processes against one, ``tests/test_scale_out.py``, and their kill -9 resume cells in
# ``tests/test_resume.py``): :func:`write_config` options and the micro-batching, one group per backward pass, so
# that DDP skips the all-reduce of all but the last micro-batch.
SCALE_OUT = {"total": 20, "every": 4, "batch_prompts": 4}
MICRO = ("--model.micro_batch_groups", "1")
EXACT = ("schedule/batch_id", "schedule/launch_version", "train/reward", "delay/mean", "delay/max")
CLOSE = ("train/loss", "train/grad_norm", "diag/ess/mean", "gac/cosine")


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    return {tag: dict(points) for tag, points in read_scalars(run_dir).items()}


def assert_reproduces(got: Path, want: Path, tol: float = 1e-5) -> None:
    """A scale-out run's :data:`EXACT` tags equal the single-process run's, its :data:`CLOSE` tags to ``tol``
    (relative above 1): losses and gradient norms differ by floating-point reduction order only."""
    got_scalars, want_scalars = scalars(got), scalars(want)
    assert sorted(want_scalars["train/reward"]) == list(range(SCALE_OUT["total"]))
    for tag in EXACT:
        assert got_scalars[tag] == want_scalars[tag], f"{tag} differs"
    for tag in CLOSE:
        if tag not in want_scalars:
            continue
        assert sorted(got_scalars[tag]) == sorted(want_scalars[tag]), f"{tag}: steps differ"
        for step, value in want_scalars[tag].items():
            assert abs(got_scalars[tag][step] - value) <= tol * max(1.0, abs(value)), f"{tag} step {step}"


def assert_same_records(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], tol: float = 1e-6) -> None:
    """Same steps, same tags, and every value equal to ``tol`` (ids and versions exactly)."""
    assert sorted(got) == sorted(want), f"steps differ: {sorted(got)} vs {sorted(want)}"
    for step in sorted(want):
        assert sorted(got[step]) == sorted(want[step]), f"step {step}: tags differ"
        for tag, value in want[step].items():
            limit = 0.0 if tag in ("schedule/batch_id", "schedule/launch_version") else tol
            assert abs(got[step][tag] - value) <= limit, f"step {step} {tag}: {got[step][tag]} != {value}"


class Ranks:
    """``world`` processes of ``lit_gmc fit``, started as torchrun starts them: each its own process, rank from the
    environment, all clients of a rendezvous store this process hosts (so no rank waits for another to host it).

    stderr of rank ``r`` goes to ``logs / f"rank{r}.err"`` (appended).
    """

    def __init__(self, config: Path, *args: str, logs: Path, world: int = 2, env: dict[str, str] | None = None):
        from torch.distributed import TCPStore

        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # kept alive with the ranks
        self.logs, self.processes = logs, []
        for rank in range(world):
            rank_env = {**(env or os.environ), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                        "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                        "LOCAL_WORLD_SIZE": str(world), "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
            with open(logs / f"rank{rank}.err", "a") as err:
                command = fit_command(config, "--trainer.devices", str(world), *args)
                self.processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=rank_env))

    def wait(self, timeout: float) -> list[int]:
        """Every rank's exit status."""
        return [process.wait(timeout=timeout) for process in self.processes]

    def stderr(self, rank: int = 0) -> str:
        return (self.logs / f"rank{rank}.err").read_text()


class KillProcessAt(pl.Callback):
    """SIGKILL the process ``pid`` (e.g. a ``vllm serve``) once update ``step`` is done, as when it crashes.

    At the end of the update, after the callbacks listed before it (``WeightSync``'s sync included), so the process
    dies between a sync and the next rollouts, or during them."""

    def __init__(self, step: int, pid: int) -> None:
        self.step, self.pid = step, pid

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(self.pid, signal.SIGKILL)


class SignalServerInSync(pl.Callback):
    """Global rank 0 sends ``sig`` (a signal number) to a ``vllm serve`` in the middle of the weight sync to version
    ``step``, once the sink has taken ``after`` tensors, then writes ``marker``: SIGSTOP for a server that stops
    answering, SIGKILL for one lost. ``pid``: the server's (``None``: the one the engine launched); ``group``: its
    whole process group (the server, its engine core and worker, as when its node goes), else its API process alone
    (as when it crashes).

    It wraps the sink of the ``WeightSync`` listed before it (the shipped one), so the sync is the real one."""

    def __init__(self, step: int, sig: int, marker: str, pid: int | None = None, group: bool = True,
                 after: int = 2) -> None:  # fmt: skip
        self.step, self.sig, self.marker, self.pid, self.group, self.after = step, sig, marker, pid, group, after

    def setup(self, trainer, pl_module, stage):
        from lit_gmc.callbacks.weight_sync import WeightSync

        sync = next(callback for callback in trainer.callbacks if isinstance(callback, WeightSync))
        inner, signal_in = sync.sink, self.signal_in

        class Signalling:
            def load_weights(self, named_tensors, version):
                return inner.load_weights(signal_in(named_tensors, version, trainer), version)

        sync.sink = Signalling()

    def signal_in(self, named_tensors, version, trainer):
        for taken, item in enumerate(named_tensors):
            if version == self.step and taken == self.after and not Path(self.marker).exists():
                pid = self.pid if self.pid is not None else trainer.datamodule.rollout_engine.processes[0].pid
                (os.killpg if self.group else os.kill)(pid, self.sig)
                Path(self.marker).write_text(str(pid))
            yield item


class WaitForServer(pl.Callback):
    """Global rank 0 waits, once update ``step`` has ended, until the server at ``url`` answers ``/health`` (one the
    test starts again), so that the next sync finds it."""

    def __init__(self, step: int, url: str, timeout: float = 400) -> None:
        self.step, self.url, self.timeout = step, url, timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import requests

        if trainer.global_step != self.step or trainer.global_rank != 0:
            return
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/health", timeout=5).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.url} did not answer within {self.timeout} s")


class ServedWeights(pl.Callback):
    """After each weight sync (list it after ``WeightSync``), global rank 0 appends one JSON line to ``out``: the
    step, the time, each sampling server's URL, weight version and vLLM checksums (``/weight_checker``, by parameter
    name), and the sha256 of each of the learner's policy parameters (``actor.`` stripped, as ``WeightSync`` sends
    them). A sync that a SIGTERM interrupted (the engine is not at the step's version) writes nothing."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        self.record(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.record(trainer, pl_module)

    def record(self, trainer, pl_module) -> None:
        import requests

        engine = trainer.datamodule.rollout_engine if trainer.global_rank == 0 else None
        if engine is None or engine.version != trainer.global_step:
            return
        servers = []
        for url in engine.live:
            version = requests.get(f"{url}/weight_info", timeout=60).json()["weight_version"]
            servers.append({"url": url, "version": version, "checksums": server_checksums(url)})
        learner = {name.removeprefix("actor."): sha256(p) for name, p in pl_module.named_parameters()
                   if name.startswith("actor.")}  # fmt: skip
        with open(self.out, "a") as handle:
            handle.write(json.dumps({"step": trainer.global_step, "time": time.time(), "servers": servers,
                                     "learner": learner}) + "\n")  # fmt: skip


def server_checksums(url: str) -> dict[str, str]:
    """vLLM's per-parameter sha256 of one server's weights (``/weight_checker``), by vLLM parameter name."""
    import requests

    answer = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60).json()["checksums"]
    return {key.split(":")[-1]: digest for key, digest in answer.items()}  # drop the dp/pp/tp prefix


def sha256(tensor: torch.Tensor) -> str:
    """The sha256 of a CPU tensor's bytes (what vLLM's ``/weight_checker`` computes for a parameter)."""
    return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def digit_fraction(completions: list[str], answer: str) -> list[float]:
    """``--data.reward run_helpers.digit_fraction``: the fraction of digits in each completion. The tiny random actor
    never answers an addition right, so the task's own reward is 0 everywhere and no update changes a weight; this
    one differs within a group whatever the model, so every update trains."""
    return [sum(char.isdigit() for char in text) / max(len(text), 1) for text in completions]


def main_stderr(monkeypatch, *argv: str) -> str:
    """What ``lit_gmc`` prints on stderr for ``argv``, run in this process, once it has exited with status 2 (a user's
    error; a bug raises here instead, with its traceback). One process start less than ``python -m lit_gmc``, whose
    own status and stderr ``tests/test_cli.py`` checks."""
    import io

    import pytest

    from lit_gmc.__main__ import main

    monkeypatch.setattr("sys.argv", ["lit_gmc", *argv])
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 2 and "Traceback" not in stderr.getvalue(), stderr.getvalue()[-3000:]
    return stderr.getvalue()


def main_error_line(monkeypatch, *argv: str) -> str:
    """The last line of :func:`main_stderr`."""
    return main_stderr(monkeypatch, *argv).strip().splitlines()[-1]


class ParseOnly(GMCCLI):
    def instantiate_classes(self) -> None:
        pass

    def _run_subcommand(self, subcommand: str) -> None:
        pass


def parse_problems(*args: str) -> str:
    with pytest.raises(UserError) as caught:
        ParseOnly(args=["fit", *args])
    return str(caught.value)

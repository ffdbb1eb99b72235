"""An ``HFEngine`` in a process of its own, so that generation and learning run at the same time.

In one process, a background generation thread and the learner share the interpreter lock, and the tiny job's
many small kernels hold it most of the time: the ``Live`` and overlapped ``VirtualClock`` schedules then gain
little from overlapping. Here the engine runs in a spawned process; the learner's process only waits on a pipe
while it generates.

Weights are shared, not sent: the engine process moves its model's parameters into shared memory and hands them
to this process, which writes published weights into them in place (no copy per update, no second model here).
A write and a generation never overlap: both happen under one lock, and a generation is a request answered
before the lock is released. Versions are stamped here, under that lock, so each batch carries the version of
the weights it was generated with. Results travel back through the pipe, their tensors through shared memory.

Written on ``torch.multiprocessing`` (spawn) rather than a serving framework: an engine here is a single
object with two calls, and the tensors it exchanges are what torch's shared-memory pickling already moves.
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from torch import Tensor

from lit_gmc.batch import RolloutGroup
from lit_gmc.data.tasks import Prompt


def copy_weights(parameters: dict[str, Tensor], named_tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy each named tensor into ``parameters[name]`` in place, cast to its dtype and device."""
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in parameters:
                raise KeyError(f"load_weights: unknown parameter {name!r}")
            parameters[name].copy_(tensor)  # copy_ casts to the target's dtype and device itself


def as_arrays(group: RolloutGroup) -> RolloutGroup:
    """``group`` with numpy arrays for its tensors, which pickle inline.

    Torch would put every small tensor in a shared-memory file of its own, slower than sending the bytes.
    """
    return dataclasses.replace(group, **{
        field.name: value.numpy() for field in dataclasses.fields(group)
        if isinstance(value := getattr(group, field.name), Tensor)
    })  # fmt: skip


def as_tensors(group: RolloutGroup) -> RolloutGroup:
    """The inverse of :func:`as_arrays`."""
    return dataclasses.replace(group, **{
        field.name: torch.from_numpy(value) for field in dataclasses.fields(group)
        if isinstance(value := getattr(group, field.name), np.ndarray)
    })  # fmt: skip


def _serve(connection, actor: str, batch_rows: int, threads: int | None) -> None:
    """The engine process: load ``actor``, share its parameters, then answer ``generate`` calls until ``close``."""
    from lit_gmc.data.engines import HFEngine

    try:
        if threads is not None:
            torch.set_num_threads(threads)
        engine = HFEngine(batch_rows)
        engine.start(actor)
        engine.model.share_memory()
        connection.send(("ready", dict(engine.model.named_parameters())))
    except BaseException:
        connection.send(("error", traceback.format_exc()))
        return
    while True:
        request, args = connection.recv()
        if request == "close":
            return
        try:
            connection.send(("ok", [as_arrays(group) for group in engine.generate(*args)]))
        except BaseException:
            connection.send(("error", traceback.format_exc()))


class EngineProcess:
    """The client side: starts the engine process and talks to it (used by ``HFEngine(layout="dedicated")``).

    Args:
        actor: What the engine process loads (``"tiny"``, a hub name or a local path).
        batch_rows: ``HFEngine``'s rows per ``generate`` call.
        threads: torch threads of the engine process (``None``: torch's default).
    """

    def __init__(self, actor: str, batch_rows: int, threads: int | None) -> None:
        context = mp.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, actor, batch_rows, threads), name="lit_gmc-engine", daemon=True
        )
        self.process.start()
        child.close()
        self.lock = threading.Lock()
        self.parameters: dict[str, Tensor] = self._reply("starting")

    def _died(self, doing: str) -> RuntimeError:
        self.process.join(timeout=5)
        return RuntimeError(f"the engine process died while {doing} (exit code {self.process.exitcode})")

    def _reply(self, doing: str) -> Any:
        """The engine process's answer, or a ``RuntimeError`` with its traceback (or its exit code if it died)."""
        try:
            status, value = self.connection.recv()
        except (EOFError, OSError):
            raise self._died(doing) from None
        if status == "error":
            raise RuntimeError(f"the engine process failed while {doing}:\n{value}")
        return value

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Write ``named_tensors`` into the engine's shared parameters (the caller holds :attr:`lock`)."""
        copy_weights(self.parameters, named_tensors)

    def generate(self, prompts: Sequence[Prompt], n: int, sampling) -> list[RolloutGroup]:
        """The engine process's ``HFEngine.generate`` (the caller holds :attr:`lock`)."""
        try:
            self.connection.send(("generate", (list(prompts), n, sampling)))
        except OSError:  # a broken pipe: the process is gone
            raise self._died("generating") from None
        return [as_tensors(group) for group in self._reply("generating")]

    def close(self) -> None:
        """Stop the engine process (at once if it does not stop by itself); idempotent."""
        if self.process.is_alive():
            try:
                self.connection.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.connection.close()
        self.parameters = {}

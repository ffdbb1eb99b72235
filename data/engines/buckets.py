"""The bucket stream of a weight update, both ends, on plain tensors over any broadcast: no vLLM here.

:class:`BucketSender` (the learner's global rank 0) streams a *generator* of ``(name, tensor)`` (``WeightSync``'s
FSDP2 gathers) through two buffers of ``bucket_bytes``, cast to the servers' dtype, a tensor larger than a bucket in
several pieces; :func:`receive_update` (a server's worker) puts them back together. vLLM's weight-transfer protocol
carries them (:mod:`lit_gmc.data.engines.weight_transfer`, its plugin), but the stream itself needs only torch, so
its tests run where vLLM is not installed (``tests/test_weight_transfer.py``; an ``import-linter`` contract keeps
vLLM out of this module).
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lit_gmc.distributed import POLL_S, Interrupted, in_thread, wait_for


class WeightSyncClient(Protocol):
    """The servers' weight-update calls as :class:`BucketSender` drives them (vLLM's ``VLLMWeightSyncClient``)."""

    def start_weight_update(self) -> None:
        """Open an update on every server."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Announce one bucket (or, in band, the whole update); returns once the servers have loaded it."""

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update, stamping ``weight_version``."""


@dataclass
class BucketInfo:
    """One bucket's announcement: pieces of tensors, each broadcast next from rank 0, in this order.

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


def receive_bucket(group, info: BucketInfo, partial: dict[str, tuple[Tensor, int]],
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


def receive_update(group, info: BucketInfo, partial: dict[str, tuple[Tensor, int]],
                   load: Callable[[Iterator[tuple[str, Tensor]]], Any],
                   times: ReceiveTimes | None = None) -> list[BucketInfo]:  # fmt: skip
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


def receive_announcement(group) -> BucketInfo | None:
    """The next in-band announcement broadcast by rank 0; ``None`` at the update's end."""
    length = torch.zeros(1, dtype=torch.int64)
    group.broadcast(length, 0).wait()
    if not length.item():
        return None
    raw = torch.empty(int(length.item()), dtype=torch.uint8)
    group.broadcast(raw, 0).wait()
    return BucketInfo(**json.loads(raw.numpy().tobytes()))


def open_gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A gloo group of its own (not torch.distributed's default one, which vLLM's workers use), over a TCPStore."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("lit_gmc_weights", store), rank,
                                               world_size, timeout)  # fmt: skip
    return store, group


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

    def __init__(self, client: WeightSyncClient, broadcast: Callable[[Tensor], Any], bucket_bytes: int,
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

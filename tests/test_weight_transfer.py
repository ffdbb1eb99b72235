"""The bucketing of weight transfers on plain tensors, through a real gloo group of two ranks inside this process.

Rank 0 runs :class:`BucketSender` as the learner does; rank 1 answers each ``/update_weights`` with
:func:`receive_update`, the receive of the ``gloo`` worker engine (the vLLM servers' side is covered end to end in
``tests/test_vllm_serve.py``). The calls are what the servers would get over HTTP. The bucket stream is plain torch
(``data/engines/buckets.py``), so these tests run without vLLM; only those marked ``needs_vllm`` (vLLM's packed and
IPC formats, its trainer engine) skip where it is missing.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import torch

from lit_gmc.data.engines.buckets import (
    BucketInfo,
    BucketSender,
    _drop,
    open_gloo_group,
    receive_announcement,
    receive_bucket,
    receive_update,
)
from lit_gmc.data.engines.vllm import INSTALL_HINT
from lit_gmc.data.engines.vllm_serve import free_port

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason=f"vLLM is not installed: {INSTALL_HINT}")


class LoopbackClient:
    """vLLM's ``VLLMWeightSyncClient`` answered in this process: ``update_weights`` receives on rank 1."""

    def __init__(self, group, received: dict | None = None) -> None:
        self.group, self.partial, self.announced, self.calls, self.version = group, {}, [], 0, None
        self.received = {} if received is None else received

    def start_weight_update(self) -> None:
        self.partial.clear()

    def load(self, named) -> None:
        self.received.update(named)

    def update_weights(self, update_info: dict) -> None:
        self.calls += 1
        info = BucketInfo(**json.loads(json.dumps(update_info)))  # what HTTP would carry
        self.announced += [asdict(bucket) for bucket in receive_update(self.group, info, self.partial, self.load)]

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.version = weight_version


@pytest.fixture
def gloo_pair():
    """Ranks 0 and 1 of one gloo group (each opens its end on its own thread: the rendezvous waits for both)."""
    port = free_port()
    with ThreadPoolExecutor(max_workers=2) as pool:
        ends = [pool.submit(open_gloo_group, "127.0.0.1", port, rank, 2, 20) for rank in (0, 1)]
        (store0, rank0), (store1, rank1) = [end.result() for end in ends]
    yield rank0, rank1
    del store0, store1


def model_like() -> list[tuple[str, torch.Tensor]]:
    """fp32 tensors of awkward sizes: larger than a bucket, a scalar, one with no elements, a transposed view."""
    generator = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(7, 5, generator=generator)),
        ("norm", torch.randn(3, generator=generator)),
        ("scale", torch.randn((), generator=generator)),
        ("empty", torch.zeros(0, 4)),
        ("proj", torch.randn(4, 6, generator=generator).t()),
        ("bias", torch.randn(11, generator=generator)),
    ]


def sent_buffers(group, storages: set[int], bucket_bytes: int = 0):
    """The sender's broadcast, noting the storage of every bucket buffer (of ``bucket_bytes``) it sends from."""

    def broadcast(data: torch.Tensor):
        if data.untyped_storage().nbytes() == bucket_bytes:  # not an in-band announcement (8 bytes, or JSON)
            storages.add(data.untyped_storage().data_ptr())
        return group.broadcast(data, 0)

    return broadcast


@pytest.mark.parametrize("bucket_bytes", [2, 10, 16, 64, 1 << 20])
def test_every_tensor_arrives_cast_exactly_and_whole_through_two_buffers(gloo_pair, bucket_bytes):
    client, storages = LoopbackClient(gloo_pair[1]), set()
    sender = BucketSender(client, sent_buffers(gloo_pair[0], storages, bucket_bytes), bucket_bytes, torch.bfloat16)
    tensors = model_like()
    sender.send(iter(tensors), version="3")
    assert list(client.received) == [name for name, _ in tensors] and client.version == "3"
    assert client.calls == 1 and len(client.announced) > (bucket_bytes < 140)  # one call carries every bucket
    for name, tensor in tensors:  # bit for bit what a whole-tensor cast gives
        assert torch.equal(client.received[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name
        assert client.received[name].shape == tensor.shape
    elements = [sum(a["stops"]) - sum(a["starts"]) for a in client.announced]
    assert all(0 < 2 * n <= bucket_bytes for n in elements[:-1]) and 2 * elements[-1] <= bucket_bytes
    assert 1 <= len(storages) <= 2  # two buffers, alternating
    if bucket_bytes < 70:  # "embed" (35 elements) is larger than a bucket: it travels in pieces, in order
        announced = [zip(a["names"], a["starts"], a["stops"], strict=True) for a in client.announced]
        pieces = [(start, stop) for a in announced for name, start, stop in a if name == "embed"]
        assert len(pieces) > 1 and [s for s, _ in pieces] == [0] + [e for _, e in pieces[:-1]] and pieces[-1][1] == 35


@pytest.mark.parametrize(("sizes", "per_bucket"), [((7, 6), [4, 4, 4, 1]), ((4, 4), [4, 4]), ((3, 0), [3])],
                         ids=["last-partial", "last-full", "last-tensor-empty"])  # fmt: skip
def test_the_last_bucket_arrives_whether_partial_full_or_closed_by_a_tensor_of_no_elements(gloo_pair, sizes,
                                                                                           per_bucket):  # fmt: skip
    """The end of the stream, on buckets of 4 elements: a last bucket that no tensor fills is sent by the send itself,
    a full one by the copy that fills it, a tensor of no elements is announced in the bucket it closes. Every
    element is announced once, in ceil(N / 4) buckets, and every tensor arrives exactly, the last one included.
    Plain torch: this runs where vLLM is not installed (``scripts/mutations.toml``: ``bucket-last-dropped``)."""
    tensors = [(f"t{i}", torch.arange(n, dtype=torch.float32) + 100 * i) for i, n in enumerate(sizes)]
    client = LoopbackClient(gloo_pair[1])
    sender = BucketSender(client, lambda data: gloo_pair[0].broadcast(data, 0), 4 * 4, torch.float32)
    sender.send(iter(tensors), version="5")
    assert [sum(a["stops"]) - sum(a["starts"]) for a in client.announced] == per_bucket
    assert sender.times.buckets == len(per_bucket) and sender.times.bytes == 4 * sum(sizes)
    assert list(client.received) == [name for name, _ in tensors] and client.version == "5"
    for name, tensor in tensors:
        assert torch.equal(client.received[name], tensor), name


@needs_vllm
def test_without_splitting_each_bucket_is_one_vllm_packed_buffer(gloo_pair):
    """vLLM's NCCL worker (packed) cuts a buffer once it holds more than bucket_bytes: each announced bucket must be
    whole tensors within bucket_bytes, or one larger tensor alone, laid out as vLLM's ``unpack_tensor`` reads it."""
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    bucket_bytes, received, announced = 24, {}, []

    class PackedClient(LoopbackClient):
        def update_weights(self, update_info: dict) -> None:
            announced.append(update_info)
            dtypes = [getattr(torch, d) for d in update_info["dtype_names"]]
            sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(update_info["shapes"], dtypes, strict=True)]
            packed = torch.empty(sum(sizes), dtype=torch.uint8)
            if packed.numel():
                self.group.broadcast(packed, 0).wait()
            received.update(unpack_tensor(packed, update_info["names"], update_info["shapes"], dtypes, sizes))

    sender = BucketSender(PackedClient(gloo_pair[1]), sent_buffers(gloo_pair[0], set()), bucket_bytes, torch.bfloat16,
                          vllm_packed=True)  # fmt: skip
    tensors = model_like()
    sender.send(iter(tensors))
    for name, tensor in tensors:
        assert torch.equal(received[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name
    for info in announced:
        assert "starts" not in info
        total = sum(torch.Size(s).numel() * 2 for s in info["shapes"])
        assert total <= bucket_bytes or len(info["names"]) == 1
    assert ["embed"] in [info["names"] for info in announced]  # 70 bytes: alone


def test_a_loading_error_surfaces_once_the_whole_bucket_is_received(gloo_pair):
    class RefusingClient(LoopbackClient):
        refuse = True

        def load(self, named) -> None:
            for name, tensor in named:
                if self.refuse and name == "norm":
                    raise RuntimeError("no such parameter: norm")
                self.received[name] = tensor

    client = RefusingClient(gloo_pair[1])
    sender = BucketSender(client, sent_buffers(gloo_pair[0], set()), 16, torch.bfloat16)  # "norm" in bucket 5 of 10
    with pytest.raises(RuntimeError, match="no such parameter: norm"):
        sender.send(iter(model_like()))
    assert client.version is None and list(client.received) == ["embed"]  # never finished, nothing loaded after
    # Every later bucket was received all the same: the group is in step, a later update goes through.
    client.refuse = False
    sender.send(iter(model_like()), version="1")
    assert client.version == "1"


def test_a_load_that_fails_mid_bucket_leaves_the_group_in_step(gloo_pair):
    """vLLM's ``load_weights`` consumes a bucket's tensors as they arrive; when it raises part-way, the rest of the
    bucket is still received (the trainer is broadcasting it), the error reaches the trainer, and the next update
    arrives whole and exact."""
    class FailingLoad(LoopbackClient):
        fail = True

        def load(self, named) -> None:
            for name, tensor in named:
                if self.fail and name == "norm":
                    raise RuntimeError("no such parameter: norm")
                self.received[name] = tensor

    client = FailingLoad(gloo_pair[1])
    sender = BucketSender(client, sent_buffers(gloo_pair[0], set()), 1 << 10, torch.bfloat16)  # one bucket
    with pytest.raises(RuntimeError, match="no such parameter: norm"):
        sender.send(iter(model_like()))
    assert list(client.received) == ["embed"] and client.version is None
    client.fail, client.received = False, {}
    sender.send(iter(model_like()), version="1")
    for name, tensor in model_like():
        assert torch.equal(client.received[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name
    assert client.version == "1"


def test_a_server_that_fails_before_receiving_ends_the_send_with_its_error(gloo_pair):
    """A worker that answers ``/update_weights`` with an error before it receives would otherwise leave the learner's
    broadcast blocked (the bytes exceed the socket's buffers) until the group's timeout."""
    class Refusing(LoopbackClient):
        def update_weights(self, update_info: dict) -> None:
            raise RuntimeError("gloo weight transfer not initialised")

    sender = BucketSender(Refusing(gloo_pair[1]), sent_buffers(gloo_pair[0], set()), 64 << 20, torch.bfloat16)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="not initialised"):
        sender.send(iter([("big", torch.zeros(32 << 20))]))
    assert time.monotonic() - began < 10  # the group's timeout is 20 s


@pytest.mark.parametrize("server", ["takes no bytes", "never answers"])
def test_a_sigterm_ends_a_send_to_a_stopped_server_within_a_poll(gloo_pair, server):
    """A server stopped (SIGSTOP) in the middle of an update either takes none of the bytes broadcast to it (64 MiB:
    more than the sockets hold) or, its worker having received them, never answers its call. ``stop`` (a SIGTERM),
    true 0.3 s after the last broadcast is posted, ends the send within a poll with ``Interrupted``, not at the
    group's timeout (20 s here, 30 min in a run) or the request's (an hour); the broadcasts still in flight are left
    in ``unfinished`` for the group's owner."""
    from lit_gmc.distributed import Interrupted

    released, posted = threading.Event(), []
    timeout = threading.Timer(15, released.set)  # a send that does not poll still ends, and fails the test
    timeout.start()

    class Stopped(LoopbackClient):
        def update_weights(self, update_info: dict) -> None:
            if server == "never answers":
                super().update_weights(update_info)
            released.wait()

    def broadcast(data: torch.Tensor):
        posted.append(time.monotonic())
        return gloo_pair[0].broadcast(data, 0)

    def stop() -> bool:
        return bool(posted) and time.monotonic() > posted[-1] + 0.3

    sender = BucketSender(Stopped(gloo_pair[1]), broadcast, 64 << 20, torch.bfloat16, stop=stop)
    with pytest.raises(Interrupted):
        sender.send(iter([("big", torch.zeros(32 << 20 if server == "takes no bytes" else 16))]))
    assert time.monotonic() - (posted[-1] + 0.3) < 1.0 and not released.is_set()
    assert bool(sender.unfinished) == (server == "takes no bytes")
    if server == "takes no bytes":  # rank 1 takes the bucket, so that the fixture can destroy the group
        receive_bucket(gloo_pair[1], receive_announcement(gloo_pair[1]), {}, _drop)
    released.set()
    timeout.cancel()


def test_pieces_out_of_order_and_inconsistent_announcements_are_refused():
    _, alone = open_gloo_group("127.0.0.1", free_port(), 0, 1, 10)
    info = BucketInfo(["w"], ["float32"], [[4]], starts=[2], stops=[4])
    with pytest.raises(ValueError, match="w: a piece from element 2 does not continue"):
        receive_bucket(alone, info, {}, list)
    with pytest.raises(ValueError, match="give both starts and stops"):
        BucketInfo(["w"], ["float32"], [[4]], starts=[0])
    with pytest.raises(ValueError, match=r"differ in length: \[1, 1, 1, 2, 2\]"):
        BucketInfo(["w"], ["float32"], [[4]], starts=[0, 1], stops=[1, 4])
    with pytest.raises(ValueError, match="bucket_bytes=1 must hold one torch.bfloat16 element"):
        BucketSender(None, None, 1, torch.bfloat16)


# ---- backend: ipc (vLLM's CUDA IPC trainer engine; only what runs without a GPU) ----


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_ipc_is_refused_without_cuda_and_with_more_than_one_server_naming_the_flag():
    from lit_gmc.data.engines.vllm_serve import VLLMServers
    from lit_gmc.options import component_problems

    problems = component_problems(VLLMServers, {"urls": ["http://a:8000"], "launch": 1, "backend": "ipc"},
                                  "--data.engine")  # fmt: skip
    assert problems == [
        "--data.engine.backend=ipc needs CUDA (the learner shares its GPU memory with a colocated server by CUDA "
        "IPC): use gloo on CPU",
        "--data.engine.backend=ipc takes one server, on this learner's GPU; got 2",
    ]
    with pytest.raises(ValueError, match="invalid VLLMServers options: backend=ipc needs CUDA"):
        VLLMServers(urls=["http://a:8000"], backend="ipc")
    assert component_problems(VLLMServers, {"urls": ["http://a:8000"], "backend": "gloo"}, "--data.engine") == []


@needs_vllm
def test_ipc_handles_travel_as_vllms_worker_reads_them(monkeypatch):
    """The ``/update_weights`` body our client posts for vLLM's IPC trainer engine parses back, through vLLM's own
    ``IPCWeightTransferUpdateInfo``, to the handles the engine gave (tuples with bytes, which JSON cannot carry)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    from lit_gmc.data.engines.vllm_serve import json_update_info

    handles = {"GPU-0a1b": (7, b"\x00handle\xff", 4096, 0, b"\x01ref", 12, 0, False)}
    info = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]], "ipc_handles": handles,
            "tensor_sizes": [12]}  # fmt: skip
    body = json.loads(json.dumps(json_update_info(info)))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    parsed = IPCWeightTransferUpdateInfo(**body)
    assert parsed.ipc_handles == handles and parsed.names == ["w"] and parsed.tensor_sizes == [12]
    plain = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    assert json_update_info(plain) is plain  # gloo and nccl announcements pass unchanged


@needs_vllm
def test_a_retired_group_releases_a_waiting_worker_though_the_failed_send_keeps_its_error_in_a_cycle():
    """A server's error re-raised from its call's future is a reference cycle (the future holds the error, whose
    traceback holds the frames that hold the future and the broadcast being waited for), and a gloo group's
    connections close only with the last reference to the group or to one of its broadcasts (``abort`` and
    ``shutdown`` leave them open). Retiring the group after such an error must still release, within seconds, a
    worker left waiting on it: in a run, the server that survived the loss of another in a sync, which must leave
    the broken group before it can join the next. Automatic collection is off: one that came first would hide it."""
    import gc

    from lit_gmc.data.engines.weight_transfer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine

    def survivor(group) -> None:
        """Takes the bucket after its call has failed, then waits for more, as the surviving server's worker."""
        time.sleep(0.5)
        receive_bucket(group, receive_announcement(group), {}, _drop)
        group.recv([torch.zeros(1)], 0, 99).wait()  # ended only by the group's connections closing

    class OneServerLost:
        def init_weight_transfer_engine(self, info: dict) -> None:
            self.store, self.group = open_gloo_group(info["master_address"], info["master_port"], 1, 2, 20)

        def start_weight_update(self) -> None:
            pass

        def update_weights(self, update_info: dict) -> None:
            self.waiting = ThreadPoolExecutor(max_workers=1).submit(survivor, self.group)
            raise RuntimeError("server http://127.0.0.1:1 is gone")  # the other server's call

    client = OneServerLost()
    info = GlooTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(), world_size=2,
                               bucket_bytes=64)  # fmt: skip
    engine = GlooTrainerWeightTransferEngine.trainer_init(info, client=client)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="is gone"):
            engine.send_stream(iter([("small", torch.ones(4))]))
        # released: its connection ended (closed or reset, as the sockets go); still waiting: a TimeoutError
        with pytest.raises(RuntimeError, match="Connection (closed|reset) by peer"):
            client.waiting.result(timeout=10)  # the group's timeout is 20 s
    finally:
        if collecting:
            gc.enable()

"""The few collectives the learner needs across data-parallel ranks, as functions that are identities on one process.

Rank 0 owns the rollout engine and the delay schedule; every other rank receives its share of each update's groups
(:func:`scatter_from_first`) and joins the reductions of per-step statistics (:func:`gather_rows`,
:func:`gather_ragged`, :func:`sum_across`) on the default process group (Lightning's DDP, or
:class:`lit_gmc.strategies.FSDP2Strategy`'s one data-parallel mesh dimension).

The rank-0 channel: rank 0 alone generates, evaluates and waits for rollout workers, for as long as that takes.
Waiting inside a collective of the default group would trip its timeout (NCCL's 30 minutes, or
``--trainer.strategy.timeout``), kept short to catch hung GPUs, so every wait for rank 0 is a collective on a second,
gloo group whose timeout is hours (:func:`open_rank0_channel`, ``--data.rank0_wait_hours``): the shares, and
:func:`wait_for_rank0` / :func:`any_rank` where rank 0 may still be busy (``RunCheckpoint``, the DataModule's
``setup`` and ``state_dict``, ``WeightSync``).

SIGTERM: a rank blocked in a gloo collective runs no Python signal handler, so every wait on the channel is an
asynchronous collective polled every :data:`POLL_S`. A rank that notes SIGTERM (:func:`note_sigterm`) publishes it
in the default group's store, where rank 0's own waits see it (:func:`sigterm_requested`); rank 0 then answers
:data:`STOP` instead of shares, or the ranks vote after the update (``RunCheckpoint``), so all stop at the same
update. A rank's :class:`~lit_gmc.errors.UserError` is published the same way (:func:`publish_error`) and raised by
the others' polled waits, so every rank ends in that line rather than in gloo's "Connection closed by peer".

Written on ``torch.distributed`` directly: Lightning's strategy has no scatter of Python objects and no gather of
tensors whose first dimension differs between ranks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from lit_gmc.errors import UserError

T = TypeVar("T")

DEFAULT_RANK0_WAIT = timedelta(hours=12)
POLL_S = 0.1  # how often a wait for rank 0 looks at SIGTERM: a stop is acted on within this
SIGTERM_KEY = "lit_gmc/sigterm"  # set in the default group's store by the first rank that sees a SIGTERM
ERROR_KEY = "lit_gmc/error"  # the first failing rank's message (a UserError's), for the others to raise
ERROR_READ_S = 10.0  # how long a rank that published its error waits for the others to come and read it
STOP = "lit_gmc: stop"
"""What rank 0 scatters instead of the shares when a SIGTERM stops the run while the other ranks wait for it."""
_channel: tuple[Any, Any] | None = None  # (the default group it was made in, the gloo group)
_sigterm = {"noted": False, "published": False}  # this process's, for the run of the current default group
_error = {"read": False, "own": False}  # this process read another rank's published error, or published its own


class Interrupted(Exception):
    """A wait ended because the run received SIGTERM; the caller puts its state back and stops at the last update."""


class SendAgain(Exception):
    """A weight update lost a receiver mid-stream; the others wait for the same weights, streamed again by every rank.

    A stream of gathered parameters cannot be replayed by the engine that consumes it: ``WeightSync`` restreams.
    """


def in_thread(call: Callable[[], T], name: str) -> Future[T]:
    """``call()`` on a daemon thread of its own, as a future, so that a wait for it can be given up (:func:`wait_for`).

    A ``ThreadPoolExecutor``'s workers are joined when the interpreter exits: one blocked in a request to a server
    that stopped answering would hold a preempted run's exit for the request's whole timeout.
    """
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as err:  # the waiter raises it
            future.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def wait_for(futures: Iterable[Future], stop: Callable[[], bool], what: str) -> None:
    """Wait until every future is done, looking at ``stop`` every :data:`POLL_S`; :class:`Interrupted` once it is true.

    The futures' own errors are left to the caller (``future.result()``).
    """
    pending = set(futures)
    while pending:
        pending = wait_futures(pending, timeout=POLL_S).not_done
        if pending and stop():
            raise Interrupted(f"SIGTERM while waiting for {what}")


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default group; ``(0, 1)`` without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def open_rank0_channel(timeout: timedelta | None = None) -> Any:
    """The gloo group, over every rank, on which ranks wait for global rank 0; made once per default group.

    Every rank must call it at the same point (``dist.new_group`` is a collective), e.g. in a ``setup`` hook. The
    first call fixes the timeout (``timeout`` or :data:`DEFAULT_RANK0_WAIT`); later calls return the same group.
    ``None`` on one process.
    """
    global _channel
    _, world = rank_and_world()
    if world == 1:
        return None
    if _channel is None or _channel[0] is not dist.group.WORLD:  # none yet, or made in a destroyed default group
        group = dist.new_group(backend="gloo", timeout=timeout or DEFAULT_RANK0_WAIT)
        _channel = (dist.group.WORLD, group)
        _sigterm.update(noted=False, published=False)  # a new run
        _error.update(read=False, own=False)
    return _channel[1]


def note_sigterm() -> None:
    """Note that this process received SIGTERM (safe in a signal handler: it only sets a flag)."""
    _sigterm["noted"] = True


def sigterm_requested() -> bool:
    """Whether this process noted SIGTERM or, on several processes, any rank did (through the store).

    The first call that finds this process's own note publishes it, so the other ranks' calls see it too.
    """
    if rank_and_world()[1] == 1:
        return _sigterm["noted"]
    store = dist.distributed_c10d._get_default_store()
    if _sigterm["noted"]:
        if not _sigterm["published"]:
            store.set(SIGTERM_KEY, "1")
            _sigterm["published"] = True
        return True
    return store.check([SIGTERM_KEY])


def publish_error(message: str) -> None:
    """Give ``message`` (a :class:`~lit_gmc.errors.UserError`'s, as this rank fails) to every other rank's polled wait.

    The first rank to publish is the one whose message every rank prints. It then joins the others' barrier on the
    channel (for up to :data:`ERROR_READ_S`), so that they leave with no collective pending (one pending may abort
    in gloo's threads, and the status is then not 2). Nothing on one process.
    """
    if rank_and_world()[1] == 1 or _error["read"] or _error["own"]:  # the error this rank raises is another's
        return
    store = dist.distributed_c10d._get_default_store()
    if store.compare_set(ERROR_KEY, "", message).decode() != message:
        return  # another rank's came first
    _error["own"] = True
    if _channel is None or _channel[0] is not dist.group.WORLD:  # failed before the channel was made
        return
    joined = dist.barrier(group=_channel[1], async_op=True)
    deadline = time.monotonic() + ERROR_READ_S
    while not joined.is_completed() and time.monotonic() < deadline:
        time.sleep(POLL_S / 2)


def raise_published_error() -> None:
    """Raise, as a :class:`~lit_gmc.errors.UserError`, the error another rank published (:func:`publish_error`)."""
    if _error["own"]:
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        message = store.get(ERROR_KEY).decode() if store.check([ERROR_KEY]) else None
    except (RuntimeError, ValueError):  # no store to ask: the rank that hosted it is gone, and its message with it
        return
    if message is not None:
        _error["read"] = True
        raise UserError(message)


def wait_polled(barrier: Any) -> None:
    """Wait for an asynchronous barrier of the channel, then raise another rank's published error, if any.

    Meanwhile this rank's SIGTERM is published (:func:`sigterm_requested`) every :data:`POLL_S`, since a rank
    blocked in gloo runs no signal handler. A rank that went away without joining fails the barrier, which then
    raises its published error (:func:`publish_error`), if any, rather than gloo's.
    """
    done = threading.Event()
    barrier.get_future().add_done_callback(lambda _: done.set())
    while not done.wait(POLL_S):
        sigterm_requested()
    try:
        barrier.wait()
    except RuntimeError:
        raise_published_error()
        raise
    raise_published_error()


def scatter_from_first(shares: list[T] | None) -> T:
    """Rank 0 passes one picklable object per rank and gets its own back; every other rank passes ``None``.

    Sent over the rank-0 channel (:func:`open_rank0_channel`): the other ranks wait here while rank 0 generates,
    publishing a SIGTERM they receive meanwhile (:func:`sigterm_requested`); rank 0 then sends :data:`STOP`.
    """
    rank, world = rank_and_world()
    if world == 1:
        assert shares is not None and len(shares) == 1
        return shares[0]
    if rank == 0 and (shares is None or len(shares) != world):
        raise ValueError(f"scatter_from_first needs {world} shares on rank 0, got {shares!r:.80}")
    channel = open_rank0_channel()
    wait_polled(dist.barrier(group=channel, async_op=True))  # rank 0 may be busy for hours
    received: list[Any] = [None]
    dist.scatter_object_list(received, shares if rank == 0 else None, src=0, group=channel)
    return received[0]


def wait_for_rank0() -> None:
    """Return on every rank once every rank (rank 0 last, when it is the busy one) has called it; over the channel."""
    if rank_and_world()[1] > 1:
        wait_polled(dist.barrier(group=open_rank0_channel(), async_op=True))


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank; every rank calls it, so it also waits for rank 0 like a barrier."""
    if rank_and_world()[1] == 1:
        return flag
    channel = open_rank0_channel()
    wait_polled(dist.barrier(group=channel, async_op=True))  # rank 0 may be busy: wait where SIGTERM is seen
    vote = torch.tensor([int(flag)])  # on the CPU: the channel is gloo
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=channel)
    return bool(vote.item())


def gather_rows(local: Tensor) -> Tensor:
    """Concatenate every rank's ``local`` along dim 0, in rank order; all ranks pass the same shape."""
    _, world = rank_and_world()
    if world == 1:
        return local
    if local.dtype == torch.bool:  # gloo has no boolean collectives
        return gather_rows(local.to(torch.uint8)).bool()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts)


def gather_groups(rows: dict[str, Tensor], positions: Tensor | None, group_size: int) -> dict[str, Tensor]:
    """:func:`gather_rows` of each ``(n,)`` per-row tensor of a share, in the whole update's group order.

    Args:
        rows: Per-row values of this rank's share (group-major, ``n = B_r G`` rows on every rank).
        positions: ``(B_r,)`` the share's groups' indices in the update (``RolloutBatch.update_positions``);
            ``None``: the shares are contiguous blocks in rank order, so rank order is already the update's.
        group_size: ``G``.

    Returns:
        ``(N,)`` tensors whose row ``b G + i`` is response ``i`` of the update's group ``b``, as on one process.
    """
    gathered = {key: gather_rows(value) for key, value in rows.items()}
    if positions is None or rank_and_world()[1] == 1:
        return gathered
    source = gather_rows(positions).argsort()  # (B,) gathered group that holds update group b
    index = (source[:, None] * group_size + torch.arange(group_size, device=source.device)).flatten()  # (N,)
    return {key: value[index] for key, value in gathered.items()}


def gather_ragged(local: Tensor) -> Tensor:
    """Like :func:`gather_rows` for 1-D tensors whose length differs between ranks (e.g. per-token values)."""
    _, world = rank_and_world()
    if world == 1:
        return local
    length = torch.tensor([local.numel()], device=local.device)
    lengths = gather_rows(length).tolist()  # (world,)
    padded = local.new_zeros(max(lengths))
    padded[: local.numel()] = local
    parts = gather_rows(padded).reshape(world, -1)  # (world, longest)
    return torch.cat([parts[r, :n] for r, n in enumerate(lengths)])


def sum_across(local: Tensor) -> Tensor:
    """The element-wise sum of ``local`` over ranks (a new tensor; ``local`` is unchanged)."""
    _, world = rank_and_world()
    if world == 1:
        return local
    total = local.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole of a possibly FSDP2-sharded tensor; a collective every rank must join for a ``DTensor``."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_part(tensor: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor``, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like(reference: Tensor, tensor: Tensor) -> Tensor:
    """``tensor`` (whole, or already laid out like ``reference``) with ``reference``'s dtype, device and sharding."""
    if isinstance(reference, DTensor) and not isinstance(tensor, DTensor):
        whole = tensor.to(dtype=reference.dtype, device=reference.device)
        return distribute_tensor(whole, reference.device_mesh, reference.placements)
    return tensor.to(dtype=reference.dtype, device=reference.device)

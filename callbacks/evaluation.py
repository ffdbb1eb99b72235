r"""Evaluate the policy on math benchmarks during training: greedy accuracy, avg@n and pass@k, to TensorBoard.

The callback generates through any object with ``generate(prompts, n, sampling)`` (:class:`GenerationEngine`),
by default the DataModule's ``rollout_engine``, and decodes with the DataModule's ``tokenizer``. It runs at
the start of a training batch (and at the end of training), after the previous step's weights have been
published, so it does not depend on where it sits in the callback list; the policy version it actually
evaluated is recorded next to the step. Benchmark loading, prompts and scoring come from ``lit_gmc.data``,
imported in ``setup``, so importing this module stays light. Benchmarks come from their hub datasets unless
``data_dir`` or ``sources`` name local copies; a completion is scored by its last complete ``\boxed{}``, as in
the paper and as the training reward does by default.

:func:`evaluate_suites` is the engine-agnostic core, shared with ``scripts/evaluate.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics.aggregation import SumMetric
from typing_extensions import override

from lit_gmc.callbacks.metrics import PAPER_KS, AvgAtN, GreedyAccuracy, MacroAverage, PassAtK

PAPER_BENCHMARKS: tuple[str, ...] = ("math500", "gsm8k", "gaokao2023en", "olympiadbench", "minerva", "amc23")


@runtime_checkable
class GenerationEngine(Protocol):
    """What evaluation needs from a rollout engine: ``n`` responses per prompt, one group per prompt.

    Each returned group has ``response_ids``, a ``(n, L)`` tensor of token ids (padding decodes to nothing).
    """

    def generate(self, prompts: Sequence[Any], n: int, sampling: Any) -> list[Any]:
        """Responses to ``prompts`` (objects with ``text``), sampled as ``sampling`` says."""


class Scorer(Protocol):
    """Rewards in ``[0, 1]`` of ``(completion, reference answer)`` pairs."""

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """One reward per pair."""


@dataclass
class Suite:
    """One benchmark ready to run: its prompts (with reference answers), samples per problem and pass@k sizes."""

    name: str
    title: str
    prompts: list[Any]
    n: int
    ks: tuple[int, ...]


def correctness(
    engine: GenerationEngine, tokenizer: Any, scorer: Scorer, prompts: Sequence[Any], n: int, sampling: Any
) -> Tensor:
    """``(P, n)`` 0/1 correctness of ``n`` responses to each prompt."""
    if not prompts:
        return torch.zeros(0, n)
    from lit_gmc.data.tokens import decode_responses

    groups = engine.generate(prompts, n, sampling)
    pairs = []
    for prompt, group in zip(prompts, groups, strict=True):
        texts = decode_responses(tokenizer, group.response_ids.tolist())
        pairs.extend((text, prompt.answer) for text in texts)
    return torch.tensor(scorer.score_pairs(pairs), dtype=torch.float64).view(len(prompts), n)


def evaluate_suites(
    engine: GenerationEngine,
    tokenizer: Any,
    scorer: Scorer,
    suites: Sequence[Suite],
    max_new_tokens: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Greedy (T = 0) and sampled (T = 1, top-p 1) evaluation of every suite, with macro averages.

    Returns:
        ``{"benchmarks": {name: {"title", "problems", "n", "greedy", "avg@n", "pass@k"...}},
        "macro": {"greedy", "avg@n"}}``; values are floats (metrics are synced across processes).
    """
    from lit_gmc.data.engines import SamplingParams

    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    sampled = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    names = [s.name for s in suites]
    macro_greedy, macro_avg = MacroAverage(names), MacroAverage(names)
    results: dict[str, Any] = {"benchmarks": {}}
    for suite in suites:
        first = correctness(engine, tokenizer, scorer, suite.prompts, 1, greedy)[:, 0]  # (P,)
        many = correctness(engine, tokenizer, scorer, suite.prompts, suite.n, sampled)  # (P, n)
        accuracy, avg, pass_k = GreedyAccuracy(), AvgAtN(suite.n), PassAtK(suite.n, suite.ks)
        for metric, values in ((accuracy, first), (avg, many), (pass_k, many)):
            metric.update(values)
        macro_greedy.update(suite.name, first)
        macro_avg.update(suite.name, many.mean(dim=1))
        count = SumMetric()
        count.update(float(len(suite.prompts)))
        entry = {"title": suite.title, "problems": int(count.compute()), "n": suite.n}
        entry.update({"greedy": float(accuracy.compute()), "avg@n": float(avg.compute())})
        entry.update({k: float(v) for k, v in pass_k.compute().items()})
        results["benchmarks"][suite.name] = entry
    results["macro"] = {"greedy": float(macro_greedy.compute()), "avg@n": float(macro_avg.compute())}
    return results


def scalars_of(results: Mapping[str, Any], prefix: str = "eval") -> dict[str, float]:
    """TensorBoard scalars of :func:`evaluate_suites`' results: ``eval/<name>/greedy``, ``eval/<name>/avg@16``..."""
    out = {}
    for name, entry in results["benchmarks"].items():
        out[f"{prefix}/{name}/greedy"] = entry["greedy"]
        out[f"{prefix}/{name}/avg@{entry['n']}"] = entry["avg@n"]
        out.update({f"{prefix}/{name}/{key}": value for key, value in entry.items() if key.startswith("pass@")})
    out.update({f"{prefix}/macro/{key}": value for key, value in results["macro"].items()})
    return out


class Evaluation(pl.Callback):
    r"""Evaluate on math benchmarks every ``every_n_steps`` optimizer steps and at ``at_steps``.

    Args:
        benchmarks: Registered benchmark names (``math500``, ``gsm8k``, ``gaokao2023en``, ``olympiadbench``,
            ``minerva``, ``amc23``).
        every_n_steps: Period in optimizer steps (``null``: only ``at_steps``).
        at_steps: Extra steps to evaluate at (the paper: 200, 300, 400, 800); 0 evaluates before training.
        data_dir: Folder of local benchmark copies under their usual names (``../shared/data``); ``null`` reads
            each benchmark from its hub dataset (``lit_gmc.data.benchmarks.BENCHMARKS``).
        sources: Per-benchmark override of both: a local JSONL file, a dataset folder laid out like the hub
            repository, or another hub name.
        samples: Samples per problem for avg@n and pass@k; ``null`` takes the paper's n (16 for MATH-500,
            Minerva and AMC23, 8 otherwise).
        ks: pass@k sizes (those above a benchmark's n are skipped).
        max_new_tokens: Completion budget.
        max_prompt_tokens: Prompt budget (longer prompts lose their beginning); ``null`` keeps them whole.
        max_problems: Only the first problems of each benchmark (quick checks); ``null`` runs all.
        seed: Seed of the sampling noise (the same at every evaluation, so steps are compared on equal terms).
        verifier_workers: Processes that check answers.
        engine: Engine to generate with; ``null`` takes ``trainer.datamodule.rollout_engine`` at setup.
        tokenizer: Tokenizer to decode (and count prompt tokens) with; ``null`` takes ``trainer.datamodule.tokenizer``.
        scorer: Reward of a completion; ``null`` builds the MATH scorer (last ``\boxed{}`` + math-verify).
        cut_at_next_problem: For the built scorer: score only the text before an invented next ``Problem:``
            line (a deviation from the paper, which scores the whole completion); match the training reward's.
    """

    def __init__(
        self,
        benchmarks: Sequence[str] = PAPER_BENCHMARKS,
        every_n_steps: int | None = None,
        at_steps: Sequence[int] = (),
        data_dir: str | None = None,
        sources: dict[str, str] | None = None,
        samples: int | None = None,
        ks: Sequence[int] = PAPER_KS,
        max_new_tokens: int = 4096,
        max_prompt_tokens: int | None = None,
        max_problems: int | None = None,
        seed: int = 0,
        verifier_workers: int = 2,
        engine: GenerationEngine | None = None,
        tokenizer: Any = None,
        scorer: Scorer | None = None,
        cut_at_next_problem: bool = False,
    ) -> None:
        problems = []
        if not benchmarks:
            problems.append("benchmarks must name at least one benchmark")
        if every_n_steps is not None and every_n_steps < 1:
            problems.append(f"every_n_steps={every_n_steps} must be >= 1 (or null)")
        if any(step < 0 for step in at_steps):
            problems.append(f"at_steps={list(at_steps)} must be >= 0")
        if samples is not None and samples < 1:
            problems.append(f"samples={samples} must be >= 1 (or null for the paper's n)")
        if max_new_tokens < 1:
            problems.append(f"max_new_tokens={max_new_tokens} must be >= 1")
        if max_problems is not None and max_problems < 1:
            problems.append(f"max_problems={max_problems} must be >= 1 (or null)")
        if problems:
            from lit_gmc.errors import UserError  # here and in setup: importing this module pulls in nothing of ours

            raise UserError("invalid Evaluation options:\n  " + "\n  ".join(problems))
        self.benchmarks = list(benchmarks)
        self.every_n_steps = every_n_steps
        self.at_steps = sorted(set(at_steps))
        self.data_dir, self.sources, self.samples, self.ks = data_dir, dict(sources or {}), samples, tuple(ks)
        self.max_new_tokens, self.max_prompt_tokens, self.max_problems = max_new_tokens, max_prompt_tokens, max_problems
        self.seed, self.verifier_workers, self.cut_at_next_problem = seed, verifier_workers, cut_at_next_problem
        self._given = {"engine": engine, "tokenizer": tokenizer, "scorer": scorer}
        self.engine, self.tokenizer, self.scorer = engine, tokenizer, scorer
        self.suites: list[Suite] = []
        self.active = True  # False on ranks other than 0 when the engine is the DataModule's (set in setup)
        self.history: list[dict[str, Any]] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            benchmarks=self.benchmarks, every_n_steps=self.every_n_steps, at_steps=self.at_steps
        )

    def due(self, step: int) -> bool:
        """Whether ``step`` is an evaluation step."""
        periodic = self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0
        return periodic or step in self.at_steps

    @property
    def evaluated_steps(self) -> list[int]:
        """Steps already evaluated (restored from checkpoints, so a resumed run does not repeat them)."""
        return [entry["step"] for entry in self.history]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lit_gmc.data.benchmarks import BENCHMARKS, BenchmarkUnreachable, load_benchmark
        from lit_gmc.data.math_data import MathScorer, make_prompts
        from lit_gmc.errors import UserError

        unknown = [name for name in self.benchmarks if name not in BENCHMARKS]
        if unknown:
            raise UserError(f"Evaluation: unknown benchmarks {unknown} in benchmarks; known: {', '.join(BENCHMARKS)}")
        self.active = trainer.global_rank == 0 or self._given["engine"] is not None
        if not self.active:
            return  # the rollout engine lives on rank 0, which evaluates every problem
        # Re-read every setup: a DataModule builds a new engine for each fit.
        self.engine = self._given["engine"] or getattr(trainer.datamodule, "rollout_engine", None)
        self.tokenizer = self._given["tokenizer"] or getattr(trainer.datamodule, "tokenizer", None)
        if not isinstance(self.engine, GenerationEngine):
            raise TypeError(
                "Evaluation needs an engine with generate(prompts, n, sampling): pass `engine`, or use a DataModule "
                f"with a `rollout_engine` attribute set up before callbacks (got {type(self.engine).__name__})"
            )
        if not callable(getattr(self.tokenizer, "batch_decode", None)):
            raise TypeError(
                "Evaluation needs a tokenizer with batch_decode: pass `tokenizer`, or use a DataModule with one"
            )
        self.scorer = (
            self._given["scorer"]
            or self.scorer
            or MathScorer(num_workers=self.verifier_workers, cut_at_next_problem=self.cut_at_next_problem)
        )
        self.suites = []
        for name in self.benchmarks:
            try:
                bench = load_benchmark(name, source=self.sources.get(name), data_dir=self.data_dir)
            except BenchmarkUnreachable as err:
                raise UserError(
                    f"Evaluation: {err}; set the callback's data_dir (a folder of local copies) or sources"
                ) from err
            except UserError as err:  # names the file and line; say whose option gave it
                raise UserError(f"Evaluation: {err}") from err
            items = bench.items[: self.max_problems]
            prompts = make_prompts([(i, it.problem, it.answer) for i, it in enumerate(items)], self.tokenizer,
                                   self.max_prompt_tokens)  # fmt: skip
            n = self.samples or bench.samples
            self.suites.append(Suite(name, bench.title, prompts, n, tuple(k for k in self.ks if k <= n)))

    def run(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Evaluate now, log the scalars at ``trainer.global_step`` and append to the history."""
        step = trainer.global_step
        version = getattr(self.engine, "version", step)
        if version != step:
            rank_zero_warn(f"Evaluation at step {step} uses engine weights of version {version} (publish every step)")
        results = evaluate_suites(self.engine, self.tokenizer, self.scorer, self.suites, self.max_new_tokens, self.seed)
        for logger in trainer.loggers:
            logger.log_metrics(scalars_of(results), step=step)
        entry = {"step": step, "version": version, **results}
        self.history.append(entry)
        if trainer.is_global_zero and trainer.log_dir is not None:
            out = Path(trainer.log_dir) / "eval" / f"step_{step}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(entry, indent=2))
        return results

    def _maybe_run(self, trainer: pl.Trainer, after_update: bool = False) -> None:
        step = trainer.global_step
        if not self.active or not self.due(step) or step in self.evaluated_steps:
            return
        if after_update and getattr(self.engine, "version", step) != step:
            return  # the new weights are not published yet (a sync callback after this one): next batch start
        self.run(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._maybe_run(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Right after the update, before Lightning's checkpoint callbacks (which it always runs last): a checkpoint
        # taken at this step then holds this evaluation in its history, and a run resumed from it does not redo it.
        self._maybe_run(trainer, after_update=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_run(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._given["scorer"] is None and self.scorer is not None:
            self.scorer.close()  # ours: stop its worker processes
            self.scorer = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict["history"])

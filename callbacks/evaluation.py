r"""Evaluate the policy on benchmarks during training: greedy accuracy, avg@n and pass@k, to TensorBoard.

The callback generates through any :class:`GenerationEngine` (by default the DataModule's ``rollout_engine``) once
the step's weights are published, and records the policy version it evaluated. A benchmark is one of the paper's six
by name, or a :class:`BenchmarkFile` of the user's own; ``lit_gmc.data`` is imported only in ``setup``.
:func:`evaluate_suites` is the core shared with ``scripts/evaluate.py``; the contract is in ``docs/callbacks.md``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lit_gmc.callbacks.metrics import PAPER_KS, AvgAtN, GreedyAccuracy, MacroAverage, PassAtK

PAPER_BENCHMARKS: tuple[str, ...] = ("math500", "gsm8k", "gaokao2023en", "olympiadbench", "minerva", "amc23")


@runtime_checkable
class GenerationEngine(Protocol):
    """What evaluation needs from a rollout engine: ``n`` responses per prompt, one group per prompt.

    ``prompts`` have ``text`` and ``answer``; ``sampling`` has ``temperature`` (0: greedy), ``top_p``,
    ``max_new_tokens`` and ``seed``; each group has ``(n, L)`` ``response_ids``. An engine's ``version`` (the
    optimizer steps its weights include), if it has one, is recorded with each evaluation.
    """

    def generate(self, prompts: Sequence[Any], n: int, sampling: Any) -> list[Any]:
        """Responses to ``prompts`` (objects with ``text``), sampled as ``sampling`` says."""


class Scorer(Protocol):
    """Rewards in ``[0, 1]`` of ``(completion, reference answer)`` pairs."""

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """One reward per pair."""


@dataclass(frozen=True)
class BenchmarkFile:
    """A benchmark of the user's own: a JSON/JSONL file (read with ``datasets``), its prompt and its scorer.

    Attributes:
        name: Its name in the logged tags (``eval/<name>/greedy``...) and in the results.
        path: The JSON or JSONL file, one problem a row.
        question: Column of the question.
        answer: Column of the reference answer (text, or a number: ``27.0`` is read as ``27``).
        template: The prompt: a format string with a ``{question}`` field (other braces doubled, ``{{}}``), or a
            callable ``question -> prompt``, or its import path (``"my_project.prompts.two_shot"``;
            ``"lit_gmc.data.tasks.math_data.build_prompt"`` is the paper's two-shot math prompt).
        scorer: A callable ``(completions, answer) -> list[float]``, 1.0 for a correct completion and 0.0
            otherwise, or its import path; ``None`` takes the callback's ``scorer`` (a file without either is refused).
        samples: Samples per problem for avg@n and pass@k (the callback's ``samples``, when set, overrides it).
        title: Display name; ``None`` is ``name``.
    """

    name: str
    path: str
    question: str = "question"
    answer: str = "answer"
    template: str | Callable[[str], str] = "{question}"
    scorer: str | Callable[[Sequence[str], str], Sequence[float]] | None = None
    samples: int = 8
    title: str | None = None


@dataclass
class Suite:
    """One benchmark ready to run: its prompts (with reference answers), samples per problem and pass@k sizes.

    ``scorer`` is the benchmark's own; ``None`` takes the one :func:`evaluate_suites` is given.
    """

    name: str
    title: str
    prompts: list[Any]
    n: int
    ks: tuple[int, ...]
    scorer: Scorer | None = None
    skipped: int = 0  # rows left out for an empty reference answer (they could only score 0), reported as such


def file_suite(
    spec: BenchmarkFile,
    tokenizer: Any,
    default_scorer: Callable[[], Scorer],
    ks: Sequence[int],
    samples: int | None = None,
    max_problems: int | None = None,
    max_prompt_tokens: int | None = None,
) -> Suite:
    """The suite of a :class:`BenchmarkFile`: its rows, prompts from its template, its scorer.

    ``default_scorer()`` scores a file without one; ``samples`` overrides the file's own (``ks`` above it left out);
    ``tokenizer`` counts prompt tokens. A ``UserError`` names the benchmark for a bad template, scorer or file.
    """
    from lit_gmc.data.tasks.base import Prompt, truncate_prompt
    from lit_gmc.data.tasks.benchmarks import CompletionScorer, load_file_items, prompt_builder, resolve_callable
    from lit_gmc.errors import UserError

    try:
        build = prompt_builder(spec.template, "template")
        scorer = (
            default_scorer()
            if spec.scorer is None
            else CompletionScorer(resolve_callable(spec.scorer, "scorer"), repr(spec.scorer))
        )
        items, skipped = load_file_items(spec.path, question=spec.question, answer=spec.answer)
        items = items[:max_problems]
        texts = [build(item.problem) for item in items]
        if max_prompt_tokens is not None:
            texts = [truncate_prompt(text, tokenizer, max_prompt_tokens) for text in texts]
    except (UserError, ValueError) as err:
        raise UserError(f"benchmark {spec.name!r}: {err}") from err
    prompts = [Prompt(i, text, item.answer) for i, (text, item) in enumerate(zip(texts, items, strict=True))]
    n = samples or spec.samples
    return Suite(spec.name, spec.title or spec.name, prompts, n, tuple(k for k in ks if k <= n), scorer, len(skipped))


def correctness(
    engine: GenerationEngine,
    tokenizer: Any,
    scorer: Scorer,
    prompts: Sequence[Any],
    n: int,
    sampling: Any,
    samples: list[dict[str, Any]] | None = None,
    labels: Mapping[str, Any] | None = None,
) -> Tensor:
    """``(P, n)`` 0/1 correctness of ``n`` responses to each prompt.

    With ``samples``, one row per response is appended to it: ``labels``, then ``problem`` (the prompt's index),
    ``sample``, ``prompt``, ``answer``, ``completion`` and ``correct``.
    """
    if not prompts:
        return torch.zeros(0, n)
    groups = engine.generate(prompts, n, sampling)
    pairs = []
    for prompt, group in zip(prompts, groups, strict=True):
        texts = tokenizer.batch_decode(group.response_ids.tolist(), skip_special_tokens=True)
        pairs.extend((text, prompt.answer) for text in texts)
    values = scorer.score_pairs(pairs)
    if samples is not None:
        for index, ((text, answer), value) in enumerate(zip(pairs, values, strict=True)):
            problem, sample = divmod(index, n)
            samples.append({**(labels or {}), "problem": problem, "sample": sample, "prompt": prompts[problem].text,
                            "answer": answer, "completion": text, "correct": float(value)})  # fmt: skip
    return torch.tensor(values, dtype=torch.float64).view(len(prompts), n)


def evaluate_suites(
    engine: GenerationEngine,
    tokenizer: Any,
    scorer: Scorer | None,
    suites: Sequence[Suite],
    max_new_tokens: int,
    seed: int = 0,
    samples: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Greedy (T = 0) and sampled (T = 1, top-p 1) evaluation of every suite, with macro averages.

    Each suite is scored by its own scorer, else by ``scorer``; with ``samples``, every completion is appended to it
    (:func:`correctness`), labelled with its ``benchmark`` and ``mode``. Returns ``{"benchmarks": {name: {"title",
    "problems", "n", "greedy", "avg@n", "pass@k"...}}, "macro": {"greedy", "avg@n"}}`` of this process's problems,
    not synced: an evaluating process scores every problem (under DDP rank 0 alone evaluates).
    """
    from lit_gmc.data.engines.base import SamplingParams

    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    sampled = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    names = [s.name for s in suites]
    local = {"sync_on_compute": False}
    macro_greedy, macro_avg = MacroAverage(names, **local), MacroAverage(names, **local)
    results: dict[str, Any] = {"benchmarks": {}}
    for suite in suites:
        scores = suite.scorer or scorer
        if scores is None:
            raise ValueError(f"benchmark {suite.name!r} has no scorer of its own and none was given")
        first = correctness(engine, tokenizer, scores, suite.prompts, 1, greedy, samples,
                            {"benchmark": suite.name, "mode": "greedy"})[:, 0]  # (P,)  # fmt: skip
        many = correctness(engine, tokenizer, scores, suite.prompts, suite.n, sampled, samples,
                           {"benchmark": suite.name, "mode": "sampled"})  # (P, n)  # fmt: skip
        accuracy, avg, pass_k = GreedyAccuracy(**local), AvgAtN(suite.n, **local), PassAtK(suite.n, suite.ks, **local)
        for metric, values in ((accuracy, first), (avg, many), (pass_k, many)):
            metric.update(values)
        macro_greedy.update(suite.name, first)
        macro_avg.update(suite.name, many.mean(dim=1))
        entry = {"title": suite.title, "problems": len(suite.prompts), "skipped": suite.skipped, "n": suite.n}
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
    r"""Evaluate on benchmarks every ``every_n_steps`` optimizer steps and at ``at_steps``.

    Args:
        benchmarks: Each a registered benchmark's name (``math500``, ``gsm8k``, ``gaokao2023en``, ``olympiadbench``,
            ``minerva``, ``amc23``) or a :class:`BenchmarkFile` (in YAML, a mapping: ``{name: sums, path: sums.jsonl,
            template: "{question}=", scorer: my_project.exact}``).
        every_n_steps: Period in optimizer steps (``null``: only ``at_steps``).
        at_steps: Extra steps to evaluate at (the paper: 200, 300, 400, 800); 0 evaluates before training.
        data_dir: Folder of local benchmark copies (``math500_test.jsonl``, ...); ``null``: their hub datasets.
        sources: Per-benchmark override of both: a JSONL file, a dataset folder laid out like the hub's, a hub name.
        samples: Samples per problem for avg@n and pass@k; ``null``: the paper's (16: MATH-500, Minerva, AMC23; else 8).
        ks: pass@k sizes (those above a benchmark's n are skipped).
        max_new_tokens: Completion budget.
        max_prompt_tokens: Prompt budget (longer prompts lose their beginning); ``null`` keeps them whole.
        max_problems: Only the first problems of each benchmark (quick checks); ``null`` runs all.
        seed: Seed of the sampling noise (the same at every evaluation, so steps are compared on equal terms).
        verifier_workers: Processes that check answers.
        engine: Engine to generate with; ``null`` takes ``trainer.datamodule.rollout_engine`` at setup.
        tokenizer: Tokenizer to decode and count prompt tokens with; ``null`` takes ``trainer.datamodule.tokenizer``.
        scorer: Reward of a completion for the registered benchmarks and for files without a scorer of their own;
            ``null`` builds the MATH scorer (last ``\boxed{}`` + math-verify) for the registered ones.
        cut_at_next_problem: For the built scorer: score only the text before an invented next ``Problem:``
            line (a deviation from the paper, which scores the whole completion); match the training reward's.
        chat_template: Wrap each prompt, after the ``max_prompt_tokens`` cut, in the tokenizer's chat template, as
            ``--data.chat_template`` does for training prompts (set both alike for an instruction-tuned actor).
    """

    def __init__(
        self,
        benchmarks: Sequence[str | BenchmarkFile] = PAPER_BENCHMARKS,
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
        chat_template: bool = False,
    ) -> None:
        problems = [f"benchmarks: {spec!r} is neither a benchmark's name nor a BenchmarkFile" for spec in benchmarks
                    if not isinstance(spec, (str, BenchmarkFile))]  # fmt: skip
        names = [] if problems else [spec if isinstance(spec, str) else spec.name for spec in benchmarks]
        if not benchmarks:
            problems.append("benchmarks must name at least one benchmark")
        if len(set(names)) != len(names):
            problems.append(f"benchmarks {names} must have distinct names")
        files = [spec for spec in benchmarks if isinstance(spec, BenchmarkFile)]
        problems += [f"benchmarks {spec.name!r}: samples={spec.samples} must be >= 1" for spec in files
                     if spec.samples < 1]  # fmt: skip
        unscored = [spec for spec in files if spec.scorer is None] if scorer is None else []
        # refused, as by scripts/evaluate.py: the math scorer would score a file's own answers 0.0 without a word
        problems += [f"benchmarks {spec.name!r}: {spec.path} has no scorer; give it one (an import path, e.g. "
                     "my_project.exact_match) or give the callback's scorer" for spec in unscored]  # fmt: skip
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
        self.names = names
        self.every_n_steps = every_n_steps
        self.at_steps = sorted(set(at_steps))
        self.data_dir, self.sources, self.samples, self.ks = data_dir, dict(sources or {}), samples, tuple(ks)
        self.max_new_tokens, self.max_prompt_tokens, self.max_problems = max_new_tokens, max_prompt_tokens, max_problems
        self.seed, self.verifier_workers, self.cut_at_next_problem = seed, verifier_workers, cut_at_next_problem
        self.chat_template = chat_template
        self._given = {"engine": engine, "tokenizer": tokenizer, "scorer": scorer}
        self.engine, self.tokenizer, self.scorer = engine, tokenizer, scorer
        self.suites: list[Suite] = []
        self.active = True  # False on ranks other than 0 when the engine is the DataModule's (set in setup)
        self.history: list[dict[str, Any]] = []
        self.log_dir: str | None = None  # where rank 0 writes eval/step_<n>.json (read in setup)

    @property
    @override
    def state_key(self) -> str:
        # Names only: a BenchmarkFile may hold a callable, whose repr changes from run to run.
        return self._generate_state_key(benchmarks=self.names, every_n_steps=self.every_n_steps, at_steps=self.at_steps)

    @property
    def evaluated_steps(self) -> list[int]:
        """Steps already evaluated (restored from checkpoints, so a resumed run does not repeat them)."""
        return [entry["step"] for entry in self.history]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lit_gmc.data.tasks.base import prompts_in_chat_template
        from lit_gmc.data.tasks.benchmarks import BENCHMARKS, BenchmarkUnreachable
        from lit_gmc.errors import UserError

        unknown = [spec for spec in self.benchmarks if isinstance(spec, str) and spec not in BENCHMARKS]
        if unknown:
            raise UserError(f"Evaluation: unknown benchmarks {unknown} in benchmarks; known: {', '.join(BENCHMARKS)}"
                            " (or a BenchmarkFile for a file of your own)")  # fmt: skip
        # Read here, on every rank: under DDP Trainer.log_dir is a broadcast from rank 0, which waits forever when
        # rank 0 alone evaluates.
        self.log_dir = trainer.log_dir
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
                "Evaluation needs a tokenizer with batch_decode(rows, skip_special_tokens=True): pass `tokenizer`, "
                f"or use a DataModule with a `tokenizer` attribute (got {type(self.tokenizer).__name__})"
            )
        try:
            self.suites = [self.suite(spec) for spec in self.benchmarks]
        except BenchmarkUnreachable as err:
            raise UserError(
                f"Evaluation: {err}; set the callback's data_dir (a folder of local copies) or sources"
            ) from err
        except UserError as err:  # it names the benchmark, the file and line: say whose option gave it
            raise UserError(f"Evaluation: {err}") from err
        if self.chat_template:  # after the max_prompt_tokens cut, as for training prompts
            for suite in self.suites:
                suite.prompts = prompts_in_chat_template(suite.prompts, self.tokenizer, "Evaluation chat_template")

    def math_scorer(self) -> Scorer:
        """The scorer given, else the MATH scorer, built once (its verifier processes start on first need)."""
        if self.scorer is None:
            from lit_gmc.data.tasks.verifier import MathVerifier

            self.scorer = MathVerifier(num_workers=self.verifier_workers, cut_at_next_problem=self.cut_at_next_problem)
        return self.scorer

    def suite(self, spec: str | BenchmarkFile) -> Suite:
        """A benchmark's suite: a user's file with its own template and scorer, or a named one with the math ones."""
        if isinstance(spec, BenchmarkFile):
            return file_suite(spec, self.tokenizer, self.math_scorer, self.ks, self.samples, self.max_problems,
                              self.max_prompt_tokens)  # fmt: skip
        from lit_gmc.data.tasks.benchmarks import load_benchmark
        from lit_gmc.data.tasks.math_data import make_prompts

        bench = load_benchmark(spec, source=self.sources.get(spec), data_dir=self.data_dir)
        items = bench.items[: self.max_problems]
        prompts = make_prompts([(i, it.problem, it.answer) for i, it in enumerate(items)], self.tokenizer,
                               self.max_prompt_tokens)  # fmt: skip
        n = self.samples or bench.samples
        ks = tuple(k for k in self.ks if k <= n)
        return Suite(spec, bench.title, prompts, n, ks, self.math_scorer(), len(bench.skipped))

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
        if trainer.is_global_zero and self.log_dir is not None:
            out = Path(self.log_dir) / "eval" / f"step_{step}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(entry, indent=2))
        return results

    def _maybe_run(self, trainer: pl.Trainer, after_update: bool = False) -> None:
        step = trainer.global_step
        due = self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0 or step in self.at_steps
        if not self.active or not due or step in self.evaluated_steps:
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
        self.scorer = self._given["scorer"]

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict["history"])

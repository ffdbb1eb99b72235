"""``Math``: the paper's training task as a component (``data.task: Math``): MATH prompts, math-verify reward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from lit_gmc.data.tasks.base import Prompt, Task
from lit_gmc.data.tasks.math_data import MATH_TRAIN_SOURCE, is_local, load_math_train, make_prompts
from lit_gmc.data.tasks.verifier import MathVerifier
from lit_gmc.options import check_options


class Math(Task):
    r"""MATH training prompts (two-shot), MATH-500 as held-out prompts, and the paper's math-verify reward.

    Args:
        path: MATH training data: ``null`` for the hub source, or a local JSON/JSONL file or dataset folder with
            ``problem`` and ``solution`` (e.g. ``data/math_train.jsonl``).
        test_path: Held-out prompts for evaluation: ``null`` for MATH-500 from the hub, or a local file or folder.
        max_prompt_tokens: Prompt budget in tokens (the paper's 1,024); longer prompts lose their beginning;
            ``null``: whole. It cuts the two-shot text before any chat template (``--data.max_prompt_tokens``
            cuts the final text: leave it null for the paper's setup).
        tokenizer: Tokenizer (actor name or path) that counts prompt tokens; ``null``: the rollout engine's.
        split: Split of a hub or folder training dataset (``null``: the source's own).
        config: Config of a hub training dataset (``null``: the source's own).
        verifier_workers: Processes that run math-verify.
        verify_timeout_s: Wall-clock bound on checking one response; a slower check scores 0.
        cut_at_next_problem: Score only the text before an invented next ``Problem:`` line (the paper scores the
            whole completion).
    """

    # Options a resume may change (lit_gmc.resume asks the class): neither changes the training prompts or rewards.
    may_change_on_resume: ClassVar[frozenset[str]] = frozenset({"test_path", "verifier_workers"})

    def __init__(
        self,
        path: str | None = None,
        test_path: str | None = None,
        max_prompt_tokens: int | None = None,
        tokenizer: str | None = None,
        split: str | None = None,
        config: str | None = None,
        verifier_workers: int = 2,
        verify_timeout_s: float = 10.0,
        cut_at_next_problem: bool = False,
    ) -> None:
        check_options("Math", self.option_problems(max_prompt_tokens, verifier_workers, verify_timeout_s))
        self.max_prompt_tokens = max_prompt_tokens
        self.test_path = test_path
        problems = load_math_train(path, split=split, config=config).problems  # now: a bad file fails at start-up
        self._triples = [(p.id, p.problem, p.answer) for p in problems]
        self.tokenizer: Any = None
        if tokenizer is not None:
            from lit_gmc.actor import load_tokenizer  # lazy: transformers, only needed to count prompt tokens

            self.tokenizer = load_tokenizer(tokenizer, "--data.task.tokenizer")
        self._train: list[Prompt] | None = None
        self._test: list[Prompt] | None = None
        self.scorer = MathVerifier(verifier_workers, verify_timeout_s, cut_at_next_problem=cut_at_next_problem)

    @staticmethod
    def option_problems(max_prompt_tokens: int | None, verifier_workers: int, verify_timeout_s: float) -> list[str]:
        """Every problem with the options, named by their init args."""
        problems = []
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            problems.append(f"max_prompt_tokens={max_prompt_tokens} must be >= 1 (or null: whole prompts)")
        if verifier_workers < 1:
            problems.append(f"verifier_workers={verifier_workers} must be >= 1")
        if not verify_timeout_s > 0:
            problems.append(f"verify_timeout_s={verify_timeout_s} must be > 0")
        return problems

    @staticmethod
    def preflight_problems(path: str | None = None, tokenizer: str | None = None, **_: Any) -> list[str]:
        """Why the training data or ``tokenizer`` cannot be read (missing, or the hub out of reach), before loading."""
        from lit_gmc.preflight import source_problem

        source = path or MATH_TRAIN_SOURCE.path
        problems = [source_problem(source, "dataset", "--data.task.path", is_local(source))]
        if tokenizer is not None and tokenizer != "tiny":
            problems.append(source_problem(tokenizer, "model", "--data.task.tokenizer", is_local(tokenizer)))
        return [problem for problem in problems if problem]

    def setup(self, tokenizer: Any) -> None:
        """Count prompt tokens with the engine's ``tokenizer`` unless the ``tokenizer`` option names another."""
        if self.tokenizer is None:
            self.tokenizer = tokenizer

    def train_prompts(self) -> Sequence[Prompt]:
        """Two-shot prompts of the kept training rows, in file order."""
        if self._train is None:
            self._train = make_prompts(self._triples, self.tokenizer, self.max_prompt_tokens)
        return self._train

    def test_prompts(self) -> Sequence[Prompt]:
        """MATH-500 prompts (same template and truncation), loaded on first call."""
        if self._test is None:
            from lit_gmc.data.tasks.benchmarks import load_benchmark

            items = load_benchmark("math500", source=self.test_path).items
            triples = [(i, item.problem, item.answer) for i, item in enumerate(items)]
            self._test = make_prompts(triples, self.tokenizer, self.max_prompt_tokens)
        return self._test

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        """1.0 per completion whose last box is equivalent to ``answer`` under math-verify, else 0.0."""
        return self.scorer.score(completions, answer)

    def close(self) -> None:
        """Stop the verifier's worker processes."""
        self.scorer.close()

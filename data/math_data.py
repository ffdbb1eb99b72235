r"""The paper's training task: MATH (Hendrycks et al. 2021) with a two-shot ``\boxed{}`` prompt and math-verify rewards.

All loading goes through the ``datasets`` library (``load_dataset("json", data_files=...)`` for a local
file, the hub name otherwise), so users get its caching. Every row is checked: a missing field or one of
the wrong type is an error naming the file and line. The reference answer of a training row is the last
complete ``\boxed{...}`` of its ``solution`` by our own extractor (the file's precomputed ``answer`` is
not trusted); rows without one are dropped and counted (on the shipped file: the 2 of 7,500 that write
``\boxed 2`` without braces, leaving the paper's 7,498). Two rows close an empty ``\boxed{}``: their answer
is extractable (the empty string), so they are kept as the paper's count implies, and always score 0.
The two worked examples of the prompt are training problems, removed from the training prompts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lit_gmc.data.answers import last_boxed

if TYPE_CHECKING:  # tasks.py registers MathTask, so it imports this module; Prompt is imported where it is used
    from lit_gmc.data.tasks import Prompt

DEFAULT_TRAIN_PATH = "../shared/data/math_train.jsonl"
DEFAULT_TEST_PATH = "../shared/data/math500_test.jsonl"
LOCAL_SUFFIXES = (".json", ".jsonl")

INSTRUCTION = (
    "Solve each math problem below. Think it through step by step, showing your reasoning, and write the "
    "final answer inside \\boxed{} at the end."
)


@dataclass(frozen=True)
class WorkedExample:
    """One shot of the prompt: a training problem (verbatim, by id) and a solution written for this project."""

    unique_id: str
    problem: str
    solution: str


# Two short training problems of different kinds (an integer, a fraction), solved in our own words.
WORKED_EXAMPLES: tuple[WorkedExample, ...] = (
    WorkedExample(
        unique_id="train/algebra/1956.json",
        problem="Given that $2^x+ 2^x+ 2^x+ 2^x= 512$, what is the value of $x$?",
        solution=(
            "The left side adds four equal terms, so it equals $4 \\cdot 2^x = 2^2 \\cdot 2^x = 2^{x+2}$. "
            "Since $512 = 2^9$, we need $2^{x+2} = 2^9$, which means $x + 2 = 9$. "
            "The final answer is $\\boxed{7}$."
        ),
    ),
    WorkedExample(
        unique_id="train/prealgebra/698.json",
        problem="What is the arithmetic mean of $\\frac{2}{5}$ and $\\frac{4}{7}$ ? Express your answer as a common "
        "fraction.",
        solution=(
            "The mean of two numbers is half of their sum. With the common denominator $35$ we have "
            "$\\frac{2}{5} = \\frac{14}{35}$ and $\\frac{4}{7} = \\frac{20}{35}$, so the sum is $\\frac{34}{35}$ "
            "and half of it is $\\frac{17}{35}$. The final answer is $\\boxed{\\frac{17}{35}}$."
        ),
    ),
)

PROBLEM_MARK = "Problem:"


def build_prompt(problem: str) -> str:
    """The two-shot prompt for one problem; the same text is used for training and for every benchmark."""
    shots = "".join(f"{PROBLEM_MARK} {ex.problem}\nSolution: {ex.solution}\n\n" for ex in WORKED_EXAMPLES)
    return f"{INSTRUCTION}\n\n{shots}{PROBLEM_MARK} {problem.strip()}\nSolution:"


def answer_region(completion: str) -> str:
    """The part of a completion that answers the prompt's problem: everything before a new ``Problem:`` line.

    Why: a base model continuing a few-shot prompt often goes on to invent the next problem and box its
    answer; that box is not the answer to the question asked, so the reward reads only the text before it.
    """
    cut = completion.find(f"\n{PROBLEM_MARK}")
    return completion if cut == -1 else completion[:cut]


def truncate_prompt(text: str, tokenizer: Any, max_tokens: int) -> str:
    """``text`` with its beginning cut so that it tokenizes to at most ``max_tokens`` tokens.

    The end is kept because it holds the problem and the ``Solution:`` cue the model continues from. Only a
    tail window of the text is tokenized (8 characters per allowed token, widened until it holds more than
    ``max_tokens`` tokens or the whole text), so cutting a long prompt to a short budget stays cheap. The cut
    falls on a token boundary from the fast tokenizer's offsets, then moves right until re-tokenizing the
    kept text really fits (BPE merges can differ at the new start).

    Raises:
        ValueError: If ``max_tokens < 1`` or the tokenizer cannot report character offsets (not a fast tokenizer).
    """
    if max_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_tokens}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("prompt truncation needs a fast tokenizer (character offsets of tokens)")
    window = 8 * max_tokens
    while True:
        start = max(0, len(text) - window)
        piece = text[start:]
        offsets = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) > max_tokens or start == 0:
            break
        window *= 4
    if len(offsets) <= max_tokens:
        return text
    for index in range(len(offsets) - max_tokens, len(offsets)):
        kept = piece[offsets[index][0] :]
        if len(tokenizer(kept, add_special_tokens=False)["input_ids"]) <= max_tokens:
            return kept
    return ""


def is_local(source: str) -> bool:
    """A path to a local JSON/JSONL file (existing, or named like one) rather than a hub dataset name."""
    return Path(source).exists() or source.endswith(LOCAL_SUFFIXES)


def _line_of_row(path: Path, row: int) -> int:
    """1-based line of the ``row``-th non-blank line of a JSONL file (the datasets JSON reader skips blank lines)."""
    seen = -1
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                seen += 1
                if seen == row:
                    return number
    return row + 1


def _first_bad_json_line(path: Path) -> tuple[int, str] | None:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as err:
                    return number, str(err)
    return None


def load_records(
    source: str, fields: Mapping[str, type | tuple[type, ...]], split: str = "train", config: str | None = None
) -> list[dict[str, Any]]:
    """Rows of a local JSON/JSONL file or a hub dataset, each checked to have ``fields`` of the given types.

    Args:
        source: Local ``.json``/``.jsonl`` path, or a hub dataset name.
        fields: Required field -> accepted type(s). Other fields are dropped.
        split: Split of a hub dataset (a local file is one split).
        config: Config name of a hub dataset.

    Raises:
        FileNotFoundError: A local path that does not exist.
        ValueError: Invalid JSON, a missing field or a field of the wrong type, naming the file and line.
    """
    import datasets  # heavy; only needed when data is actually loaded

    local = is_local(source)
    path = Path(source)
    if local and not path.is_file():
        raise FileNotFoundError(f"data file not found: {source} (resolved to {path.resolve()})")
    try:
        if local:
            table = datasets.load_dataset("json", data_files=str(path), split="train")
        else:
            table = datasets.load_dataset(source, config, split=split)
    except datasets.exceptions.DatasetGenerationError as err:
        bad = _first_bad_json_line(path) if local else None
        if bad is not None:
            raise ValueError(f"{source}:{bad[0]}: not valid JSON ({bad[1]})") from err
        raise ValueError(f"{source}: could not be read as a dataset ({err.__cause__ or err})") from err
    missing = [name for name in fields if name not in table.column_names]
    if missing:
        raise ValueError(f"{source}: no field {', '.join(map(repr, missing))} in any row (has {table.column_names})")
    rows = table.select_columns(list(fields)).to_list()
    for index, row in enumerate(rows):
        for name, kind in fields.items():
            value = row[name]
            if value is None:
                raise ValueError(f"{row_location(source, index, split)}: missing field {name!r}")
            if not isinstance(value, kind) or isinstance(value, bool):
                expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
                got = type(value).__name__
                raise ValueError(f"{row_location(source, index, split)}: field {name!r} must be {expected}, got {got}")
    return rows


def row_location(source: str, index: int, split: str = "train") -> str:
    """Where row ``index`` of a source is, for error messages: ``file:line`` locally, the row number on the hub."""
    if is_local(source):
        return f"{source}:{_line_of_row(Path(source), index)}"
    return f"{source} (split {split!r}) row {index}"


@dataclass(frozen=True)
class MathProblem:
    """One training problem: ``id`` is its row index in the source, ``answer`` the extracted reference."""

    id: int
    problem: str
    answer: str


@dataclass
class MathTrainSet:
    r"""The MATH training rows kept, and what was left out.

    Attributes:
        problems: Rows with an extractable answer, minus the prompt's worked examples.
        rows: Rows read.
        no_answer: Row indices whose solution has no complete ``\boxed{}`` (dropped).
        held_out: Row indices of the prompt's worked examples (excluded from training).
    """

    problems: list[MathProblem]
    rows: int
    no_answer: list[int] = field(default_factory=list)
    held_out: list[int] = field(default_factory=list)

    @property
    def with_answer(self) -> int:
        """Rows whose reference answer could be extracted (7,498 on the shipped file)."""
        return self.rows - len(self.no_answer)


def load_math_train(source: str = DEFAULT_TRAIN_PATH, split: str = "train", config: str | None = None) -> MathTrainSet:
    """Load MATH training problems with references extracted from ``solution`` (see the module docstring)."""
    rows = load_records(source, {"problem": str, "solution": str}, split=split, config=config)
    shots = {ex.problem.strip() for ex in WORKED_EXAMPLES}
    kept, no_answer, held_out = [], [], []
    for index, row in enumerate(rows):
        answer = last_boxed(row["solution"])
        if answer is None:
            no_answer.append(index)
        elif row["problem"].strip() in shots:
            held_out.append(index)
        else:
            kept.append(MathProblem(index, row["problem"], answer))
    return MathTrainSet(kept, len(rows), no_answer, held_out)


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object as is, or one loaded from an actor name (``"tiny"``, a hub name or a path)."""
    if not isinstance(tokenizer, str):
        return tokenizer
    from transformers import AutoTokenizer  # lazy: only needed to truncate prompts

    from lit_gmc.actor import resolve_actor_path

    return AutoTokenizer.from_pretrained(resolve_actor_path(tokenizer))


def make_prompts(
    items: Sequence[tuple[int, str, str]], tokenizer: Any = None, max_prompt_tokens: int | None = None
) -> list[Prompt]:
    """Prompts from ``(id, problem, answer)`` triples: the two-shot template, then truncation if a limit is set."""
    from lit_gmc.data.tasks import Prompt

    if max_prompt_tokens is not None and tokenizer is None:
        raise ValueError("max_prompt_tokens needs a tokenizer to count tokens")
    texts = [build_prompt(problem) for _, problem, _ in items]
    if max_prompt_tokens is not None:
        texts = [truncate_prompt(text, tokenizer, max_prompt_tokens) for text in texts]
    return [Prompt(id_, text, answer) for (id_, _, answer), text in zip(items, texts, strict=True)]


class MathScorer:
    """The reward of this prompt format: the answer region of a completion, its last box, math-verify.

    Args:
        num_workers: Verifier processes.
        timeout_s: Wall-clock bound on checking one completion; a slower check scores 0.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0) -> None:
        from lit_gmc.data.rewards import MathVerifier

        self.verifier = MathVerifier(num_workers=num_workers, timeout_s=timeout_s)

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Rewards of ``(completion, reference)`` pairs."""
        return self.verifier.score_pairs([(answer_region(c), reference) for c, reference in pairs])

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        """Rewards of several completions of one problem."""
        return self.score_pairs([(c, answer) for c in completions])

    def close(self) -> None:
        """Stop the verifier's worker processes."""
        self.verifier.close()


class MathTask:
    """MATH training prompts (two-shot), MATH-500 as held-out prompts, and the math-verify reward.

    Args:
        path: MATH training data: a local JSONL file or a hub dataset name with ``problem`` and ``solution``.
        test_path: Held-out prompts (MATH-500 file or hub name), loaded on first use.
        max_prompt_tokens: Prompt budget in tokens (the paper's 1,024); longer prompts lose their beginning.
            ``None`` keeps prompts whole.
        tokenizer: Tokenizer (or actor name) that counts prompt tokens; the DataModule passes its actor.
        split: Split of a hub training dataset.
        config: Config of a hub training dataset.
        verifier_workers: Processes that run math-verify.
        verify_timeout_s: Wall-clock bound on checking one response; a slower check scores 0.
    """

    name = "math"

    def __init__(
        self,
        path: str = DEFAULT_TRAIN_PATH,
        test_path: str | None = DEFAULT_TEST_PATH,
        max_prompt_tokens: int | None = None,
        tokenizer: Any = None,
        split: str = "train",
        config: str | None = None,
        verifier_workers: int = 2,
        verify_timeout_s: float = 10.0,
    ) -> None:
        self.tokenizer = load_tokenizer(tokenizer) if max_prompt_tokens is not None else None
        self.max_prompt_tokens = max_prompt_tokens
        self.test_path = test_path
        self.data = load_math_train(path, split=split, config=config)
        triples = [(p.id, p.problem, p.answer) for p in self.data.problems]
        self._train = make_prompts(triples, self.tokenizer, max_prompt_tokens)
        self._test: list[Prompt] | None = None
        self.scorer = MathScorer(num_workers=verifier_workers, timeout_s=verify_timeout_s)

    def train_prompts(self) -> Sequence[Prompt]:
        """Two-shot prompts of the kept training rows, in file order."""
        return self._train

    def test_prompts(self) -> Sequence[Prompt]:
        """MATH-500 prompts (same template and truncation), loaded on first call; empty without ``test_path``."""
        if self._test is None:
            from lit_gmc.data.benchmarks import load_benchmark

            if self.test_path is None:
                self._test = []
            else:
                items = load_benchmark("math500", source=self.test_path).items
                triples = [(i, item.problem, item.answer) for i, item in enumerate(items)]
                self._test = make_prompts(triples, self.tokenizer, self.max_prompt_tokens)
        return self._test

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        """1.0 per completion whose answer is equivalent to ``answer`` under math-verify, else 0.0."""
        return self.scorer.score(completions, answer)

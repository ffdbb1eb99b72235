r"""The paper's training data: MATH (Hendrycks et al. 2021), its reference answers and the two-shot ``\boxed{}`` prompt.

Data comes from a :class:`DataSource`, by default on the hub (:data:`MATH_TRAIN_SOURCE`), or a local JSON/JSONL
file or dataset folder, all read through ``datasets``; a bad row is an error naming its file and line. A row's
reference is the last complete ``\boxed{...}`` of its ``solution`` by our extractor; rows without one are dropped
and counted (2 of 7,500 write ``\boxed 2``, leaving the paper's 7,498; two empty boxes are kept, as that count
implies, and score 0). The prompt's two worked examples are removed from the training prompts.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lit_gmc.data.tasks.answers import PROBLEM_MARK, last_boxed
from lit_gmc.data.tasks.base import Prompt, truncate_prompt
from lit_gmc.errors import UserConnectionError, UserError, UserFileNotFoundError

LOCAL_SUFFIXES = (".json", ".jsonl")


@dataclass(frozen=True)
class DataSource:
    """One split of a dataset and the names of the columns we read from it.

    Attributes:
        path: Hub dataset name, a local ``.json``/``.jsonl`` file, or a dataset folder.
        columns: Our field name -> the source's column; a field not listed is read from the column of its name.
        config: Hub config (``None``: the default). A single file ignores it and ``split``.
        split: Split to read.
    """

    path: str
    columns: Mapping[str, str] = field(default_factory=dict)
    config: str | None = None
    split: str = "train"

    def column(self, name: str) -> str:
        """The source's column that holds our field ``name``."""
        return self.columns.get(name, name)


MATH_TRAIN_SOURCE = DataSource(
    "DigitalLearningGmbH/MATH-lighteval", {"problem": "problem", "solution": "solution"}, "default", "train"
)
"""MATH train on the hub (7,500 rows; config ``default`` holds all seven subjects). Problem ids are row indices, so
they differ from the local file's, which is in subject/number order; the problems are the same."""

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


def build_prompt(problem: str) -> str:
    """The two-shot prompt for one problem; the same text is used for training and for every benchmark."""
    shots = "".join(f"{PROBLEM_MARK} {ex.problem}\nSolution: {ex.solution}\n\n" for ex in WORKED_EXAMPLES)
    return f"{INSTRUCTION}\n\n{shots}{PROBLEM_MARK} {problem.strip()}\nSolution:"


def is_file_source(path: str) -> bool:
    """A local JSON/JSONL file (existing, or named like one), read with ``load_dataset("json")``."""
    return Path(path).is_file() or path.endswith(LOCAL_SUFFIXES)


def is_local(path: str) -> bool:
    """A local file or folder (existing, or named like a JSON file) rather than a hub dataset name."""
    return Path(path).exists() or path.endswith(LOCAL_SUFFIXES)


def resolve_source(
    source: str | DataSource | None,
    hub: DataSource,
    file_columns: Mapping[str, str] | None = None,
    split: str | None = None,
    config: str | None = None,
) -> DataSource:
    """The source to read, from what a user gave and the dataset's hub spec.

    ``None`` is ``hub``; a JSON/JSONL file is read with ``file_columns`` (default: the hub's); another string (a
    hub name or dataset folder) takes the hub's config, split and columns. ``split`` and ``config`` override.
    """
    if source is None:
        chosen = hub
    elif isinstance(source, DataSource):
        chosen = source
    elif is_file_source(source):
        chosen = DataSource(source, dict(hub.columns if file_columns is None else file_columns))
    else:
        chosen = replace(hub, path=source)
    overrides = {"split": split, "config": config}
    return replace(chosen, **{key: value for key, value in overrides.items() if value is not None})


def _rows(path: Path) -> Iterator[tuple[int, str]]:
    """``(1-based line number, line)`` of each non-blank line of a JSONL file: the rows ``datasets`` reads."""
    with path.open(encoding="utf-8") as handle:
        yield from ((number, line) for number, line in enumerate(handle, start=1) if line.strip())


def _line_of_row(path: Path, row: int) -> int:
    """The line number of row ``row`` (0-based) of a JSONL file."""
    return next(itertools.islice(_rows(path), row, None), (row + 1, ""))[0]


def _first_bad_json_line(path: Path) -> tuple[int, str] | None:
    for number, line in _rows(path):
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            return number, str(err)
    return None


def _where(source: DataSource) -> str:
    config = f"config {source.config!r}, " if source.config else ""
    return f"{source.path} ({config}split {source.split!r})"


def _read_table(source: DataSource) -> Any:
    """The source's split as a ``datasets.Dataset``: one JSON file, or a hub name or folder (the same call for both)."""
    import datasets  # heavy; only needed when data is actually loaded

    path = Path(source.path)
    is_file = is_file_source(source.path)
    # A hub name never starts with "/" or ".": such a path is a missing folder, not something to look up online.
    if (is_file and not path.is_file()) or (source.path.startswith(("/", ".")) and not path.exists()):
        raise UserFileNotFoundError(f"data not found: {source.path} (resolved to {path.resolve()})")
    if is_file and not any(line.strip() for line in path.open(encoding="utf-8", errors="replace")):
        raise UserError(f"{source.path}: the file has no rows")  # datasets would end in a bare StopIteration
    try:
        if is_file:
            return datasets.load_dataset("json", data_files=str(path), split="train")
        return datasets.load_dataset(source.path, source.config, split=source.split)
    except ConnectionError as err:  # offline, or the hub is unreachable: say what works instead
        hint = "without network access, pass a local JSON/JSONL file or a dataset folder"
        raise UserConnectionError(f"{source.path}: {err}; {hint}") from err
    except datasets.exceptions.DatasetGenerationError as err:
        bad = _first_bad_json_line(path) if is_file else None
        if bad is not None:
            raise UserError(f"{source.path}:{bad[0]}: not valid JSON ({bad[1]})") from err
        raise UserError(f"{source.path}: could not be read as a dataset ({err.__cause__ or err})") from err


def _field_label(source: DataSource, name: str) -> str:
    column = source.column(name)
    return f"field {name!r}" if column == name else f"field {name!r} (column {column!r})"


def load_records(source: DataSource, fields: Mapping[str, type | tuple[type, ...]]) -> list[dict[str, Any]]:
    """Rows of a source, keyed by our field names, each checked to have ``fields`` of the given types.

    ``fields`` maps each required field to its accepted type(s); other columns are dropped. Invalid JSON, a missing
    column or field or a wrong type is a :class:`UserError` naming the file and line.
    """
    table = _read_table(source)
    if table.num_rows == 0:
        raise UserError(f"{_where(source)} has no rows")
    columns = {name: source.column(name) for name in fields}
    missing = [f"{column!r}" for column in columns.values() if column not in table.column_names]
    if missing:
        raise UserError(f"{source.path}: no column {', '.join(missing)} in any row (has {table.column_names})")
    rows = table.select_columns(list(dict.fromkeys(columns.values()))).to_list()
    out = []
    for index, row in enumerate(rows):
        record = {name: row[column] for name, column in columns.items()}
        for name, kind in fields.items():
            value = record[name]
            if value is None:
                raise UserError(f"{row_location(source, index)}: missing {_field_label(source, name)}")
            if not isinstance(value, kind) or isinstance(value, bool):
                expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
                got = type(value).__name__
                label = _field_label(source, name)
                raise UserError(f"{row_location(source, index)}: {label} must be {expected}, got {got}")
        out.append(record)
    return out


def row_location(source: DataSource, index: int) -> str:
    """Where row ``index`` of a source is, for error messages: ``file:line`` for a file, else the row number."""
    if is_file_source(source.path):
        return f"{source.path}:{_line_of_row(Path(source.path), index)}"
    return f"{_where(source)} row {index}"


@dataclass(frozen=True)
class MathProblem:
    """One training problem: ``id`` is its row index in the source, ``answer`` the extracted reference."""

    id: int
    problem: str
    answer: str


@dataclass
class MathTrainSet:
    r"""The MATH training ``problems`` kept out of the ``rows`` read, and the indices of those left out.

    ``no_answer``: no complete ``\boxed{}`` in the solution; ``held_out``: the prompt's worked examples.
    """

    problems: list[MathProblem]
    rows: int
    no_answer: list[int] = field(default_factory=list)
    held_out: list[int] = field(default_factory=list)


def load_math_train(
    source: str | DataSource | None = None, split: str | None = None, config: str | None = None
) -> MathTrainSet:
    """MATH training problems with references extracted from ``solution``, from ``source`` (:func:`resolve_source`)."""
    chosen = resolve_source(source, MATH_TRAIN_SOURCE, split=split, config=config)
    rows = load_records(chosen, {"problem": str, "solution": str})
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


def make_prompts(
    items: Sequence[tuple[int, str, str]], tokenizer: Any = None, max_prompt_tokens: int | None = None
) -> list[Prompt]:
    """Prompts from ``(id, problem, answer)`` triples: the two-shot template, then truncation if a limit is set."""
    if max_prompt_tokens is not None and tokenizer is None:
        raise ValueError("max_prompt_tokens needs a tokenizer to count tokens: give one, or call the task's setup")
    texts = [build_prompt(problem) for _, problem, _ in items]
    if max_prompt_tokens is not None:
        texts = [truncate_prompt(text, tokenizer, max_prompt_tokens) for text in texts]
    return [Prompt(id_, text, answer) for (id_, _, answer), text in zip(items, texts, strict=True)]

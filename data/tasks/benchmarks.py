r"""The paper's six evaluation benchmarks, each read into ``(problem, reference answer)`` pairs.

Each reads from its hub source unless a local copy (``../shared/data``, see its ``SOURCES.md``), a data folder or
another hub name overrides it (:func:`load_benchmark`); every row is checked, its reference made one LaTeX string
(:data:`REFERENCE_FIELDS`). A user's file is read by :func:`load_file_items` (:func:`prompt_builder`, scorers).
"""

from __future__ import annotations

import itertools
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_gmc.data.tasks.answers import gsm8k_final_answer, last_boxed, reference_text
from lit_gmc.data.tasks.math_data import DataSource, load_records, resolve_source, row_location
from lit_gmc.errors import UserConnectionError, UserError, UserFileNotFoundError


class BenchmarkUnreachable(UserConnectionError):
    """A benchmark's hub dataset cannot be reached (offline): callers add how to name local copies instead."""


@dataclass(frozen=True)
class BenchmarkItem:
    """One evaluation problem and its reference answer (LaTeX, no ``$`` delimiters)."""

    problem: str
    answer: str


def boxed_reference(solution: str) -> str:
    r"""The reference in a worked solution: its last complete, non-empty ``\boxed{}`` (a ``ValueError`` if none)."""
    answer = last_boxed(solution)
    if not answer:
        raise ValueError("no complete \\boxed{} with an answer")
    return reference_text(answer)  # one Minerva box holds a stray "$ $"


def gsm8k_reference(rationale: str) -> str:
    """The reference in a GSM8K rationale: the number after its last ``####`` (a ``ValueError`` if none)."""
    answer = gsm8k_final_answer(rationale)
    if answer is None:
        raise ValueError("no '#### <answer>' line")
    return answer


REFERENCE_FIELDS: dict[str, tuple[type | tuple[type, ...], Callable[[Any], str]]] = {
    "answer": ((str, int, float, list), reference_text),
    "solution": (str, boxed_reference),
    "rationale": (str, gsm8k_reference),
}
"""Our field that holds the reference -> (accepted types, reader to one LaTeX string). A source maps exactly one:
``answer`` (the value as stored), ``solution`` (a worked solution: the local Minerva copy), ``rationale`` (GSM8K's)."""


def load_items(source: DataSource) -> tuple[list[BenchmarkItem], list[str]]:
    """Problems and references of a benchmark source mapping one of :data:`REFERENCE_FIELDS`, and the rows left out.

    A row whose reference is empty could only score 0 (two of Gaokao2023-En on the hub), so it is left out and
    counted (``skipped`` in the results). A malformed row is a :class:`UserError` naming its file and line (or row).
    """
    found = [name for name in REFERENCE_FIELDS if name in source.columns]
    if len(found) != 1:
        raise UserError(
            f"{source.path}: columns must map exactly one of {', '.join(REFERENCE_FIELDS)} to a column "
            f"(got {dict(source.columns)})"
        )
    return _items(source, found[0], *REFERENCE_FIELDS[found[0]])


def load_file_items(
    path: str, question: str = "question", answer: str = "answer"
) -> tuple[list[BenchmarkItem], list[str]]:
    """:func:`load_items` of a user's JSON/JSONL benchmark file (``Evaluation``'s ``BenchmarkFile``).

    A text answer is kept verbatim, for the file's own scorer; a number is written as :func:`reference_text`
    writes it (``27.0`` as ``27``).
    """
    source = DataSource(path, {"problem": question, "answer": answer})
    return _items(
        source, "answer", (str, int, float), lambda value: value if isinstance(value, str) else reference_text(value)
    )


def _items(
    source: DataSource, name: str, kinds: type | tuple[type, ...], read: Callable[[Any], str]
) -> tuple[list[BenchmarkItem], list[str]]:
    items, skipped = [], []
    for index, row in enumerate(load_records(source, {"problem": str, name: kinds})):
        try:
            item = BenchmarkItem(row["problem"], read(row[name]))
        except ValueError as err:
            raise UserError(f"{row_location(source, index)}: column {source.column(name)!r}: {err}") from err
        (items.append(item) if item.answer.strip() else skipped.append(row_location(source, index)))
    return items, skipped


class CompletionScorer:
    """An evaluation scorer (``score_pairs``) from a reward ``score(completions, answer)`` of 0/1 values, ``name``d."""

    def __init__(self, score: Callable[[Sequence[str], str], Sequence[float]], name: str) -> None:
        self.score, self.name = score, name

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """One 0/1 value per pair (else a ``ValueError``); consecutive pairs with one reference go in one call."""
        out: list[float] = []
        for answer, run in itertools.groupby(pairs, key=lambda pair: pair[1]):
            completions = [completion for completion, _ in run]
            values = [float(v) for v in self.score(completions, answer)]
            if len(values) != len(completions) or any(v not in (0.0, 1.0) for v in values):
                raise ValueError(
                    f"benchmark scorer {self.name} must return one 0 or 1 per completion; for {len(completions)} "
                    f"completions of answer {answer!r} it returned {values!r:.200}"
                )
            out.extend(values)
        return out


def resolve_callable(value: str | Callable, option: str) -> Callable:
    """``value`` itself when callable, else the callable its import path names (else a ``ValueError``)."""
    if callable(value):
        return value
    try:
        found = pkgutil.resolve_name(value)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{option}={value!r} is not an importable callable ({type(err).__name__}: {err})") from err
    if not callable(found):
        raise ValueError(f"{option}={value!r} names a {type(found).__name__}, not a callable")
    return found


def prompt_builder(template: str | Callable[[str], str], option: str) -> Callable[[str], str]:
    """The ``question -> prompt`` function of a benchmark file's ``template`` (else a ``ValueError``).

    ``template`` is a format string whose one field is ``{question}``, or a callable or its import path.
    """
    if callable(template) or "{" not in template:
        try:
            return resolve_callable(template, option)
        except ValueError as err:
            raise ValueError(f"{err}; a format string needs a {{question}} field") from err
    try:
        template.format(question="")
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"{option}={template!r}: a format string may only use {{question}} ({err!r})") from err
    if "{question}" not in template:
        raise ValueError(f"{option}={template!r}: a format string must contain {{question}}")
    return lambda question: template.format(question=question)


# The hub sources, checked against each dataset's card, file list or users' code; what stays uncertain is said.
MATH500_HUB = DataSource("HuggingFaceH4/MATH-500", {"problem": "problem", "answer": "answer"}, None, "test")
"""500 rows, the local copy's layout."""

GSM8K_HUB = DataSource("openai/gsm8k", {"problem": "question", "rationale": "answer"}, "main", "test")
"""1,319 rows; ``answer`` is the rationale, ending in ``#### <number>``."""

GAOKAO2023EN_HUB = DataSource(
    "MARIO-Math-Reasoning/Gaokao2023-Math-En", {"problem": "question", "answer": "answer"}, None, "train"
)
"""One unsplit file (so ``train``), 385 problems, answers in ``$...$``. Uncertain: columns seen in users' code only."""

OLYMPIADBENCH_HUB = DataSource(
    "Hothan/OlympiadBench", {"problem": "question", "answer": "final_answer"}, "OE_TO_maths_en_COMP", "train"
)
"""Open-ended English competition maths; ``final_answer`` is a list. Uncertain: 674 rows (the paper) or 675 (ours)."""

MINERVA_HUB = DataSource("math-ai/minervamath", {"problem": "question", "answer": "answer"}, None, "test")
"""272 problems; ``answer`` is final, unlike the local copy's ``solution``. Uncertain: a few use Python notation."""

AMC23_HUB = DataSource("math-ai/amc23", {"problem": "question", "answer": "answer"}, None, "test")
"""40 problems of AMC 12A/12B 2023. Uncertain: ``answer`` stored as a number or as text; both are accepted."""


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to find and read one benchmark: ``samples`` is the paper's n for avg@n.

    ``filename`` and ``file_columns`` (``None``: the hub's) are its local copy's, in the Qwen2.5-Math evaluation layout.
    """

    title: str
    samples: int
    hub: DataSource
    filename: str
    file_columns: Mapping[str, str] | None = None


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "math500": BenchmarkSpec("MATH-500", 16, MATH500_HUB, "math500_test.jsonl"),
    "gsm8k": BenchmarkSpec("GSM8K", 8, GSM8K_HUB, "gsm8k_test.jsonl"),
    "gaokao2023en": BenchmarkSpec("Gaokao2023-En", 8, GAOKAO2023EN_HUB, "gaokao2023en_test.jsonl"),
    "olympiadbench": BenchmarkSpec(
        "OlympiadBench", 8, OLYMPIADBENCH_HUB, "olympiadbench_OE_TO_maths_en_COMP_test.jsonl"
    ),
    "minerva": BenchmarkSpec(
        "Minerva", 16, MINERVA_HUB, "minerva_math_test.jsonl", {"problem": "problem", "solution": "solution"}
    ),
    "amc23": BenchmarkSpec("AMC23", 16, AMC23_HUB, "amc23_test.jsonl", {"problem": "problem", "answer": "answer"}),
}
"""Registry: name -> spec. ``samples`` is the paper's n for avg@n (16 for MATH-500, Minerva, AMC23; 8 otherwise)."""


@dataclass(frozen=True)
class Benchmark:
    """A loaded benchmark: its registry name, display title, paper's sample count and items."""

    name: str
    title: str
    samples: int
    items: list[BenchmarkItem]
    skipped: tuple[str, ...] = ()  # where the rows left out for an empty reference answer are (file:line, or row)


def load_benchmark(
    name: str,
    source: str | DataSource | None = None,
    data_dir: str | None = None,
    split: str | None = None,
    config: str | None = None,
) -> Benchmark:
    """Load a registered benchmark, by default from its hub source (:class:`BenchmarkUnreachable` offline).

    ``source`` overrides the hub source (:func:`resolve_source`, with the local copy's columns for a file);
    without it, ``data_dir`` holds the local copies under their usual names. Any other problem is a
    :class:`UserError` naming the benchmark, file or row.
    """
    if name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    if source is None and data_dir is not None:
        source = str(Path(data_dir) / spec.filename)
    chosen = resolve_source(source, spec.hub, spec.file_columns, split=split, config=config)
    try:
        items, skipped = load_items(chosen)
    except ConnectionError as err:  # its message says the hub was out of reach (before UserError: it may be one)
        reason = err.__cause__ if isinstance(err, UserError) and err.__cause__ else err  # without the training hint
        raise BenchmarkUnreachable(f"benchmark {name!r}: {reason} (its local copy is {spec.filename})") from err
    except UserError:
        raise  # already names the file and line
    except FileNotFoundError as err:  # datasets': a folder without data files, a hub name that does not exist
        raise UserFileNotFoundError(f"benchmark {name!r}: {chosen.path}: {err}") from err
    return Benchmark(name, spec.title, spec.samples, items, tuple(skipped))

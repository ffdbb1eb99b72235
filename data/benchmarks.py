r"""The paper's six evaluation benchmarks, each read into ``(problem, reference answer)`` pairs.

Every loader takes a local JSONL file (the copies in ``../shared/data``, see its ``SOURCES.md``) or a hub
dataset name, reads it through the ``datasets`` library, checks the fields it needs (an error names the
file and line), and turns the benchmark's own answer format into one LaTeX string for the verifier:

========================  ==================  =====================================================
benchmark                 problem field       reference answer
========================  ==================  =====================================================
MATH-500                  ``problem``         ``answer``
GSM8K                     ``question``        the number after ``####`` in ``answer``
Gaokao2023-En             ``question``        ``answer`` without its ``$`` delimiters
OlympiadBench (OE_TO_     ``question``        ``final_answer`` (a list; several entries when
maths_en_COMP)                                ``is_multiple_answer``) joined into one set
Minerva Math              ``problem``         last ``\boxed{}`` of ``solution``
AMC23                     ``problem``         ``answer`` (a float such as ``27.0``, as ``27``)
========================  ==================  =====================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lit_gmc.data.answers import gsm8k_final_answer, last_boxed, reference_text
from lit_gmc.data.math_data import load_records, row_location

DEFAULT_DATA_DIR = "../shared/data"


@dataclass(frozen=True)
class BenchmarkItem:
    """One evaluation problem and its reference answer (LaTeX, no ``$`` delimiters)."""

    problem: str
    answer: str


def load_math500(source: str, split: str = "test", config: str | None = None) -> list[BenchmarkItem]:
    """MATH-500 (the PRM800K 500-problem subset of the MATH test set)."""
    rows = load_records(source, {"problem": str, "answer": str}, split=split, config=config)
    return [BenchmarkItem(r["problem"], reference_text(r["answer"])) for r in rows]


def load_gsm8k(source: str, split: str = "test", config: str | None = None) -> list[BenchmarkItem]:
    """GSM8K test: the reference is the number after the rationale's ``####``."""
    rows = load_records(source, {"question": str, "answer": str}, split=split, config=config)
    items = []
    for index, row in enumerate(rows):
        answer = gsm8k_final_answer(row["answer"])
        if answer is None:
            raise ValueError(f"{row_location(source, index, split)}: no '#### <answer>' line in field 'answer'")
        items.append(BenchmarkItem(row["question"], answer))
    return items


def load_gaokao2023en(source: str, split: str = "test", config: str | None = None) -> list[BenchmarkItem]:
    """Gaokao 2023 English: answers are LaTeX wrapped in ``$...$``."""
    rows = load_records(source, {"question": str, "answer": str}, split=split, config=config)
    return [BenchmarkItem(r["question"], reference_text(r["answer"])) for r in rows]


def load_olympiadbench(source: str, split: str = "test", config: str | None = None) -> list[BenchmarkItem]:
    """OlympiadBench OE_TO_maths_en_COMP: ``final_answer`` lists are read as (order-free) sets.

    That covers the ``is_multiple_answer`` rows; ``unit`` is ignored (the reference is the quantity).
    """
    rows = load_records(source, {"question": str, "final_answer": list}, split=split, config=config)
    items = []
    for index, row in enumerate(rows):
        try:
            items.append(BenchmarkItem(row["question"], reference_text(row["final_answer"])))
        except ValueError as err:
            raise ValueError(f"{row_location(source, index, split)}: field 'final_answer': {err}") from err
    return items


def load_minerva(source: str, split: str = "test", config: str | None = None) -> list[BenchmarkItem]:
    r"""Minerva Math (MIT OCW problems): the reference is the last ``\boxed{}`` of ``solution``."""
    rows = load_records(source, {"problem": str, "solution": str}, split=split, config=config)
    items = []
    for index, row in enumerate(rows):
        answer = last_boxed(row["solution"])
        if not answer:
            raise ValueError(f"{row_location(source, index, split)}: no complete \\boxed{{}} in field 'solution'")
        items.append(BenchmarkItem(row["problem"], reference_text(answer)))  # one box holds a stray "$ $"
    return items


def load_amc23(source: str, split: str = "test", config: str | None = None) -> list[BenchmarkItem]:
    """AMC 2023: numeric answers (stored as floats)."""
    rows = load_records(source, {"problem": str, "answer": (int, float, str)}, split=split, config=config)
    return [BenchmarkItem(r["problem"], reference_text(r["answer"])) for r in rows]


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to find and read one benchmark, and how many samples the paper draws per problem."""

    title: str
    filename: str
    samples: int
    loader: Callable[..., list[BenchmarkItem]]


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "math500": BenchmarkSpec("MATH-500", "math500_test.jsonl", 16, load_math500),
    "gsm8k": BenchmarkSpec("GSM8K", "gsm8k_test.jsonl", 8, load_gsm8k),
    "gaokao2023en": BenchmarkSpec("Gaokao2023-En", "gaokao2023en_test.jsonl", 8, load_gaokao2023en),
    "olympiadbench": BenchmarkSpec(
        "OlympiadBench", "olympiadbench_OE_TO_maths_en_COMP_test.jsonl", 8, load_olympiadbench
    ),
    "minerva": BenchmarkSpec("Minerva", "minerva_math_test.jsonl", 16, load_minerva),
    "amc23": BenchmarkSpec("AMC23", "amc23_test.jsonl", 16, load_amc23),
}
"""Registry: name -> spec. ``samples`` is the paper's n for avg@n (16 for MATH-500, Minerva, AMC23; 8 otherwise)."""


@dataclass(frozen=True)
class Benchmark:
    """A loaded benchmark: its registry name, display title, paper's sample count and items."""

    name: str
    title: str
    samples: int
    items: list[BenchmarkItem]


def load_benchmark(
    name: str,
    source: str | None = None,
    data_dir: str = DEFAULT_DATA_DIR,
    split: str = "test",
    config: str | None = None,
) -> Benchmark:
    """Load a registered benchmark from ``source`` (a file or hub name) or from its file under ``data_dir``.

    Raises:
        ValueError: For an unknown name (the message lists the known ones) or a malformed row.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    source = source if source is not None else str(Path(data_dir) / spec.filename)
    return Benchmark(name, spec.title, spec.samples, spec.loader(source, split=split, config=config))

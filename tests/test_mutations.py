"""The deliberate-bug list (``scripts/mutations.toml``) still fits the code: a refactor that moves a text fails here.

Only the static check, in well under a second; running the bugs against the suite is ``scripts/mutate.py``
(docs/testing.md).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def mutate_module():
    spec = importlib.util.spec_from_file_location("lit_gmc_mutate", REPO / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


pytest.importorskip("tomllib", reason="the list is TOML, read with Python 3.11's tomllib")
mutate = mutate_module()
MUTATIONS = mutate.load()


def test_the_list_covers_at_least_fifteen_bugs_with_unique_ids():
    assert len(MUTATIONS) >= 15 and len({m.id for m in MUTATIONS}) == len(MUTATIONS)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.id for m in MUTATIONS])
def test_each_text_occurs_exactly_once_and_its_tests_exist(mutation):
    assert mutate.text_problem(mutation) is None, f"{mutation.id}: {mutate.text_problem(mutation)}"
    assert mutate.test_problems(mutation) == []


def test_a_text_that_is_missing_or_repeated_is_refused(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\nx = 1\n")
    entry = dict(id="e", bug="b", file="m.py", new="x = 2", tests=("tests/test_mutations.py",))
    assert mutate.text_problem(mutate.Mutation(**entry, old="x = 1"), tmp_path) == (
        "text found 2 times in m.py (must be exactly once)"
    )
    assert mutate.text_problem(mutate.Mutation(**entry, old="y = 1"), tmp_path) == (
        "text found 0 times in m.py (must be exactly once)"
    )
    assert mutate.test_problems(mutate.Mutation(**{**entry, "tests": ("tests/test_mutations.py::test_nothing",)},
                                                old="x")) == [
        "tests/test_mutations.py::test_nothing: no function test_nothing in tests/test_mutations.py"
    ]  # fmt: skip


def test_since_picks_the_entries_whose_file_or_tests_changed():
    entry = mutate.Mutation(id="e", bug="b", file="lit_gmc/objectives.py", old="a", new="b",
                            tests=("tests/test_objectives.py::test_x",))  # fmt: skip
    assert mutate.touched(entry, {"lit_gmc/objectives.py"}) and mutate.touched(entry, {"tests/test_objectives.py"})
    assert not mutate.touched(entry, {"lit_gmc/batch.py", "tests/test_collate.py"})

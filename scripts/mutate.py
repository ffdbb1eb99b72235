"""Run the deliberate bugs of ``scripts/mutations.toml`` against the suite: each must make its tests fail.

    python scripts/mutate.py                 # every entry: a table of caught / SURVIVED / text-not-found
    python scripts/mutate.py gmc-cap tic-cap # only these entries
    python scripts/mutate.py gmc-cap --full  # one entry against the whole suite (pytest -x)
    python scripts/mutate.py --check         # only check that every text is found exactly once (no pytest)
    python scripts/mutate.py --since main    # only entries whose file or tests differ from main's

The repository's files (``git ls-files``, untracked ones included) are copied once into a temporary folder, beside
a link to ``../shared`` when the repository has one; the real tree is never written. First a control run of the
listed tests on the unchanged copy must pass with nothing skipped (so that a moved or skipped test cannot read as
a caught bug); then, one entry at a time, its text is replaced in the copy, its tests run with ``pytest -x -q``
under ``PYTHONPATH=<copy>`` and the file is put back. Bytecode is never written, so a restored file cannot be
shadowed by the mutant's ``.pyc``. Exit status 0 only when every entry is caught.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the runner needs 3.11's TOML reader (CI runs 3.11)
    tomllib = None

REPO = Path(__file__).resolve().parents[1]
LIST = REPO / "scripts" / "mutations.toml"
FIELDS = {"id", "bug", "file", "old", "new", "tests"}


@dataclass(frozen=True)
class Mutation:
    id: str
    bug: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


def load(path: Path = LIST) -> list[Mutation]:
    """The entries of the list, checked for their fields and unique ids."""
    if tomllib is None:
        raise SystemExit("mutate: error: reading scripts/mutations.toml needs Python 3.11 or later (tomllib)")
    entries = tomllib.loads(path.read_text())["mutation"]
    mutations, seen = [], set()
    for n, entry in enumerate(entries):
        if set(entry) != FIELDS:
            raise ValueError(f"{path} entry {n}: fields must be {sorted(FIELDS)}, got {sorted(entry)}")
        if entry["id"] in seen:
            raise ValueError(f"{path}: id {entry['id']!r} appears twice")
        if entry["old"] == entry["new"] or not entry["tests"]:
            raise ValueError(f"{path}: {entry['id']} changes nothing or lists no test")
        seen.add(entry["id"])
        mutations.append(Mutation(**{**entry, "tests": tuple(entry["tests"])}))
    return mutations


def text_problem(m: Mutation, root: Path = REPO) -> str | None:
    """Why ``m`` cannot be applied to the tree at ``root`` (its text must occur exactly once), or ``None``."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    count = path.read_text().count(m.old)
    return None if count == 1 else f"text found {count} times in {m.file} (must be exactly once)"


def test_problems(m: Mutation, root: Path = REPO) -> list[str]:
    """Listed tests whose file or function is missing (a static check, no collection)."""
    problems = []
    for node in m.tests:
        file, *names = node.split("::")
        path = root / file
        if not path.is_file():
            problems.append(f"{node}: no file {file}")
        elif names and not re.search(rf"def {re.escape(names[-1].split('[')[0])}\(", path.read_text()):
            problems.append(f"{node}: no function {names[-1].split('[')[0]} in {file}")
    return problems


def copy_tree(dest: Path) -> Path:
    """The repository's tracked and untracked (not ignored) files copied under ``dest/<name>``; returns the copy."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    copy = dest / REPO.name
    for name in filter(None, listed):
        source = REPO / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the work tree but still in the index
        target = copy / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    shared = REPO.parent / "shared"
    if shared.is_dir():  # the tests read ../shared/data beside the clone
        (dest / "shared").symlink_to(shared)
    return copy


def pytest(copy: Path, args: list[str], timeout: float, python: str) -> tuple[int | None, str, float]:
    """``python -m pytest args`` in ``copy``; returns the exit status (``None`` on timeout), output and seconds."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    began = time.monotonic()
    try:
        done = subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=copy, env=env,
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return None, out, time.monotonic() - began
    return done.returncode, done.stdout + done.stderr, time.monotonic() - began


def control(copy: Path, mutations: list[Mutation], timeout: float, python: str) -> str | None:
    """Run every listed test on the unchanged copy: ``None`` if all pass and none is skipped, else why not."""
    nodes = list(dict.fromkeys(node for m in mutations for node in m.tests))
    report = copy.parent / "control.xml"
    code, out, seconds = pytest(copy, ["-q", f"--junitxml={report}", *nodes], timeout, python)
    print(f"control: {len(nodes)} test ids, exit status {code}, {seconds:.0f} s", flush=True)
    if code != 0:
        return f"the listed tests do not pass on the unchanged code (exit status {code}):\n{tail(out, 40)}"
    skipped = [f"{case.get('classname')}::{case.get('name')}" for case in ET.parse(report).iter("testcase")
               if case.find("skipped") is not None]  # fmt: skip
    if skipped:
        return "listed tests are skipped here, so they cannot catch anything: " + ", ".join(skipped)
    return None


def tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def first_failure(out: str) -> str:
    """The first ``FAILED``/``ERROR`` line of pytest's short summary, shortened."""
    for line in out.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0].replace("tests/", "")
    return ""


def run(mutations: list[Mutation], args: argparse.Namespace) -> int:
    rows, bad = [], 0
    runnable = []
    for m in mutations:
        problem = text_problem(m) or "; ".join(test_problems(m)) or None
        if problem:
            rows.append((m, "text-not-found" if "text found" in problem or "does not exist" in problem else
                         "tests-not-found", problem, 0.0))  # fmt: skip
            bad += 1
        else:
            runnable.append(m)
    if args.check:
        rows += [(m, "fits", "", 0.0) for m in runnable]
        runnable = []
    with tempfile.TemporaryDirectory(prefix="lit_gmc-mutate-") as tmp:
        copy = copy_tree(Path(tmp)) if runnable else None
        if copy is not None and not args.no_control and not args.full:
            problem = control(copy, runnable, args.timeout * 2, args.python)
            if problem:
                print(f"mutate: error: {problem}", file=sys.stderr)
                return 2
        for m in runnable:
            path = copy / m.file
            original = path.read_bytes()
            path.write_text(original.decode().replace(m.old, m.new, 1))
            try:
                tests = [] if args.full else list(m.tests)
                code, out, seconds = pytest(copy, ["-x", "-q", *tests], args.timeout, args.python)
            finally:
                path.write_bytes(original)
            if code in (1, 2):  # tests failed, or collection errors (the mutant broke an import)
                result, detail = "caught", first_failure(out) or f"exit status {code}"
            elif code == 0:
                result, detail = "SURVIVED", "the listed tests pass with the bug in"
            elif code is None:
                result, detail = "timeout", f"no result within {args.timeout:g} s"
            else:
                result, detail = "error", f"pytest exit status {code}: {tail(out, 3)}"
            bad += result != "caught"
            rows.append((m, result, detail, seconds))
            print(f"{m.id}: {result} ({seconds:.0f} s) {detail}", flush=True)
    order = {m.id: n for n, m in enumerate(mutations)}
    rows.sort(key=lambda row: order[row[0].id])
    print()
    print("| id | file | result | caught by / problem | s |")
    print("|---|---|---|---|---|")
    for m, result, detail, seconds in rows:
        print(f"| {m.id} | {m.file} | {result} | {detail.replace('|', '/')} | {seconds:.0f} |")
    good = sum(result in ("caught", "fits") for _, result, _, _ in rows)
    print(f"\n{good}/{len(mutations)} {'fit the code (text found once, tests present)' if args.check else 'caught'}")
    return 1 if bad else 0


def touched(m: Mutation, changed: set[str]) -> bool:
    """Whether ``m``'s file or one of its test files is among ``changed`` (paths relative to the repository)."""
    return m.file in changed or any(node.split("::")[0] in changed for node in m.tests)


def changed_since(ref: str) -> set[str]:
    """Files that differ between ``ref`` and the work tree, untracked ones included."""
    diff = subprocess.run(["git", "diff", "--name-only", ref], cwd=REPO, check=True, capture_output=True, text=True)
    new = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=REPO, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return set((diff.stdout + new.stdout).split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="entries to run (default: all)")
    parser.add_argument("--list", type=Path, default=LIST, help="the list of deliberate bugs (TOML)")
    parser.add_argument("--check", action="store_true", help="only check that every text is found exactly once")
    parser.add_argument("--full", action="store_true", help="run the whole suite (pytest -x) for each entry given")
    parser.add_argument("--since", metavar="REF", help="only entries whose file or tests differ from git REF")
    parser.add_argument("--no-control", action="store_true", help="skip the control run on the unchanged code")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run (default 600)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    args = parser.parse_args(argv)
    mutations = load(args.list)
    unknown = sorted(set(args.ids) - {m.id for m in mutations})
    if unknown:
        parser.error(f"no entry {', '.join(unknown)} in {args.list}")
    if args.full and len(args.ids) != 1:
        parser.error("--full runs the whole suite: give exactly one entry id")
    chosen = [m for m in mutations if not args.ids or m.id in args.ids]
    if args.since:
        changed = changed_since(args.since)
        chosen = [m for m in chosen if touched(m, changed)]
        print(f"--since {args.since}: {len(chosen)} of {len(mutations)} entries touch a changed file", flush=True)
        if not chosen:
            return 0
    return run(chosen, args)


if __name__ == "__main__":
    sys.exit(main())

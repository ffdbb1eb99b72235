"""The paper's Tables 1, 3, 4 and 5 and Figures 2-6, from runs' TensorBoard logs and evaluation JSONs.

Runs come from a sweep (``--sweep``: ``scripts/plots.py``'s :func:`load_sweep` reads the manifest of
``scripts/sweep.py``, each run's ``config.json``, TensorBoard scalars and ``eval/step_<n>.json`` files; runs not
marked done are left out and listed) and/or from runs launched directly with ``python -m lit_gmc fit``, one logger
folder per run (``--runs runs/simulated_async/qwen3_4b_gmc ...``, or ``--runs-root runs/simulated_async`` for every
folder under it with a ``version_<n>/config.yaml``; :func:`load_run_folders`). Both are read the same way
(:func:`run_parameters` on the config each run trained with): method from ``model.correction``, model from
``model.actor``, seed, G from ``data.group_size``, GMC's ``cap_schedule``, and the delay from the schedule:
``FixedDelay``'s D, 0 for ``Sync`` (the paper's D = 0 protocol, App. B.1), none for ``VirtualClock`` and ``Live``.
A run with a fixed delay belongs to the fixed-delay suite (Table 3, 4, Figures 2-5), one without to the simulated
asynchronous suite (Tables 1 and 5, Figure 6); nothing is placed by a default. Resumed runs (``version_<n>``
folders) merge into one; a run whose logs stop before ``trainer.max_steps`` is left out and listed, unless
``--include-unfinished``. Runs are grouped by model (ordered by parameter count).

Layouts are the paper's (arXiv 2610.01896; captions of Tables 1, 3-5 and Figures 2-6, Sec. 5 and App. B.2), two
decimals, with a trailing ``seeds`` column of ours; a cell is the mean ± std over the row's seeds (a bare mean for
one seed), in percent, "–" where no run has it. Method names and order are the paper's: GRPO, GAC, VCPO, TIC-GRPO,
GMC-GRPO in Table 1; GMC-GRPO, TIC-GRPO, GRPO in the fixed-delay results; A-3PO, GMC-GRPO in Table 5.

- **Table 1** (Sec. 5, simulated asynchronous delays): rows model x method; columns Method, Avg. Delay (mean over
  updates of ``delay/mean``; else the last ``delay/running_mean``), "greedy / avg@n" per benchmark at the final
  evaluated checkpoint (MATH500, GSM8K, Gaokao, Olympiad, Minerva, AMC23; others after, by name), Avg. perf.
  (unweighted mean over the benchmarks, greedy and avg@n separately).
- **Table 3** (App. B.2.1): Delay, Method, Greedy and unbiased pass@k for k in {1, 2, 4, 8, 16} on MATH-500 at the
  final checkpoint, after ``Base (no RL)`` (the step-0 evaluation, identical ones counted once); the delay grid's
  group size only (other sizes are Table 4's).
- **Table 4** (App. B.2.2): at the delay where several group sizes were run (the paper: G in {4, 8, 32} at
  D = 128, Qwen3-1.7B-Base), rows checkpoint x G, columns GMC-GRPO and TIC-GRPO ("greedy / sampled Pass@1", the
  latter avg@16) and Δ = GMC-GRPO's sampled Pass@1 minus TIC-GRPO's (seed means), in percentage points.
- **Table 5** (App. B.2.3): A-3PO against GMC-GRPO, laid out as Table 1, the better entry of each metric in bold
  within each model.

A run that collapsed is marked, not averaged: its training records hold a non-finite loss or reward, or its
training reward stays at or below :data:`COLLAPSE_REWARD` (no correct response in a 64-response batch) over at
least its last :data:`COLLAPSE_UPDATES` logged updates after having been above it (the paper's A-3PO on Qwen3-8B,
Table 5 and Figure 6). A row all of whose runs collapsed reads "Training collapsed (update n)"; collapsed seeds of
other rows are left out and counted in the label.

The benchmark of the fixed-delay results is MATH-500 (``math500``, as the ``Evaluation`` callback and a sweep on
the ``Math`` task name it); when no run evaluated it, the one benchmark every such run evaluated (a sweep of the
tiny ``Addition`` task: ``heldout``), named in the captions.

Figures (PNG + PDF; ``_<model>`` added when there are several models):

- ``fig2_pass_at_1``: sampled Pass@1 on MATH-500 against checkpoint, panels D = 0, 64 and 128 (those present).
- ``fig3_pass_at_1``: the same at every delay run (the paper: 0, 32, 64, 128, 256, 512).
- ``fig4_entropy``: current-policy token entropy per update, a panel per delay, faint per update, solid centred
  rolling mean over 25 updates, dashed vertical lines at queue drain (from the records).
- ``fig5_reward_by_group_size``: training reward of GMC-GRPO and TIC-GRPO per group size at the group-size delay.
- ``fig6_a3po_reward``: training reward of A-3PO and GMC-GRPO under simulated asynchronous delays, a panel per
  model, faint per update and smoothed.

``--doc FILE`` replaces the block between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in FILE (``NAME`` from
``--block``, default ``paper_tables``). Example::

    python scripts/tables.py --sweep runs/study --out docs/figures/study
    python scripts/tables.py --runs-root runs/simulated_async --out docs/figures/qwen3
    python scripts/tables.py --runs-root runs/fixed_delay_d* runs/group_size_g* --out docs/figures/fixed_delay
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

# scripts/ is not a package: `python scripts/tables.py` puts this folder on the path, an import by file path
# (the tests) does not.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from plots import (  # noqa: E402
    FIXED_DELAY_ORDER,
    REWARD_TAGS,
    SIMULATED_ORDER,
    Run,
    add_run_sources,
    cell,
    eval_summary,
    faint_and_smoothed,
    figure_entropy,
    figure_reward_by_group_size,
    group,
    group_size_delay,
    load_sources,
    main_group_size,
    markdown_table,
    panels,
    save,
    seed_mean,
    seeds,
    write_outputs,
)

from lit_gmc.callbacks.evaluation import PAPER_BENCHMARKS  # noqa: E402
from lit_gmc.callbacks.metrics import PAPER_KS  # noqa: E402

DIGITS = 2
"""Decimals of the paper's tables."""
COLLAPSE_REWARD = 0.01
"""A training reward at or below this counts as zero: one correct response in the paper's 64 already gives 1/64."""
COLLAPSE_UPDATES = 25
"""Logged updates the reward must stay at zero, to the end of the run, for the run to count as collapsed."""
TABLE5_ORDER = ("a3po", "gmc")
FIGURE2_DELAYS = (0, 64, 128)
"""The delays of the paper's Figure 2 (Sec. 5); Figure 3 has every delay."""


def final_benchmarks(run: Run) -> dict[str, dict]:
    """``{name: entry}`` of the run's last evaluated checkpoint (empty when it was never evaluated)."""
    return run.evals[max(run.evals)]["benchmarks"] if run.evals else {}


def benchmark_columns(runs: list[Run]) -> list[str]:
    """Benchmarks of the runs' final checkpoints: the paper's six in its order, then any others by name."""
    names = {name for run in runs for name in final_benchmarks(run)}
    return [b for b in PAPER_BENCHMARKS if b in names] + sorted(names - set(PAPER_BENCHMARKS))


def benchmark_entries(runs: list[Run]) -> dict[str, dict]:
    """One final-checkpoint entry per benchmark (for its title and samples per problem)."""
    return {name: entry for run in runs for name, entry in final_benchmarks(run).items()}


def samples_note(runs: list[Run], columns: list[str]) -> str:
    """``"n = 16 for MATH-500, n = 8 for GSM8K"``: samples per problem of each benchmark, as the captions say."""
    entries = benchmark_entries(runs)
    by_n: dict[int, list[str]] = {}
    for name in columns:
        by_n.setdefault(entries[name]["n"], []).append(entries[name].get("title", name))
    return "; ".join(f"n = {n} for {', '.join(titles)}" for n, titles in sorted(by_n.items(), reverse=True))


def average_delay(run: Run) -> float | None:
    """Mean over updates of ``delay/mean``; else the last ``delay/running_mean`` (the same number); else None."""
    per_update = [v for _, v in run.scalars.get("delay/mean", [])]
    if per_update:
        return statistics.fmean(per_update)
    running = run.scalars.get("delay/running_mean", [])
    return running[-1][1] if running else None


def model_sort_key(model: str) -> tuple[int, float, str]:
    """Order models by the parameter count in their name (``Qwen3-1.7B`` before ``Qwen3-14B``), else by name."""
    size = re.search(r"(\d+(?:\.\d+)?)B(?![a-z])", model, re.IGNORECASE)
    return (0, float(size.group(1)), model) if size else (1, 0.0, model)


def model_name(model: str) -> str:
    """Display name of a model group: the hub name without its organisation."""
    return model.rsplit("/", 1)[-1] if model else "all runs"


def model_groups(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs by model, smallest model first."""
    return {m: [r for r in runs if r.model == m] for m in sorted({r.model for r in runs}, key=model_sort_key)}


def collapse_step(run: Run) -> int | None:
    """The update at which a run collapsed (module docstring), or None when it did not.

    The first non-finite ``train/loss`` or training reward; else the first update of the final stretch of at least
    :data:`COLLAPSE_UPDATES` logged rewards at or below :data:`COLLAPSE_REWARD`, when an earlier reward was above.
    """
    rewards = run.series(REWARD_TAGS)
    for _, points in (("loss", run.scalars.get("train/loss", [])), ("reward", rewards)):
        bad = [step for step, value in points if not math.isfinite(value)]
        if bad:
            return bad[0]
    start = len(rewards)
    while start > 0 and rewards[start - 1][1] <= COLLAPSE_REWARD:
        start -= 1
    if len(rewards) - start >= COLLAPSE_UPDATES and start > 0:
        return rewards[start][0]
    return None


def simulated_runs(runs: list[Run]) -> list[Run]:
    """Runs whose schedule sets no fixed delay (``VirtualClock``, ``Live``): the simulated asynchronous suite."""
    return [r for r in runs if r.delay is None]


def fixed_delay_runs(runs: list[Run]) -> list[Run]:
    """Runs with a fixed delay D (``FixedDelay``, and ``Sync`` as D = 0): the fixed-delay suite."""
    return [r for r in runs if r.delay is not None]


def fmt(values: list[float], bold: bool = False) -> str:
    """A cell of the paper's tables: mean ± std over seeds in percent, two decimals; bold when marked best."""
    text = cell(values, digits=DIGITS)
    return f"**{text}**" if bold and values else text


def metric_values(members: list[Run], columns: list[str]) -> list[tuple[list[float], list[float]]]:
    """Per benchmark, then the macro average: the greedy and avg@n values of the runs' final checkpoints."""
    out = []
    for name in columns:
        entries = [final_benchmarks(r)[name] for r in members if name in final_benchmarks(r)]
        out.append(([e["greedy"] for e in entries], [e["avg@n"] for e in entries]))
    finals = [eval_summary(r.evals[max(r.evals)]) for r in members if r.evals]
    return [*out, ([f["greedy"] for f in finals], [f["avg@n"] for f in finals])]


def best_marks(values: dict[str, list[tuple[list[float], list[float]]]]) -> dict[str, list[tuple[bool, bool]]]:
    """Which rows hold the highest seed mean of each metric (greedy and avg@n apart); none with fewer than 2 rows."""
    labels = list(values)
    marks = {label: [] for label in labels}
    for col in range(len(next(iter(values.values()), []))):
        flags = []
        for part in (0, 1):
            means = {lb: statistics.fmean(values[lb][col][part]) for lb in labels if values[lb][col][part]}
            top = max(means.values()) if len(means) > 1 else None
            flags.append({lb: top is not None and means.get(lb) == top for lb in labels})
        for label in labels:
            marks[label].append((flags[0][label], flags[1][label]))
    return marks


def kept_and_collapsed(members: list[Run]) -> tuple[list[Run], list[int]]:
    """The runs that did not collapse, and the collapse updates of those that did."""
    steps = [collapse_step(r) for r in members]
    return [r for r, s in zip(members, steps, strict=True) if s is None], [s for s in steps if s is not None]


def collapsed_label(label: str, total: int, collapsed: list[int]) -> str:
    """The row label, with the seeds left out for collapsing counted."""
    if not collapsed:
        return label
    return f"{label} ({len(collapsed)} of {total} seeds collapsed, left out)"


def benchmark_rows(runs: list[Run], method_order: tuple[str, ...], columns: list[str], bold: bool) -> list[list[str]]:
    """Table 1/5 rows: a model heading, then Method, Avg. Delay, per-benchmark cells, Avg. perf. and seeds."""
    rows = []
    for model, at_model in model_groups(runs).items():
        rows.append([f"*{model_name(model)}*"] + [""] * (len(columns) + 3))
        kept = {label: (members, *kept_and_collapsed(members)) for label, members in
                group(at_model, method_order).items()}  # fmt: skip
        values = {label: metric_values(k, columns) for label, (_, k, _) in kept.items() if k}
        marks = best_marks(values) if bold else {}
        for label, (members, alive, collapsed) in kept.items():
            if not alive:
                text = f"Training collapsed (update {', '.join(map(str, sorted(set(collapsed))))})"
                rows.append([label, "–", text, *[""] * len(columns), str(len(members))])
                continue
            flags = marks.get(label, [(False, False)] * (len(columns) + 1))
            cells = [f"{fmt(g, fg)} / {fmt(a, fa)}" if g else "–"
                     for (g, a), (fg, fa) in zip(values[label], flags, strict=True)]  # fmt: skip
            delays = [d for d in map(average_delay, alive) if d is not None]
            rows.append([collapsed_label(label, len(members), collapsed), cell(delays, scale=1.0, digits=DIGITS),
                         *cells, str(len(alive))])  # fmt: skip
    return rows


def final_steps(runs: list[Run]) -> str:
    """The final evaluated updates, for captions (``"800"``, or ``"400, 800"`` when runs differ)."""
    return ", ".join(str(s) for s in sorted({max(r.evals) for r in runs if r.evals})) or "none"


def benchmark_table(runs: list[Run], title: str, method_order: tuple[str, ...], bold: bool) -> str:
    """Table 1 or 5: the caption, then the rows of :func:`benchmark_rows`."""
    columns = benchmark_columns(runs)
    titles = [benchmark_entries(runs)[c].get("title", c) for c in columns]
    header = ["Method", "Avg. Delay", *titles, "Avg. perf.", "seeds"]
    caption = (f"{title} Each benchmark cell is greedy / avg@n (%) at the final evaluated checkpoint (update "
               f"{final_steps(runs)}), with {samples_note(runs, columns) or 'no benchmark'}; Avg. perf. is the "
               "average over the benchmarks, mean greedy / mean avg@n; Avg. Delay is the mean delay over updates. "
               "Mean ± std over seeds.")  # fmt: skip
    caption += " The better result of each metric is bold within each model." if bold else ""
    return caption + "\n\n" + markdown_table(header, benchmark_rows(runs, method_order, columns, bold))


def table1(runs: list[Run]) -> str | None:
    """Table 1 (Sec. 5): the simulated asynchronous suite, every method but A-3PO (Table 5's)."""
    suite = [r for r in simulated_runs(runs) if r.method != "a3po"]
    if not suite:
        return None
    return benchmark_table(suite, "**Table 1.** Performance under simulated asynchronous delays.", SIMULATED_ORDER,
                           bold=False)  # fmt: skip


def table5(runs: list[Run]) -> str | None:
    """Table 5 (App. B.2.3): A-3PO against GMC-GRPO under simulated asynchronous delays, the better one in bold."""
    compared = [r for r in simulated_runs(runs) if r.method in TABLE5_ORDER]
    if not any(r.method == "a3po" for r in compared):
        return None
    return benchmark_table(compared, "**Table 5.** A-3PO and GMC-GRPO under simulated asynchronous delays.",
                           TABLE5_ORDER, bold=True)  # fmt: skip


MATH500 = "math500"
"""The benchmark of the fixed-delay suite (Table 3, Figures 2/3) and of the group-size study (Table 4)."""


def suite_benchmark(runs: list[Run]) -> str | None:
    """MATH-500 when a run evaluated it; else the one benchmark every evaluated run has (module docstring)."""
    names = [set(e["benchmarks"]) for r in runs for e in r.evals.values()]
    if any(MATH500 in n for n in names):
        return MATH500
    common = set.intersection(*names) if names else set()
    return min(common) if len(common) == 1 else None


def entry_at(run: Run, step: int, bench: str) -> dict | None:
    """The run's ``bench`` entry at ``step`` (None when that step or benchmark was not evaluated)."""
    return run.evals.get(step, {}).get("benchmarks", {}).get(bench)


def final_entry(run: Run, bench: str) -> dict | None:
    """The ``bench`` entry of the run's last evaluated checkpoint."""
    return entry_at(run, max(run.evals), bench) if run.evals else None


def bench_title(runs: list[Run], bench: str) -> str:
    """The display title of ``bench`` in the runs' evaluations (``MATH-500``)."""
    titles = [e["benchmarks"][bench].get("title") for r in runs for e in r.evals.values() if bench in e["benchmarks"]]
    return next((t for t in titles if t), bench)


def base_entries(runs: list[Run], bench: str) -> list[dict]:
    """``bench`` entries of the step-0 evaluations: the base model before any update.

    Every run of a suite starts from the same weights and evaluates with the same seed, so their step-0 entries
    are equal; identical ones count once (a spread would otherwise claim seeds that are not there).
    """
    unique = {}
    for entry in filter(None, (entry_at(r, 0, bench) for r in runs)):
        unique.setdefault(json.dumps(entry, sort_keys=True), entry)
    return list(unique.values())


def pass_cells(entries: list[dict], ks: list[int]) -> list[str]:
    """Greedy and pass@k cells of benchmark entries (one per seed)."""
    cells = [fmt([e["greedy"] for e in entries])]
    for k in ks:  # every seed must have the k, or the mean would mix seeds
        values = [e[f"pass@{k}"] for e in entries if f"pass@{k}" in e]
        cells.append(fmt(values) if len(values) == len(entries) else "–")
    return cells


def table3(runs: list[Run], suffix: str) -> str | None:
    """Table 3 (App. B.2.1): greedy and pass@k by delay and method, after the base model (module docstring)."""
    bench = suite_benchmark(fixed_delay_runs(runs))
    evaluated = [r for r in fixed_delay_runs(runs) if bench and final_entry(r, bench)]
    if not evaluated:
        return None
    fixed = [r for r in evaluated if r.group_size == main_group_size(evaluated)]  # other G: Table 4
    logged = {key for r in fixed for key in final_entry(r, bench) if key.startswith("pass@")}
    ks = [k for k in PAPER_KS if f"pass@{k}" in logged]
    header = ["Delay", "Method", "Greedy", *(f"pass@{k}" for k in ks), "seeds"]
    base = base_entries(evaluated, bench)
    rows = [["–", "Base (no RL)", *pass_cells(base, ks), "–"]] if base else []
    for d in sorted({r.delay for r in fixed}):
        for label, members in group(fixed, FIXED_DELAY_ORDER, delay=d).items():
            alive, collapsed = kept_and_collapsed(members)
            cells = pass_cells([final_entry(r, bench) for r in alive], ks) if alive else ["Training collapsed"]
            cells += [""] * (len(ks) + 1 - len(cells))
            rows.append([str(d), collapsed_label(label, len(members), collapsed), *cells, str(len(alive))])
    samples = sorted({final_entry(r, bench)["n"] for r in fixed})
    caption = (f"**Table 3{suffix}.** Performance on {bench_title(fixed, bench)} under different fixed "
               f"behavior-policy delays (G = {fixed[0].group_size}, checkpoint {final_steps(fixed)}). Greedy: "
               f"temperature 0; pass@k: the unbiased estimator from n = {', '.join(map(str, samples))} samples per "
               "question; D = 0 is synchronous with 4 inner steps; Base (no RL): the step-0 evaluation. Mean ± std "
               "over seeds, %.")  # fmt: skip
    return caption + "\n\n" + markdown_table(header, rows)


def seed_means(runs: list[Run], step: int, bench: str) -> tuple[list[float], list[float]]:
    """Greedy and avg@n values at ``step`` of the runs evaluated there (one per run)."""
    entries = [e for e in (entry_at(r, step, bench) for r in runs) if e]
    return [e["greedy"] for e in entries], [e["avg@n"] for e in entries]


def pass_delta(gmc: list[float], tic: list[float]) -> str:
    """Δ Pass@1: GMC-GRPO's sampled Pass@1 minus TIC-GRPO's (seed means), in percentage points, signed."""
    if not gmc or not tic:
        return "–"
    return f"{100 * (statistics.fmean(gmc) - statistics.fmean(tic)):+.{DIGITS}f}"


def table4(runs: list[Run], suffix: str) -> str | None:
    """Table 4 (App. B.2.2): rows checkpoint x G; GMC-GRPO, TIC-GRPO and their Δ sampled Pass@1 (module docstring)."""
    fixed = [r for r in fixed_delay_runs(runs) if r.method in ("gmc", "tic") and r.eps_schedule == "constant"]
    delay, bench = group_size_delay(fixed), suite_benchmark(fixed)
    if delay is None or bench is None:
        return None
    at = [r for r in fixed if r.delay == delay and collapse_step(r) is None]
    sizes = sorted({r.group_size for r in at})
    steps = sorted({s for r in at for s in r.evals if s > 0 and entry_at(r, s, bench)})
    n = sorted({entry_at(r, s, bench)["n"] for r in at for s in steps if entry_at(r, s, bench)})
    header = ["Checkpoint", "G", "GMC-GRPO", "TIC-GRPO", "Δ Pass@1 (pp)", "seeds"]
    rows = []
    for step in steps:
        for g in sizes:
            gmc = seed_means([r for r in at if r.method == "gmc" and r.group_size == g], step, bench)
            tic = seed_means([r for r in at if r.method == "tic" and r.group_size == g], step, bench)
            cells = [f"{fmt(v[0])} / {fmt(v[1])}" if v[0] else "–" for v in (gmc, tic)]
            rows.append([str(step), str(g), *cells, pass_delta(gmc[1], tic[1]), f"{len(gmc[0])} / {len(tic[0])}"])
    caption = (f"**Table 4{suffix}.** {bench_title(at, bench)} evaluation at checkpoints {', '.join(map(str, steps))} "
               f"under the fixed-delay setting with delay {delay}, by group size G. Each method entry reports "
               f"greedy accuracy / sampled Pass@1 (%), the latter avg@{', '.join(map(str, n))} (mean correctness over "
               "the samples per problem); Δ: GMC-GRPO's sampled Pass@1 minus TIC-GRPO's, in percentage points. Mean "
               "± std over seeds (seeds: GMC-GRPO / TIC-GRPO).")  # fmt: skip
    return caption + "\n\n" + markdown_table(header, rows)


def tables(runs: list[Run], missing: list[str]) -> str:
    """Tables 1, 3, 4 and 5 in Markdown (those the runs have data for)."""
    parts = [table1(runs)]
    fixed_groups = model_groups(fixed_delay_runs(runs))
    for model, members in fixed_groups.items():
        suffix = f" ({model_name(model)})" if len(fixed_groups) > 1 else ""
        parts += [table3(members, suffix), table4(members, suffix)]
    parts.append(table5(runs))
    if missing:
        parts.append(f"Not finished (left out): {', '.join(missing)}.")
    return "\n\n".join(p for p in parts if p) + "\n"


def figure_a3po(runs: list[Run], out: Path) -> list[Path]:
    """Figure 6 (App. B.2.3): training reward of A-3PO (red) and GMC-GRPO under simulated asynchronous delays,
    one panel per model that ran A-3PO; faint per update (seed mean), solid the centred rolling mean."""
    compared = [r for r in simulated_runs(runs) if r.method in TABLE5_ORDER and r.series(REWARD_TAGS)]
    groups = {m: members for m, members in model_groups(compared).items() if any(r.method == "a3po" for r in members)}
    if not groups:
        return []
    fig, axes = panels(len(groups), "Training reward under simulated asynchronous delays")
    for ax, (model, members) in zip(axes, groups.items(), strict=True):
        for label, at in group(members, TABLE5_ORDER).items():
            steps, mean, _ = seed_mean([r.series(REWARD_TAGS) for r in at])
            colour = "tab:red" if at[0].method == "a3po" else "tab:blue"
            faint_and_smoothed(ax, steps, mean, f"{label} ({seeds(len(at))})", color=colour)
        ax.set(title=model_name(model), xlabel="update")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("training reward")
    return save(fig, out, "fig6_a3po_reward")


def pass_at_1(entry: dict) -> float:
    """pass@1 of a benchmark entry; avg@n is the same number when the file predates pass@k."""
    return entry.get("pass@1", entry["avg@n"])


def pass_curve(runs: list[Run], bench: str) -> tuple[list[int], list[float], list[float]]:
    """Sampled Pass@1 against checkpoint: seed mean and std at the steps every run evaluated."""
    return seed_mean([[(s, pass_at_1(entry_at(r, s, bench))) for s in sorted(r.evals) if entry_at(r, s, bench)]
                      for r in runs])  # fmt: skip


def figure_pass_at_1(runs: list[Run], out: Path, stem: str, delays: tuple[int, ...] | None = None) -> list[Path]:
    """Figures 2 and 3: sampled Pass@1 against checkpoint, a panel per delay (``delays``: those of them run; None:
    every delay), a line per method in the paper's order (band: one std over seeds), per model group."""
    bench = suite_benchmark(fixed_delay_runs(runs))
    evaluated = [r for r in fixed_delay_runs(runs) if bench and any(entry_at(r, s, bench) for s in r.evals)]
    fixed = [r for r in evaluated if r.group_size == main_group_size(evaluated)] if evaluated else []
    groups, written = model_groups(fixed), []
    for model, members in groups.items():
        shown = sorted({r.delay for r in members} & set(delays if delays is not None else {r.delay for r in members}))
        if not shown:
            continue
        title = f"Sampled Pass@1 on {bench_title(members, bench)} under fixed delays ({model_name(model)})"
        fig, axes = panels(len(shown), title)
        for ax, delay in zip(axes, shown, strict=True):
            for label, at in group(members, FIXED_DELAY_ORDER, delay=delay).items():
                steps, mean, std = pass_curve(at, bench)
                line = ax.plot(steps, [100 * m for m in mean], marker="o", label=f"{label} ({seeds(len(at))})")[0]
                ax.fill_between(steps, [100 * (m - e) for m, e in zip(mean, std, strict=True)],
                                [100 * (m + e) for m, e in zip(mean, std, strict=True)], color=line.get_color(),
                                alpha=0.15)  # fmt: skip
            ax.set(title=f"D = {delay}", xlabel="checkpoint (update)")
            ax.legend(fontsize=7)
        axes[0].set_ylabel("sampled Pass@1 (%)")
        written += save(fig, out, stem + (f"_{model_name(model)}" if len(groups) > 1 else ""))
    return written


def figures(runs: list[Run], out: Path) -> list[Path]:
    """Figures 2-6 (those the runs have data for)."""
    written = figure_pass_at_1(runs, out, "fig2_pass_at_1", FIGURE2_DELAYS)
    written += figure_pass_at_1(runs, out, "fig3_pass_at_1")
    written += figure_entropy(runs, out) + figure_reward_by_group_size(runs, out)
    return written + figure_a3po(runs, out)


def main(argv: list[str] | None = None) -> list[Path]:
    """Write ``paper_tables.md`` and Figures 2-6 for a sweep and/or run folders; returns the paths written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_sources(parser)
    parser.add_argument("--out", required=True, help="folder for the figures and paper_tables.md")
    parser.add_argument("--doc", default=None, help="Markdown file whose block is replaced by the tables")
    parser.add_argument("--block", default="paper_tables", help="name of that block's markers")
    args = parser.parse_args(argv)
    runs, missing = load_sources(parser, args)
    out = Path(args.out)
    return write_outputs(out, "paper_tables.md", tables(runs, missing), figures(runs, out), args.doc, args.block)


if __name__ == "__main__":
    main()

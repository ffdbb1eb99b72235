"""The paper's Tables 1, 3, 4 and 5 and Figures 2/3 and 6, from runs' TensorBoard logs and evaluation JSONs.

Runs come from a sweep (``--sweep``: ``scripts/plots.py``'s :func:`load_sweep` reads the manifest of
``scripts/sweep.py``, each run's TensorBoard scalars and its ``eval/step_<n>.json`` files; runs not marked done
are left out and listed) and/or from runs launched directly with ``python -m lit_gmc fit``, one logger folder
per run (``--runs runs/simulated_async/qwen3_4b_gmc ...``, or ``--runs-root runs/simulated_async`` for every
folder under it with a ``version_<n>/config.yaml``; :func:`load_run_folders`). Such a run's parameters come from
the ``config.yaml`` LightningCLI saved (method: the ``model.correction`` class, model ``model.actor``, seed
``seed_everything``, G ``data.group_size``, GMC's ``cap_schedule``; D from a ``FixedDelay`` schedule, 0 for
``Sync``, none for ``VirtualClock`` and ``Live``), and all its ``version_<n>`` folders (a resumption writes the
next one) are merged into one run, a later version winning a step both logged. A run whose logs stop before
``trainer.max_steps`` is left out and listed, unless ``--include-unfinished``.

A row is a method (its label, e.g. ``GMC + Cor. 1`` for the adaptive threshold; ``(D = d)``, or the schedule's
name for a run without a fixed delay, is added when the runs have several settings); a cell is the mean ± std
over the row's seeds (a bare mean for one seed), in percent. Runs are grouped by model (the manifest's ``actor``
or ``model`` field, else ``--set model.actor``, else the run's config.json; a run folder's ``model.actor``; one
group when none names it), ordered by parameter count.

Outputs in ``--out``:

- ``paper_tables.md``:

  - **Table 1** (one per model group), for the simulated-asynchronous suite: "greedy / avg@n" at each run's
    final evaluated checkpoint for each benchmark (the paper's order: MATH-500, GSM8K, Gaokao2023-En,
    OlympiadBench, Minerva, AMC23; any other benchmark after them, by name), their macro average (unweighted
    mean over the benchmarks) and the average delay: the mean over updates of the per-update ``delay/mean``
    (when a run lacks it, the last ``delay/running_mean``, the same number when DelayAccounting is on).
  - **Table 3** (one per model group), for the fixed-delay suite (runs with a fixed delay D; ``Sync`` is D = 0):
    a row per delay and method at the most common G (other sizes are Table 4's), after ``Base (no RL)``, the
    step-0 evaluation (identical evaluations of the same base model counted once); columns Greedy and unbiased
    pass@k for k in {1, 2, 4, 8, 16} on MATH-500 at the final evaluated checkpoint.
  - **Table 4** (one per model group), the group-size study: at the delay where several group sizes G were run
    (the paper: G in {4, 8, 32} at D = 128), a row per method and G, a column per evaluated checkpoint (the
    paper: 200/300/400/800) with MATH-500 "greedy / avg@n", and for G other than 8 the difference of the seed
    means from G = 8 at that checkpoint, in points.
  - **Table 5**: A-3PO against GMC, a row per model and method: "greedy / avg@n" per benchmark at the final
    checkpoint, the macro average and the average delay (as Table 1).

- ``fig2_3_math500_pass_at_1`` (PNG + PDF; ``_<model>`` added when there are several models): MATH-500 pass@1
  (avg@n) against checkpoint, one panel per delay D, one line per method (seed mean, band = one standard
  deviation), the step-0 evaluation included: the paper's Figures 2 and 3.
- ``fig6_a3po_reward`` (PNG + PDF): training reward per update (``train/reward``), centred rolling mean over
  25 updates of the seed mean, one line per method, one panel per model group, A-3PO drawn thick in red so that
  its collapse stands out; a second row shows token entropy (``diag/entropy/mean``) the same way when the runs
  logged it.

A cell is the mean ± std over the row's seeds (a bare mean for one seed), in percent; "–" where no run has it.

Interpretation: the paper's text is not on this machine. The layouts follow the descriptions in DESIGN.md and
issue 27 (Table 3: rows Delay x Method plus "Base (no RL)", columns Greedy and pass@1..16 on MATH-500; Table 4:
G in {4, 8, 32} at D = 128, greedy and avg@16 at 200/300/400/800 with deltas; Table 5: per-benchmark cells plus
the average delay; Figures 2/3: MATH-500 pass@1 against checkpoint, per delay). Three details are guesses, and
the captions say so: Table 4's deltas are taken against G = 8, Table 5 keeps only A-3PO and GMC, and Figures 2
and 3 are drawn as one figure with a panel per delay (which delays the paper puts in which figure is not known
here). ``--doc FILE`` replaces the block between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in FILE
(``NAME`` from ``--block``, default ``paper_tables``). Example::

    python scripts/tables.py --sweep runs/study --out docs/figures/study
    python scripts/tables.py --runs-root runs/simulated_async --out docs/figures/qwen3
    python scripts/tables.py --runs-root runs/fixed_delay_d* runs/group_size_g* --out docs/figures/fixed_delay
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

# scripts/ is not a package: `python scripts/tables.py` puts this folder on the path, an import by file path
# (the tests) does not.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only; set before pyplot is imported, whichever module imports it first
import matplotlib.pyplot as plt  # noqa: E402
from plots import (  # noqa: E402
    ENTROPY_TAGS,
    REWARD_TAGS,
    WINDOW,
    Run,
    add_run_sources,
    cell,
    eval_summary,
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

from lit_gmc.callbacks.diagnostics import centred_rolling_mean  # noqa: E402
from lit_gmc.callbacks.evaluation import PAPER_BENCHMARKS  # noqa: E402
from lit_gmc.callbacks.metrics import PAPER_KS  # noqa: E402

HIGHLIGHT = "a3po"
"""The method Figure 6 is about, drawn in red; the others take the remaining tab10 colours, so none is red."""
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive",
           "tab:cyan")  # fmt: skip


def final_benchmarks(run: Run) -> dict[str, dict]:
    """``{name: entry}`` of the run's last evaluated checkpoint (empty when it was never evaluated)."""
    return run.evals[max(run.evals)]["benchmarks"] if run.evals else {}


def benchmark_columns(runs: list[Run]) -> list[str]:
    """Benchmarks of the runs' final checkpoints: the paper's six in its order, then any others by name."""
    names = {name for run in runs for name in final_benchmarks(run)}
    return [b for b in PAPER_BENCHMARKS if b in names] + sorted(names - set(PAPER_BENCHMARKS))


def column_titles(runs: list[Run], columns: list[str]) -> list[str]:
    """``"MATH-500 (n = 16)"``: each benchmark's display title and samples per problem, from the eval files."""
    entries = {name: entry for run in runs for name, entry in final_benchmarks(run).items()}
    return [f"{entries[c].get('title', c)} (n = {entries[c]['n']})" for c in columns]


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


def setting_key(run: Run) -> tuple[int, int, str]:
    """A run's delay setting, for sorting: fixed delays by D, then runs without one by schedule name."""
    return (0, run.delay, "") if run.delay is not None else (1, 0, run.schedule)


def setting_name(run: Run) -> str:
    """``"D = 32"``, or the schedule of a run without a fixed delay (``"VirtualClock"``)."""
    return f"D = {run.delay}" if run.delay is not None else (run.schedule or "no fixed delay")


def method_rows(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs by method label; split by delay setting too when the runs have several (never average over them)."""
    settings = sorted({setting_key(r) for r in runs})
    if len(settings) == 1:
        return group(runs)
    rows = {}
    for label, members in group(runs).items():
        for key in settings:
            at = [r for r in members if setting_key(r) == key]
            if at:
                rows[f"{label} ({setting_name(at[0])})"] = at
    return rows


def pair(greedy: list[float], avg: list[float]) -> str:
    """``"greedy / avg@n"`` cell, each mean ± std over seeds, in percent."""
    return f"{cell(greedy)} / {cell(avg)}" if greedy else "–"


def macro_pair(members: list[Run]) -> str:
    """Macro-average ``"greedy / avg@n"`` over the benchmarks of each run's final checkpoint."""
    finals = [eval_summary(r.evals[max(r.evals)]) for r in members if r.evals]
    return pair([f["greedy"] for f in finals], [f["avg@n"] for f in finals])


def final_steps(runs: list[Run]) -> str:
    """The final evaluated updates, for captions (``"800"``, or ``"400, 800"`` when runs differ)."""
    return ", ".join(str(s) for s in sorted({max(r.evals) for r in runs if r.evals})) or "none"


def benchmark_row(label: str, members: list[Run], columns: list[str]) -> list[str]:
    """Label, seeds, "greedy / avg@n" per benchmark, macro average and average delay of one row's runs."""
    row = [label, str(len(members))]
    for name in columns:
        entries = [final_benchmarks(r)[name] for r in members if name in final_benchmarks(r)]
        row.append(pair([e["greedy"] for e in entries], [e["avg@n"] for e in entries]))
    delays = [d for d in map(average_delay, members) if d is not None]
    return row + [macro_pair(members), cell(delays, scale=1.0)]


def table1(runs: list[Run], suffix: str) -> str:
    """Per-benchmark accuracy, macro average and average delay of one model group (module docstring)."""
    columns = benchmark_columns(runs)
    header = ["method", "seeds", *column_titles(runs, columns), "macro average", "avg. delay"]
    rows = [benchmark_row(label, members, columns) for label, members in method_rows(runs).items()]
    caption = (f"**Table 1{suffix}.** Accuracy at the final evaluated checkpoint (update {final_steps(runs)}), "
               "greedy / avg@n (%), mean ± std over seeds; macro average over the benchmarks; average delay "
               "(mean of `delay/mean` over updates).\n")  # fmt: skip
    return caption + "\n" + markdown_table(header, rows)


MATH500 = "math500"
"""The benchmark of the fixed-delay suite (Table 3, Figures 2/3) and of the group-size study (Table 4)."""
REFERENCE_G = 8
"""Table 4's deltas are taken against this group size (the paper's default G)."""


def fixed_delay_runs(runs: list[Run]) -> list[Run]:
    """Runs with a fixed delay D (``FixedDelay``, and ``Sync`` as D = 0); a sweep's runs always have one."""
    return [r for r in runs if r.delay is not None]


def math500_at(run: Run, step: int) -> dict | None:
    """The run's MATH-500 entry at ``step`` (None when that step or benchmark was not evaluated)."""
    return run.evals.get(step, {}).get("benchmarks", {}).get(MATH500)


def math500_final(run: Run) -> dict | None:
    """The MATH-500 entry of the run's last evaluated checkpoint."""
    return math500_at(run, max(run.evals)) if run.evals else None


def base_entries(runs: list[Run]) -> list[dict]:
    """MATH-500 entries of the step-0 evaluations: the base model before any update.

    Every run of a suite starts from the same weights and evaluates with the same seed, so their step-0 entries
    are equal; identical ones count once (a spread would otherwise claim seeds that are not there).
    """
    unique = {}
    for entry in filter(None, (math500_at(r, 0) for r in runs)):
        unique.setdefault(json.dumps(entry, sort_keys=True), entry)
    return list(unique.values())


def math500_cells(entries: list[dict], ks: list[int]) -> list[str]:
    """Greedy and pass@k cells of MATH-500 entries (one per seed)."""
    cells = [cell([e["greedy"] for e in entries])]
    for k in ks:  # every seed must have the k, or the mean would mix seeds
        values = [e[f"pass@{k}"] for e in entries if f"pass@{k}" in e]
        cells.append(cell(values) if len(values) == len(entries) else "–")
    return cells


def table3(runs: list[Run], suffix: str) -> str | None:
    """Greedy and pass@k on MATH-500 by delay and method, plus the base model (module docstring)."""
    evaluated = [r for r in fixed_delay_runs(runs) if math500_final(r)]
    if not evaluated:
        return None
    fixed = [r for r in evaluated if r.group_size == main_group_size(evaluated)]  # other G: Table 4
    logged = {key for r in fixed for key in math500_final(r) if key.startswith("pass@")}
    ks = [k for k in PAPER_KS if f"pass@{k}" in logged]
    header = ["D", "method", "seeds", "Greedy", *(f"pass@{k}" for k in ks)]
    base = base_entries(evaluated)
    rows = [["–", "Base (no RL)", "–", *math500_cells(base, ks)]] if base else []
    for d in sorted({r.delay for r in fixed}):
        for label, members in group(fixed, delay=d).items():
            rows.append([str(d), label, str(len(members)), *math500_cells([math500_final(r) for r in members], ks)])
    caption = (f"**Table 3{suffix}.** MATH-500: greedy accuracy and unbiased pass@k (%) at the final evaluated "
               f"checkpoint (update {final_steps(fixed)}), by delay D (D = 0: synchronous, 4 inner steps) and "
               "method, mean ± std over seeds; Base (no RL): the step-0 evaluation.\n")  # fmt: skip
    return caption + "\n" + markdown_table(header, rows)


def entries_at(runs: list[Run], step: int) -> list[dict]:
    """MATH-500 entries of the runs evaluated at ``step`` (one per run)."""
    return [e for e in (math500_at(r, step) for r in runs) if e]


def seed_pair(entries: list[dict]) -> tuple[float, float] | None:
    """Seed means of greedy and avg@n, for deltas."""
    if not entries:
        return None
    return statistics.fmean(e["greedy"] for e in entries), statistics.fmean(e["avg@n"] for e in entries)


def table4(runs: list[Run], suffix: str) -> str | None:
    """MATH-500 greedy / avg@n per checkpoint by method and group size, with deltas from G = 8 (module docstring)."""
    fixed = fixed_delay_runs(runs)
    delay = group_size_delay(fixed)
    if delay is None:
        return None
    at = [r for r in fixed if r.delay == delay and r.eps_schedule == "constant"]
    sizes = sorted({r.group_size for r in at})
    steps = sorted({s for r in at for s in r.evals if s > 0 and math500_at(r, s)})
    n = {math500_at(r, s)["n"] for r in at for s in steps}
    avg_n = f"avg@{n.pop()}" if len(n) == 1 else "avg@n"
    header = ["method", "G", "seeds", *(f"update {s}" for s in steps)]
    rows = []
    for label, members in group(at).items():
        for g in sizes:
            mine = [r for r in members if r.group_size == g]
            if not mine:
                continue
            row = [label, str(g), str(len(mine))]
            for step in steps:
                entries = entries_at(mine, step)
                text = pair([e["greedy"] for e in entries], [e["avg@n"] for e in entries])
                ours = seed_pair(entries)
                ref = seed_pair(entries_at([r for r in members if r.group_size == REFERENCE_G], step))
                if g != REFERENCE_G and ours and ref:
                    text += f" (Δ {100 * (ours[0] - ref[0]):+.1f} / {100 * (ours[1] - ref[1]):+.1f})"
                row.append(text)
            rows.append(row)
    caption = (f"**Table 4{suffix}.** Group size G at delay D = {delay}: MATH-500 greedy / {avg_n} (%) at each "
               f"checkpoint, mean ± std over seeds; Δ: difference of the seed means from G = {REFERENCE_G}, in "
               "points (the paper's deltas are read as against G = 8; its text is not on this machine).\n")  # fmt: skip
    return caption + "\n" + markdown_table(header, rows)


def table5(runs: list[Run]) -> str | None:
    """A-3PO and GMC per model: per-benchmark cells, macro average and average delay (module docstring)."""
    compared = [r for r in runs if r.method in ("a3po", "gmc")]
    if not any(r.method == "a3po" for r in compared):
        return None
    columns = benchmark_columns(compared)
    header = ["model", "method", "seeds", *column_titles(compared, columns), "macro average", "avg. delay"]
    rows = []
    for model, members in model_groups(compared).items():
        for label, at in method_rows(members).items():
            rows.append([model_name(model), *benchmark_row(label, at, columns)])
    caption = ("**Table 5.** A-3PO against GMC by model: greedy / avg@n (%) per benchmark at the final evaluated "
               f"checkpoint (update {final_steps(compared)}), macro average and average delay, mean ± std over "
               "seeds (the other methods are in Table 1).\n")  # fmt: skip
    return caption + "\n" + markdown_table(header, rows)


def tables(runs: list[Run], missing: list[str]) -> str:
    """Tables 1, 3, 4 and 5 in Markdown (those the runs have data for)."""
    groups = model_groups(runs)
    parts = []
    for model, members in groups.items():
        suffix = f" ({model_name(model)})" if len(groups) > 1 else ""
        parts += [table1(members, suffix), table3(members, suffix), table4(members, suffix)]
    parts.append(table5(runs))
    if missing:
        parts.append(f"Not finished (left out): {', '.join(missing)}.")
    return "\n\n".join(p for p in parts if p) + "\n"


def method_colours(runs: list[Run]) -> dict[str, str]:
    """``label -> colour``, the same in every panel: A-3PO red, the others from :data:`PALETTE` in row order."""
    rows = method_rows(runs)
    others = [label for label, members in rows.items() if members[0].method != HIGHLIGHT]
    colours = {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(others)}
    return {label: colours.get(label, "tab:red") for label in rows}


def plot_curves(ax, runs: list[Run], tags: tuple[str, ...], colours: dict[str, str]) -> None:
    """One centred-rolling-mean line per method (seed mean first); the highlighted method thick, on top."""
    for label, members in method_rows(runs).items():
        steps, mean, _ = seed_mean([r.series(tags) for r in members])
        if not steps:
            continue
        highlight = members[0].method == HIGHLIGHT
        ax.plot(steps, centred_rolling_mean(mean, WINDOW), label=label, color=colours[label],
                linewidth=2.6 if highlight else 1.1, zorder=3 if highlight else 2)  # fmt: skip


def figure_a3po(runs: list[Run], out: Path) -> list[Path]:
    """Figure 6: reward (and entropy when logged) per update, one column per model group."""
    if not any(r.series(REWARD_TAGS) for r in runs):
        return []
    groups, colours = model_groups(runs), method_colours(runs)
    quantities = [(REWARD_TAGS, "training reward")]
    if any(r.series(ENTROPY_TAGS) for r in runs):
        quantities.append((ENTROPY_TAGS, "entropy (nats / token)"))
    fig, axes = plt.subplots(len(quantities), len(groups), figsize=(4.6 * len(groups), 3.3 * len(quantities)),
                             squeeze=False, sharex="col", sharey="row")  # fmt: skip
    fig.suptitle(f"A-3PO vs the other methods: centred mean of {WINDOW} updates")
    for col, (model, members) in enumerate(groups.items()):
        axes[0][col].set_title(model_name(model))
        for row, (tags, ylabel) in enumerate(quantities):
            plot_curves(axes[row][col], members, tags, colours)
            axes[row][0].set_ylabel(ylabel)
        axes[-1][col].set_xlabel("update")
        axes[0][col].legend(fontsize=7)
    return save(fig, out, "fig6_a3po_reward")


def pass_at_1(entry: dict) -> float:
    """pass@1 of a benchmark entry; avg@n is the same number when the file predates pass@k."""
    return entry.get("pass@1", entry["avg@n"])


def math500_curve(runs: list[Run]) -> tuple[list[int], list[float], list[float]]:
    """MATH-500 pass@1 against checkpoint: seed mean and std at the steps every run evaluated."""
    return seed_mean([[(s, pass_at_1(math500_at(r, s))) for s in sorted(r.evals) if math500_at(r, s)] for r in runs])


def figure_math500(runs: list[Run], out: Path) -> list[Path]:
    """Figures 2/3: MATH-500 pass@1 against checkpoint, a panel per delay, per model group (module docstring)."""
    evaluated = [r for r in fixed_delay_runs(runs) if any(math500_at(r, s) for s in r.evals)]
    fixed = [r for r in evaluated if r.group_size == main_group_size(evaluated)] if evaluated else []
    groups, written = model_groups(fixed), []
    for model, members in groups.items():
        delays = sorted({r.delay for r in members})
        fig, axes = panels(len(delays), f"MATH-500 pass@1 vs checkpoint ({model_name(model)})")
        for ax, delay in zip(axes, delays, strict=True):
            for label, at in group(members, delay=delay).items():
                steps, mean, std = math500_curve(at)
                line = ax.plot(steps, [100 * m for m in mean], marker="o", label=f"{label} ({seeds(len(at))})")[0]
                ax.fill_between(steps, [100 * (m - e) for m, e in zip(mean, std, strict=True)],
                                [100 * (m + e) for m, e in zip(mean, std, strict=True)], color=line.get_color(),
                                alpha=0.15)  # fmt: skip
            ax.set(title=f"D = {delay}", xlabel="update (checkpoint)")
            ax.legend(fontsize=7)
        axes[0].set_ylabel("MATH-500 pass@1 (%)")
        stem = "fig2_3_math500_pass_at_1" + (f"_{model_name(model)}" if len(groups) > 1 else "")
        written += save(fig, out, stem)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    """Write ``paper_tables.md``, Figures 2/3 and 6 for a sweep and/or run folders; returns the paths written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_sources(parser)
    parser.add_argument("--out", required=True, help="folder for the figure and paper_tables.md")
    parser.add_argument("--doc", default=None, help="Markdown file whose block is replaced by the tables")
    parser.add_argument("--block", default="paper_tables", help="name of that block's markers")
    args = parser.parse_args(argv)
    runs, missing = load_sources(parser, args)
    out = Path(args.out)
    written = figure_math500(runs, out) + figure_a3po(runs, out)
    return write_outputs(out, "paper_tables.md", tables(runs, missing), written, args.doc, args.block)


if __name__ == "__main__":
    main()

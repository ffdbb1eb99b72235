"""The paper's per-benchmark tables and its A-3PO figure, from runs' TensorBoard logs and evaluation JSONs.

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
  - **Table 3, pass@k columns** (one per model group): unbiased pass@k for k in {1, 2, 4, 8, 16}, a row per
    method and k, a column per benchmark and a macro average. A benchmark sampled fewer than k times has no
    pass@k ("–"), and the macro average is given only where every benchmark has that k.
  - **Table 5**: A-3PO against GMC and every other method present, per model: the macro-average
    "greedy / avg@n" at the final checkpoint, a column per model group.

- ``fig6_a3po_reward`` (PNG + PDF): training reward per update (``train/reward``), centred rolling mean over
  25 updates of the seed mean, one line per method, one panel per model group, A-3PO drawn thick in red so that
  its collapse stands out; a second row shows token entropy (``diag/entropy/mean``) the same way when the runs
  logged it.

Interpretation: the paper's text was not available when this was written. Table 5 and Figure 6 are built as
above (Table 5 per model size; Figure 6 reward, and entropy when present, against updates) from what the paper's
captions say they show: A-3PO against GMC per model size, and A-3PO's collapse over training. ``--doc FILE``
replaces the block between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in FILE (``NAME`` from
``--block``, default ``paper_tables``). Example::

    python scripts/tables.py --sweep runs/study --out docs/figures/study
    python scripts/tables.py --runs-root runs/simulated_async --out docs/figures/qwen3
"""

from __future__ import annotations

import argparse
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
    load_sources,
    markdown_table,
    save,
    seed_mean,
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


def table1(runs: list[Run], suffix: str) -> str:
    """Per-benchmark accuracy, macro average and average delay of one model group (module docstring)."""
    columns = benchmark_columns(runs)
    header = ["method", "seeds", *column_titles(runs, columns), "macro average", "avg. delay"]
    rows = []
    for label, members in method_rows(runs).items():
        row = [label, str(len(members))]
        for name in columns:
            entries = [final_benchmarks(r)[name] for r in members if name in final_benchmarks(r)]
            row.append(pair([e["greedy"] for e in entries], [e["avg@n"] for e in entries]))
        delays = [d for d in map(average_delay, members) if d is not None]
        rows.append(row + [macro_pair(members), cell(delays, scale=1.0)])
    caption = (f"**Table 1{suffix}.** Accuracy at the final evaluated checkpoint (update {final_steps(runs)}), "
               "greedy / avg@n (%), mean ± std over seeds; macro average over the benchmarks; average delay "
               "(mean of `delay/mean` over updates).\n")  # fmt: skip
    return caption + "\n" + markdown_table(header, rows)


def pass_at_k_cell(members: list[Run], columns: list[str], name: str | None, k: int) -> str:
    """pass@k of one benchmark (``name``), or the macro average over ``columns`` (``None``), in percent."""
    key, values = f"pass@{k}", []
    for run in members:
        benches = final_benchmarks(run)
        wanted = [benches.get(c, {}) for c in ([name] if name else columns)]
        if all(key in b for b in wanted):  # a macro average over fewer benchmarks would not compare
            values.append(statistics.fmean(b[key] for b in wanted))
    return cell(values)


def table3(runs: list[Run], suffix: str) -> str:
    """pass@k per benchmark and method of one model group (module docstring)."""
    columns = benchmark_columns(runs)
    logged = {key for r in runs for b in final_benchmarks(r).values() for key in b if key.startswith("pass@")}
    ks = [k for k in PAPER_KS if f"pass@{k}" in logged]
    header = ["method", "k", *column_titles(runs, columns), "macro average"]
    rows = []
    for label, members in method_rows(runs).items():
        for k in ks:
            cells = [pass_at_k_cell(members, columns, name, k) for name in [*columns, None]]
            rows.append([label, str(k), *cells])
    caption = (
        f"**Table 3{suffix}, pass@k.** Unbiased pass@k (%) at the final evaluated checkpoint (update "
        f"{final_steps(runs)}), mean ± std over seeds; – where a benchmark has fewer than k samples.\n"
    )
    return caption + "\n" + markdown_table(header, rows)


def table5(runs: list[Run]) -> str:
    """Macro-average accuracy of every method (A-3PO and GMC among them) for each model group."""
    groups = model_groups(runs)
    header = ["method", *(model_name(m) for m in groups)]
    rows = [[label, *(macro_pair(method_rows(members).get(label, [])) for members in groups.values())]
            for label in method_rows(runs)]  # fmt: skip
    caption = (
        "**Table 5.** A-3PO against GMC and the other methods by model: macro-average greedy / avg@n (%) "
        "over the benchmarks at the final evaluated checkpoint, mean ± std over seeds.\n"
    )
    return caption + "\n" + markdown_table(header, rows)


def tables(runs: list[Run], missing: list[str]) -> str:
    """Tables 1, 3 (pass@k) and 5 in Markdown."""
    groups = model_groups(runs)
    parts = []
    for model, members in groups.items():
        suffix = f" ({model_name(model)})" if len(groups) > 1 else ""
        parts += [table1(members, suffix), table3(members, suffix)]
    parts.append(table5(runs))
    if missing:
        parts.append(f"Not finished (left out): {', '.join(missing)}.")
    return "\n\n".join(parts) + "\n"


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


def main(argv: list[str] | None = None) -> list[Path]:
    """Write ``paper_tables.md`` and Figure 6 for a sweep and/or run folders; returns the paths written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_sources(parser)
    parser.add_argument("--out", required=True, help="folder for the figure and paper_tables.md")
    parser.add_argument("--doc", default=None, help="Markdown file whose block is replaced by the tables")
    parser.add_argument("--block", default="paper_tables", help="name of that block's markers")
    args = parser.parse_args(argv)
    runs, missing = load_sources(parser, args)
    out = Path(args.out)
    written = figure_a3po(runs, out)
    return write_outputs(out, "paper_tables.md", tables(runs, missing), written, args.doc, args.block)


if __name__ == "__main__":
    main()

"""Figures and tables of a sweep, from its TensorBoard logs and evaluation JSONs alone (matplotlib, PNG + PDF).

Reads ``SWEEP/manifest.json`` (written by ``scripts/sweep.py``) for each run's parameters, the run's
TensorBoard scalars (``lit_gmc.tblog.read_scalars``) and its ``eval/step_<n>.json`` files (the format of
``lit_gmc.callbacks.evaluation``: ``{"step", "benchmarks": {name: {"greedy", "avg@n", "n", "pass@k"...}}}``).
Runs not marked done in the manifest are left out and listed. Outputs:

- ``fig2_pass_at_1``: sampled pass@1 (avg@n) on the held-out prompts vs checkpoint, one panel per delay,
  one line per method (mean over seeds, band = one standard deviation); the paper's Figures 2/3.
- ``fig4_entropy``: token entropy per update, faint raw and solid centred rolling mean (window 25), a dashed
  line where the delay queue starts draining, one panel per delay; the paper's Figure 4.
- ``fig5_reward_by_group_size``: training reward (centred rolling mean) for each group size G at the delay
  of the group-size runs; the paper's Figure 5.
- ``tables.md``: Markdown tables, "greedy / avg@n" in percent, mean ± std over seeds: held-out accuracy and
  final training reward by method and delay (Table 1), the corrections' diagnostics by method and delay
  (Table 2), by group size (Table 3), and constant vs Corollary-1 threshold at the largest delay (Table 4).
  ``--doc FILE`` also replaces the block between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in FILE
  (``NAME`` from ``--block``, default ``tables``).

Example::

    python scripts/plots.py --sweep runs/study --out docs/figures/tiny --doc docs/results_tiny.md
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

from lit_gmc.callbacks.diagnostics import centred_rolling_mean  # noqa: E402
from lit_gmc.tblog import read_scalars  # noqa: E402

WINDOW = 25
FINAL_UPDATES = 25
"""The final training reward is the mean over the last this many updates (one update's 64 samples are noisy)."""
REWARD_TAGS = ("diag/reward/mean", "train/reward")
ENTROPY_TAGS = ("diag/entropy/mean", "train/entropy")
DIAGNOSTICS = (("diag/tic/dropped_fraction", "TIC-dropped trajectories", "mean"),
               ("diag/gmc/rescaled_fraction", "GMC-rescaled groups", "mean"),
               ("diag/removed_mass/mean", "removed mass (median)", "median"),
               ("diag/ess/mean_fraction_of_G", "ESS / G", "mean"),
               ("diag/log_rho/abs_mean", "mean abs log ratio", "mean"),
               ("diag/corr/log_rho_vs_length", "corr(log ratio, length)", "mean"))  # fmt: skip
"""Table 2: (tag, column, how the run's per-update values are summarised); the removed mass is heavy-tailed."""
METHOD_ORDER = ("grpo", "tic", "gmc")


@dataclass
class Run:
    """One finished run: its grid parameters, scalar series and evaluations by step."""

    name: str
    method: str
    delay: int
    group_size: int
    seed: int
    eps_schedule: str
    scalars: dict[str, list[tuple[int, float]]] = field(repr=False)
    evals: dict[int, dict[str, Any]] = field(repr=False)

    @property
    def label(self) -> str:
        return self.method.upper() + (" + Cor. 1" if self.eps_schedule == "corollary1" else "")

    def series(self, tags: tuple[str, ...]) -> list[tuple[int, float]]:
        for tag in tags:
            if tag in self.scalars:
                return self.scalars[tag]
        return []

    @property
    def drain_step(self) -> int | None:
        if "diag/drain/step" in self.scalars:
            return int(self.scalars["diag/drain/step"][0][1])
        draining = [s for s, v in self.scalars.get("schedule/draining", []) if v > 0.5]
        return min(draining) if draining else None

    def final_reward(self) -> float | None:
        values = [v for _, v in self.series(REWARD_TAGS)[-FINAL_UPDATES:]]
        return statistics.fmean(values) if values else None

    def final_eval(self) -> dict[str, float] | None:
        """``{"greedy", "avg@n", "pass@1", "n"}`` of the last evaluated checkpoint (macro over benchmarks)."""
        if not self.evals:
            return None
        return eval_summary(self.evals[max(self.evals)])


def eval_summary(entry: dict[str, Any]) -> dict[str, float]:
    """Macro average over the entry's benchmarks of greedy accuracy, avg@n and pass@1 (= avg@n when absent)."""
    benches = list(entry["benchmarks"].values())
    if not benches:
        raise ValueError(f"evaluation entry at step {entry.get('step')} has no benchmarks")
    greedy = statistics.fmean(b["greedy"] for b in benches)
    avg = statistics.fmean(b["avg@n"] for b in benches)
    pass1 = statistics.fmean(b.get("pass@1", b["avg@n"]) for b in benches)
    return {"greedy": greedy, "avg@n": avg, "pass@1": pass1, "n": benches[0]["n"]}


def load_sweep(sweep: Path) -> tuple[list[Run], list[str]]:
    """The finished runs of a sweep, and the names of those that are not finished."""
    manifest_path = sweep / "manifest.json"
    if not manifest_path.exists():
        raise FileNotFoundError(f"{manifest_path} not found: is {sweep} a sweep folder (scripts/sweep.py --out)?")
    manifest = json.loads(manifest_path.read_text())
    runs, missing = [], []
    for name, info in sorted(manifest["runs"].items()):
        run_dir = Path(info.get("dir") or sweep / "runs" / name)
        if not run_dir.is_absolute():
            run_dir = sweep / run_dir
        if info.get("status") != "done":
            missing.append(name)
            continue
        evals = {}
        for path in (run_dir / "eval").glob("step_*.json"):
            entry = json.loads(path.read_text())
            evals[int(entry["step"])] = entry
        runs.append(Run(name, info["method"], int(info["delay"]), int(info["group_size"]), int(info["seed"]),
                        info.get("eps_schedule", "constant"), read_scalars(run_dir), evals))  # fmt: skip
    return runs, missing


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def seed_mean(series: list[list[tuple[int, float]]]) -> tuple[list[int], list[float], list[float]]:
    """Mean and std across seeds at the steps every seed has."""
    common = sorted(set.intersection(*(set(s for s, _ in one) for one in series))) if series else []
    lookups = [dict(one) for one in series]
    stats = [mean_std([lookup[step] for lookup in lookups]) for step in common]
    return common, [m for m, _ in stats], [s for _, s in stats]


def group(runs: list[Run], **where: Any) -> dict[str, list[Run]]:
    """Runs matching ``where`` (attribute = value), by label, in a fixed method order."""
    out: dict[str, list[Run]] = {}
    for run in sorted(runs, key=lambda r: (order(r.method), r.eps_schedule, r.seed)):
        if all(getattr(run, key) == value for key, value in where.items()):
            out.setdefault(run.label, []).append(run)
    return out


def order(method: str) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def main_group_size(runs: list[Run]) -> int:
    """The group size of the delay grid: the most common one."""
    sizes = [r.group_size for r in runs]
    return max(set(sizes), key=sizes.count)


def panels(count: int, title: str):
    fig, axes = plt.subplots(1, count, figsize=(4.2 * count, 3.4), squeeze=False, sharey=True)
    fig.suptitle(title)
    return fig, axes[0]


def save(fig, out: Path, stem: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    for path in paths:
        # no creation date in the PDF, so regenerating unchanged figures gives identical files
        fig.savefig(path, dpi=150, metadata={"CreationDate": None} if path.suffix == ".pdf" else None)
    plt.close(fig)
    return paths


def figure_pass_at_1(runs: list[Run], out: Path) -> list[Path]:
    g = main_group_size(runs)
    delays = sorted({r.delay for r in runs if r.group_size == g})
    fig, axes = panels(len(delays), f"Held-out sampled pass@1 vs checkpoint (G = {g})")
    for ax, delay in zip(axes, delays, strict=True):
        for label, members in group(runs, delay=delay, group_size=g).items():
            steps, mean, std = seed_mean([[(s, eval_summary(e)["pass@1"]) for s, e in sorted(r.evals.items())]
                                          for r in members])  # fmt: skip
            line = ax.plot(steps, mean, marker="o", label=f"{label} ({seeds(len(members))})")[0]
            low = [m - s for m, s in zip(mean, std, strict=True)]
            high = [m + s for m, s in zip(mean, std, strict=True)]
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
        ax.set(title=f"delay D = {delay}", xlabel="update (checkpoint)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("pass@1 (avg@n)")
    return save(fig, out, "fig2_pass_at_1")


def figure_entropy(runs: list[Run], out: Path) -> list[Path]:
    g = main_group_size(runs)
    delays = sorted({r.delay for r in runs if r.group_size == g})
    fig, axes = panels(len(delays), f"Token entropy per update (faint: raw, solid: centred mean of {WINDOW})")
    for ax, delay in zip(axes, delays, strict=True):
        drains = set()
        for label, members in group(runs, delay=delay, group_size=g).items():
            steps, mean, _ = seed_mean([r.series(ENTROPY_TAGS) for r in members])
            line = ax.plot(steps, mean, alpha=0.25, linewidth=0.8)[0]
            ax.plot(steps, centred_rolling_mean(mean, WINDOW), color=line.get_color(), label=label)
            drains |= {r.drain_step for r in members if r.drain_step is not None}
        for step in sorted(drains):
            ax.axvline(step, color="black", linestyle="--", linewidth=0.9, label=f"queue drains ({step})")
        ax.set(title=f"delay D = {delay}", xlabel="update")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("entropy (nats / token)")
    return save(fig, out, "fig4_entropy")


def group_size_delay(runs: list[Run]) -> int | None:
    """The delay at which several group sizes were run (None when there is none)."""
    by_delay = {d: {r.group_size for r in runs if r.delay == d} for d in {r.delay for r in runs}}
    candidates = [d for d, sizes in by_delay.items() if len(sizes) > 1]
    return max(candidates, key=lambda d: len(by_delay[d])) if candidates else None


def figure_reward_by_group_size(runs: list[Run], out: Path) -> list[Path]:
    delay = group_size_delay(runs)
    if delay is None:
        return []
    sizes = sorted({r.group_size for r in runs if r.delay == delay})
    fig, axes = panels(len(sizes), f"Training reward (centred mean of {WINDOW}) at delay D = {delay}")
    for ax, g in zip(axes, sizes, strict=True):
        for label, members in group(runs, delay=delay, group_size=g, eps_schedule="constant").items():
            steps, mean, _ = seed_mean([r.series(REWARD_TAGS) for r in members])
            ax.plot(steps, centred_rolling_mean(mean, WINDOW), label=f"{label} ({seeds(len(members))})")
        ax.set(title=f"G = {g}", xlabel="update")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("reward")
    return save(fig, out, "fig5_reward_by_group_size")


def seeds(count: int) -> str:
    return f"{count} seed" + ("s" if count != 1 else "")


def cell(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± std`` of the scaled values; a single value has no spread to show."""
    if not values:
        return "–"
    mean, std = mean_std([scale * v for v in values])
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def accuracy_cell(members: list[Run]) -> str:
    finals = [r.final_eval() for r in members if r.final_eval() is not None]
    if not finals:
        return "–"
    text = f"{cell([f['greedy'] for f in finals])} / {cell([f['avg@n'] for f in finals])}"
    return text + (f" ({seeds(1)})" if len(finals) == 1 else "")


def reward_cell(members: list[Run]) -> str:
    values = [r.final_reward() for r in members if r.final_reward() is not None]
    return cell(values, scale=1.0, digits=3) + (f" ({seeds(1)})" if len(values) == 1 else "")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def tables(runs: list[Run], missing: list[str]) -> str:
    """Tables 1, 3 and 4 in Markdown (see the module docstring)."""
    g = main_group_size(runs)
    grid = [r for r in runs if r.group_size == g and r.eps_schedule == "constant"]
    delays = sorted({r.delay for r in grid})
    labels = list(group(grid))
    n = {int(r.final_eval()["n"]) for r in runs if r.final_eval() is not None}
    avg_n = f"avg@{n.pop()}" if len(n) == 1 else "avg@n"
    parts = [f"**Table 1.** Held-out accuracy at the final checkpoint, greedy / {avg_n} (%), mean ± std over seeds "
             f"(G = {g}, constant threshold).\n"]  # fmt: skip
    rows = [[label] + [accuracy_cell(group(grid, delay=d).get(label, [])) for d in delays] for label in labels]
    parts.append(markdown_table(["method"] + [f"D = {d}" for d in delays], rows))
    parts.append(f"\n**Table 1b.** Final training reward (mean of the last {FINAL_UPDATES} updates), mean ± std.\n")
    rows = [[label] + [reward_cell(group(grid, delay=d).get(label, [])) for d in delays] for label in labels]
    parts.append(markdown_table(["method"] + [f"D = {d}" for d in delays], rows))
    parts.append(diagnostics_table(grid, delays, labels))
    delay = group_size_delay(runs)
    if delay is not None:
        sizes = sorted({r.group_size for r in runs if r.delay == delay})
        at = [r for r in runs if r.delay == delay and r.eps_schedule == "constant"]
        parts.append(f"\n**Table 3.** Group size at delay D = {delay}: held-out greedy / {avg_n} (%) and final "
                     "training reward, mean ± std over seeds.\n")  # fmt: skip
        rows = []
        for label in group(at):
            by_size = [group(at, group_size=s).get(label, []) for s in sizes]
            rows.append([label] + [f"{accuracy_cell(members)}<br>{reward_cell(members)}" for members in by_size])
        parts.append(markdown_table(["method"] + [f"G = {s}" for s in sizes], rows))
    adaptive = [r for r in runs if r.eps_schedule != "constant"]
    if adaptive:
        top = max(r.delay for r in adaptive)
        at = [r for r in runs if r.delay == top and r.group_size == g]
        parts.append(f"\n**Table 4.** Constant vs Corollary-1 threshold at delay D = {top} (G = {g}).\n")
        rows = []
        for label, members in group(at).items():
            eps = [r.series(("correction/eps",))[-1][1] for r in members if r.series(("correction/eps",))]
            rows.append([label, str(len(members)), accuracy_cell(members), reward_cell(members),
                         cell(eps, scale=1.0, digits=3)])  # fmt: skip
        parts.append(markdown_table(["method", "seeds", f"greedy / {avg_n} (%)", "final reward", "final ε"], rows))
    if missing:
        parts.append(f"\nNot finished (left out): {', '.join(missing)}.")
    return "\n".join(parts) + "\n"


def diagnostics_table(grid: list[Run], delays: list[int], labels: list[str]) -> str:
    """Table 2: each diagnostic summarised over a run's updates, then averaged over seeds.

    For GRPO and TIC runs the GMC column says what GMC would have rescaled on that run's data (and vice versa).
    """
    header = ["method", "D"] + [column for _, column, _ in DIAGNOSTICS]
    rows = []
    for label in labels:
        for d in delays:
            members = group(grid, delay=d).get(label, [])
            row = [label, str(d)]
            for tag, _, how in DIAGNOSTICS:
                summaries = []
                for run in members:
                    values = [v for _, v in run.scalars.get(tag, [])]
                    if values:
                        summaries.append(statistics.median(values) if how == "median" else statistics.fmean(values))
                # round first so that float noise around 0 prints as 0.000, not -0.000
                row.append(f"{round(statistics.fmean(summaries), 3) + 0.0:.3f}" if summaries else "–")
            rows.append(row)
    title = ("\n**Table 2.** Diagnostics of the corrections, summarised over each run's updates (mean, or median "
             "where marked), averaged over seeds (G = 8). A column of another rule (TIC-dropped on a GMC run) says "
             "what that rule would have done with the run's data.\n")  # fmt: skip
    return title + "\n" + markdown_table(header, rows)


def update_doc(doc: Path, text: str, block: str = "tables") -> None:
    """Replace the block between ``<!-- block:begin -->`` and ``<!-- block:end -->`` in ``doc`` (they must exist)."""
    begin, end = f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
    content = doc.read_text()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(content):
        raise ValueError(f"{doc} has no {begin} ... {end} block to replace")
    doc.write_text(pattern.sub(lambda _: f"{begin}\n{text}{end}", content, count=1))


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", required=True, help="sweep folder written by scripts/sweep.py")
    parser.add_argument("--out", required=True, help="folder for the figures and tables.md")
    parser.add_argument("--doc", default=None, help="Markdown file whose tables block is replaced")
    parser.add_argument("--block", default="tables", help="name of that block's markers")
    args = parser.parse_args(argv)
    runs, missing = load_sweep(Path(args.sweep))
    if not runs:
        parser.error(f"no finished runs in {args.sweep} (not finished: {', '.join(missing) or 'none'})")
    out = Path(args.out)
    written = figure_pass_at_1(runs, out) + figure_entropy(runs, out) + figure_reward_by_group_size(runs, out)
    text = tables(runs, missing)
    (out / "tables.md").write_text(text)
    written.append(out / "tables.md")
    if args.doc:
        update_doc(Path(args.doc), text, args.block)
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()

"""Figures and tables of a sweep, from its TensorBoard logs and evaluation JSONs alone (matplotlib, PNG + PDF).

Reads ``SWEEP/manifest.json`` (written by ``scripts/sweep.py``) for each run's parameters, the run's
TensorBoard scalars (``lit_gmc.tblog.read_scalars``) and its ``eval/step_<n>.json`` files (the format of
``lit_gmc.callbacks.evaluation``: ``{"step", "benchmarks": {name: {"greedy", "avg@n", "n", "pass@k"...}}}``).
Runs not marked done in the manifest are left out and listed. Outputs:

- ``fig2_pass_at_1``: sampled pass@1 (avg@n, macro over the run's evaluation suites) vs checkpoint, one panel per
  delay, one line per method (mean over seeds, band = one standard deviation); the tiny study's analogue of the
  paper's Figures 2/3 (those, on MATH-500, come from ``scripts/tables.py``).
- ``fig4_entropy`` and ``fig5_reward_by_group_size``: the paper's Figures 4 and 5, drawn by the same functions
  (:func:`figure_entropy`, :func:`figure_reward_by_group_size`) that ``scripts/tables.py`` uses for run folders:
  entropy per update under fixed delays with queue-drain lines, and GMC-GRPO vs TIC-GRPO reward per group size.
- ``tables.md``: Markdown tables, "greedy / avg@n" in percent, mean ± std over seeds: held-out accuracy and
  final training reward by method and delay (Table 1), the corrections' diagnostics by method and delay
  (Table 2), by group size (Table 3), and constant vs Corollary-1 threshold at the largest delay (Table 4). These
  numbers are this study's own, not the paper's: its Tables 1, 3, 4 and 5 are ``scripts/tables.py``'s.
  ``--doc FILE`` also replaces the block between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in FILE
  (``NAME`` from ``--block``, default ``tables``).

The paper's tables (Tables 1, 3, 4 and 5) and figures (Figures 2-6) come from the sibling
``scripts/tables.py``, which loads runs with :func:`load_sweep` or, for runs launched directly with
``python -m lit_gmc fit`` (one logger folder per run, ``version_*`` folders for its resumptions), with
:func:`load_run_folders` (their ``config.yaml`` gives the parameters; see :func:`run_parameters`).

Example::

    python scripts/plots.py --sweep runs/study --out docs/figures/tiny --doc docs/results_tiny.md
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from lit_gmc.callbacks.diagnostics import centred_rolling_mean  # noqa: E402
from lit_gmc.tblog import read_scalars  # noqa: E402

WINDOW = 25
FINAL_UPDATES = 25
"""The final training reward is the mean over the last this many updates (one update's 64 samples are noisy)."""
# The first tag a run has wins: the final names first, then the names older logs used.
REWARD_TAGS = ("train/reward", "diag/reward/mean")
ENTROPY_TAGS = ("diag/entropy/mean", "train/entropy")
DIAGNOSTICS = (("diag/tic/dropped_fraction", "TIC-dropped trajectories", "mean"),
               ("diag/gmc/rescaled_fraction", "GMC-rescaled groups", "mean"),
               ("diag/removed_mass/mean", "removed mass (median)", "median"),
               ("diag/ess/mean_fraction_of_G", "ESS / G", "mean"),
               ("diag/log_rho/abs_mean", "mean abs log ratio", "mean"),
               ("diag/corr/log_rho_vs_length", "corr(log ratio, length)", "mean"))  # fmt: skip
"""Table 2: (tag, column, how the run's per-update values are summarised); the removed mass is heavy-tailed."""
FIXED_DELAY_ORDER = ("gmc", "tic", "grpo")
"""The paper's order in its fixed-delay results (Table 3, App. B.2.1; Table 4 and Figure 5, App. B.2.2)."""
SIMULATED_ORDER = ("grpo", "gac", "vcpo", "tic", "gmc")
"""The paper's order in Table 1 (Sec. 5): baselines first, GMC-GRPO last (A-3PO is Table 5's, App. B.2.3)."""
METHOD_ORDER = (*FIXED_DELAY_ORDER, "vcpo", "gac", "a3po")
"""Default row and legend order; rules not listed follow in name order."""
LABELS = {"gmc": "GMC-GRPO", "tic": "TIC-GRPO", "a3po": "A-3PO"}
"""The paper's names of the rules that are not the rule's class name (Sec. 5, Tables 1-5)."""


def method_label(method: str) -> str:
    """A sweep's method (a rule's name in lower case) as tables and legends show it: the paper's name, else the rule's
    class name (``IcePop``, ``SeqTIS``), else the method in capitals."""
    from lit_gmc.rules import registered

    return LABELS.get(method) or {name.lower(): name for name in registered()}.get(method, method.upper())
MODEL_KEYS = ("actor", "model")
"""Manifest fields naming a run's model, tried before ``overrides["model.actor"]`` and the run's config.json."""


@dataclass
class Run:
    """One finished run: its grid parameters, scalar series and evaluations by step.

    ``model`` is the actor the run trained (``""`` when the manifest and config do not name one). ``delay`` is
    the fixed delay D (0 for ``Sync``, the paper's D = 0 protocol), read from the run's schedule: a run without a
    fixed delay (``VirtualClock``, ``Live``, or a sweep entry that names no schedule) has ``None`` there, never a
    default, and ``schedule`` names its schedule class (``""`` when nothing names it).
    """

    name: str
    method: str
    delay: int | None
    group_size: int
    seed: int
    eps_schedule: str
    scalars: dict[str, list[tuple[int, float]]] = field(repr=False)
    evals: dict[int, dict[str, Any]] = field(repr=False)
    model: str = ""
    schedule: str = ""

    @property
    def label(self) -> str:
        return method_label(self.method) + (" + Cor. 1" if self.eps_schedule == "corollary1" else "")

    def series(self, tags: tuple[str, ...]) -> list[tuple[int, float]]:
        for tag in tags:
            if tag in self.scalars:
                return self.scalars[tag]
        return []

    @property
    def drain_step(self) -> int | None:
        """The update at which the delay queue started draining (Diagnostics' one-off marker, else its flag)."""
        if "diag/drain/step" in self.scalars:
            return int(self.scalars["diag/drain/step"][0][1])
        for tag in ("diag/drain/active", "schedule/draining"):
            draining = [s for s, v in self.scalars.get(tag, []) if v > 0.5]
            if draining:
                return min(draining)
        return None

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
        params = sweep_parameters(info, run_dir)
        runs.append(Run(name, params["method"], params["delay"], params["group_size"], params["seed"],
                        params["eps_schedule"], read_scalars(run_dir), read_evals(run_dir), model_of(info, run_dir),
                        params["schedule"]))  # fmt: skip
    return runs, missing


def sweep_parameters(info: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """A sweep run's :class:`Run` fields, read as for a run folder: from the config it trained with.

    ``scripts/sweep.py`` writes each run's ``config.json`` in the layout of LightningCLI's ``config.yaml``, so
    :func:`run_parameters` places both the same way (D from the schedule). A manifest entry without a config falls
    back on its own fields; without a ``delay`` field it has no fixed delay (``None``), never D = 0.
    """
    config_path = run_dir / "config.json"
    if config_path.exists():
        return run_parameters(json.loads(config_path.read_text()), config_path)
    delay = info.get("delay")
    return {"method": str(info["method"]).lower(), "delay": None if delay is None else int(delay),
            "group_size": int(info["group_size"]), "seed": int(info["seed"]),
            "eps_schedule": info.get("eps_schedule", "constant"),
            "schedule": "" if delay is None else ("Sync" if int(delay) == 0 else "FixedDelay")}  # fmt: skip


def model_of(info: dict[str, Any], run_dir: Path) -> str:
    """The actor a run trained: a manifest field, its ``--set model.actor`` override, or its config.json.

    Returns ``""`` when none names it (the embedded default's actor), so such runs form one group.
    """
    for key in MODEL_KEYS:
        if info.get(key):
            return str(info[key])
    actor = info.get("overrides", {}).get("model.actor")
    if actor is None and (run_dir / "config.json").exists():
        actor = json.loads((run_dir / "config.json").read_text()).get("model", {}).get("actor")
    return str(actor or "")


def read_evals(folder: Path) -> dict[int, dict[str, Any]]:
    """``{step: entry}`` of the ``eval/step_<n>.json`` files in ``folder`` (empty when there are none)."""
    evals = {}
    for path in (folder / "eval").glob("step_*.json"):
        entry = json.loads(path.read_text())
        evals[int(entry["step"])] = entry
    return evals


VERSION = re.compile(r"version_(\d+)")
"""A TensorBoardLogger version folder; a resumed run writes the next one under the same logger name."""
NO_FIXED_DELAY = ("VirtualClock", "Live")
"""Schedules whose delays the run decides (the simulated-async suite, live rollouts): no D, ``delay/mean`` instead."""


def version_dirs(run_dir: Path) -> list[Path]:
    """The ``version_<n>`` folders of a logger folder, oldest (smallest n) first."""
    found = [p for p in run_dir.iterdir() if p.is_dir() and VERSION.fullmatch(p.name)] if run_dir.is_dir() else []
    return sorted(found, key=lambda p: int(VERSION.fullmatch(p.name).group(1)))


def find_run_folders(root: Path) -> list[Path]:
    """Every logger folder under ``root`` (``root`` itself included) that has a ``version_<n>/config.yaml``."""
    found = {p.parent.parent for p in Path(root).rglob("version_*/config.yaml") if VERSION.fullmatch(p.parent.name)}
    return sorted(found)


def config_value(config: dict[str, Any], key: str, where: Path) -> Any:
    """``config[a][b]...`` for ``key = "a.b..."``; a ValueError naming ``where`` when it is missing."""
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{where} has no {key}: is it the config.yaml LightningCLI saved for a lit_gmc run?")
        value = value[part]
    return value


def run_parameters(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """The :class:`Run` fields a LightningCLI ``config.yaml`` of ``python -m lit_gmc fit`` sets.

    ``method`` is the rule's class name in lower case (``model.correction.class_path``; the rule's name itself in
    configs written before rules were classes), ``model`` is ``model.actor``, ``seed`` is ``seed_everything`` (else
    ``data.seed``), ``group_size`` is ``data.group_size``, ``eps_schedule`` is GMC's
    ``model.correction.init_args.cap_schedule`` (older configs: ``model.eps_schedule``; ``constant`` when absent),
    ``delay`` is ``FixedDelay``'s ``delay``, 0 for ``Sync`` (the paper's D = 0 protocol) and ``None`` for any other
    schedule (``VirtualClock``, ``Live``: the delays are measured, not set).
    """
    schedule = config_value(config, "data.schedule", where)
    if not isinstance(schedule, dict) or "class_path" not in schedule:
        raise ValueError(f"{where}: data.schedule is not a class_path + init_args mapping: {schedule!r}")
    kind = str(schedule["class_path"]).rsplit(".", 1)[-1]
    if kind == "FixedDelay":
        delay = int(config_value(config, "data.schedule.init_args.delay", where))
    else:
        delay = 0 if kind == "Sync" else None
    seed = config.get("seed_everything")
    if not isinstance(seed, int) or isinstance(seed, bool):  # null / false: the run was not seeded globally
        seed = config_value(config, "data.seed", where)
    model = config.get("model") or {}
    method, eps_schedule = config_value(config, "model.correction", where), model.get("eps_schedule")
    if isinstance(method, dict):  # a rule class: class_path + init_args
        eps_schedule = (method.get("init_args") or {}).get("cap_schedule")
        method = str(method.get("class_path", "")).rsplit(".", 1)[-1].lower()
    return {"method": str(method), "delay": delay,
            "group_size": int(config_value(config, "data.group_size", where)), "seed": int(seed),
            "eps_schedule": str(eps_schedule or "constant"), "model": str(model.get("actor") or ""),
            "schedule": kind}  # fmt: skip


def load_run_folder(run_dir: Path, name: str | None = None) -> tuple[Run, str | None]:
    """One run launched with the CLI, from its logger folder (``runs/simulated_async/qwen3_4b_tic``).

    Every ``version_<n>`` folder is a stretch of the same run (a resumption writes the next one): their scalars
    are merged, a later version winning a step both logged, and so are their ``eval/step_<n>.json`` files. The
    parameters come from the newest ``config.yaml`` (:func:`run_parameters`); every version's must agree on them.

    Returns:
        The run, and ``None`` when it finished or ``"name (u/N updates)"`` when its logs stop before
        ``trainer.max_steps`` (within ``trainer.log_every_n_steps``).
    """
    run_dir = Path(run_dir)
    versions = version_dirs(run_dir)
    configs = [(v, yaml.safe_load((v / "config.yaml").read_text())) for v in versions if (v / "config.yaml").exists()]
    if not configs:
        raise FileNotFoundError(f"{run_dir} has no version_<n>/config.yaml: give the logger folder of a run "
                                "launched with `lit_gmc fit` (runs/simulated_async/qwen3_4b_gmc)")  # fmt: skip
    params = [(v, run_parameters(config, v / "config.yaml")) for v, config in configs]
    newest = params[-1][1]
    for v, other in params[:-1]:
        changed = {k: (other[k], newest[k]) for k in newest if other[k] != newest[k]}
        if changed:
            raise ValueError(f"{run_dir}: {v.name} and {params[-1][0].name} are not the same run ({changed}); "
                             "give them separate logger names")  # fmt: skip
    merged: dict[str, dict[int, float]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for v in versions:  # oldest first: a later version overwrites the steps it repeats
        try:
            part = read_scalars(v)
        except FileNotFoundError:  # a version that stopped before logging anything
            part = {}
        for tag, points in part.items():
            merged.setdefault(tag, {}).update(points)
        evals.update(read_evals(v))
    if not merged:
        raise FileNotFoundError(f"no TensorBoard event files under {run_dir}'s version folders")
    scalars = {tag: sorted(points.items()) for tag, points in merged.items()}
    name = name or run_dir.name
    run = Run(name, newest["method"], newest["delay"], newest["group_size"], newest["seed"], newest["eps_schedule"],
              scalars, evals, newest["model"], newest["schedule"])  # fmt: skip
    trainer = configs[-1][1].get("trainer") or {}
    max_steps, every = trainer.get("max_steps"), trainer.get("log_every_n_steps") or 1
    last = max([step for points in merged.values() for step in points] + list(evals))
    if isinstance(max_steps, int) and max_steps > 0 and last + every < max_steps:
        return run, f"{name} ({last + 1}/{max_steps} updates)"
    return run, None


def load_run_folders(run_dirs: Iterable[Path], include_unfinished: bool = False) -> tuple[list[Run], list[str]]:
    """Runs launched with the CLI (:func:`load_run_folder`), and the unfinished ones, left out unless included.

    A run is named by its logger folder, or by the whole path where two folders share a name.
    """
    dirs = list(dict.fromkeys(Path(d).resolve() for d in run_dirs))
    names = [d.name for d in dirs]
    runs, missing = [], []
    for run_dir in dirs:
        run, unfinished = load_run_folder(run_dir, run_dir.name if names.count(run_dir.name) == 1 else str(run_dir))
        if unfinished is not None:
            missing.append(unfinished)
        if unfinished is None or include_unfinished:
            runs.append(run)
    return runs, ([] if include_unfinished else missing)


def add_run_sources(parser: argparse.ArgumentParser) -> None:
    """``--sweep``, ``--runs``, ``--runs-root`` and ``--include-unfinished`` (read back by :func:`load_sources`)."""
    parser.add_argument("--sweep", default=None, help="sweep folder written by scripts/sweep.py")
    parser.add_argument("--runs", nargs="+", default=[], metavar="DIR",
                        help="logger folders of runs launched with `python -m lit_gmc fit` (e.g. "
                             "runs/simulated_async/qwen3_4b_gmc); their version_* folders are one run")  # fmt: skip
    parser.add_argument("--runs-root", nargs="+", default=[], metavar="ROOT",
                        help="folders searched for such logger folders (any with a version_*/config.yaml)")  # fmt: skip
    parser.add_argument("--include-unfinished", action="store_true",
                        help="keep --runs/--runs-root runs whose logs stop before trainer.max_steps")  # fmt: skip


def load_sources(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[Run], list[str]]:
    """The runs of ``--sweep``, ``--runs`` and ``--runs-root`` together, and those left out (see :func:`main`)."""
    if not (args.sweep or args.runs or args.runs_root):
        parser.error("give --sweep, --runs or --runs-root")
    runs, missing = load_sweep(Path(args.sweep)) if args.sweep else ([], [])
    folders = [Path(d) for d in args.runs]
    for root in map(Path, args.runs_root):
        found = find_run_folders(root)
        if not found:
            parser.error(f"--runs-root {root}: no logger folder with a version_*/config.yaml under it")
        folders += found
    if folders:
        more, left_out = load_run_folders(folders, args.include_unfinished)
        runs, missing = runs + more, missing + left_out
    if not runs:
        parser.error(f"no finished runs (not finished: {', '.join(missing) or 'none'})")
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


def group(runs: list[Run], method_order: tuple[str, ...] = METHOD_ORDER, **where: Any) -> dict[str, list[Run]]:
    """Runs matching ``where`` (attribute = value), by label, in ``method_order`` (other rules after, by name)."""
    out: dict[str, list[Run]] = {}
    for run in sorted(runs, key=lambda r: (order(r.method, method_order), r.method, r.eps_schedule, r.seed)):
        if all(getattr(run, key) == value for key, value in where.items()):
            out.setdefault(run.label, []).append(run)
    return out


def order(method: str, method_order: tuple[str, ...] = METHOD_ORDER) -> int:
    return method_order.index(method) if method in method_order else len(method_order)


def main_group_size(runs: list[Run]) -> int:
    """The group size of the delay grid: the most common one."""
    sizes = [r.group_size for r in runs]
    return max(set(sizes), key=sizes.count)


def panels(count: int, title: str):
    fig, axes = plt.subplots(1, count, figsize=(4.2 * count, 3.4), squeeze=False, sharey=True)
    fig.suptitle(title, wrap=True)  # one panel is narrower than most titles
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


def faint_and_smoothed(ax, steps: list[int], values: list[float], label: str, **style: Any) -> None:
    """Per-update values as a faint curve and their centred rolling mean over :data:`WINDOW` updates as a solid one
    (the paper's Figures 4-6: "faint curves ... per-update measurements, solid curves ... smoothed")."""
    line = ax.plot(steps, values, alpha=0.25, linewidth=0.8, **style)[0]
    style = {**style, "color": line.get_color()}
    ax.plot(steps, centred_rolling_mean(values, WINDOW), label=label, **style)


def figure_entropy(runs: list[Run], out: Path, stem: str = "fig4_entropy") -> list[Path]:
    """The paper's Figure 4 (App. B.2.1): current-policy token entropy per update under fixed delays.

    One panel per delay D (runs at the delay grid's group size), one method a colour in the paper's order (seed
    mean per update: faint; centred rolling mean over 25 updates: solid), a dashed vertical line at each update
    where a run's queue started draining (its ``diag/drain/step`` record), after which nothing new is generated.
    """
    fixed = [r for r in runs if r.delay is not None and r.series(ENTROPY_TAGS)]
    if not fixed:
        return []
    g = main_group_size(fixed)
    delays = sorted({r.delay for r in fixed if r.group_size == g})
    fig, axes = panels(len(delays), f"Token entropy per update (faint: per update, solid: centred mean of {WINDOW})")
    for ax, delay in zip(axes, delays, strict=True):
        for label, members in group(fixed, FIXED_DELAY_ORDER, delay=delay, group_size=g).items():
            steps, mean, _ = seed_mean([r.series(ENTROPY_TAGS) for r in members])
            faint_and_smoothed(ax, steps, mean, label)
        drains = sorted({r.drain_step for r in fixed if r.delay == delay and r.group_size == g} - {None})
        for step in drains:
            ax.axvline(step, color="black", linestyle="--", linewidth=0.9, label=f"queue drains ({step})")
        ax.set(title=f"D = {delay}", xlabel="update")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("entropy (nats / token)")
    return save(fig, out, stem)


def group_size_delay(runs: list[Run]) -> int | None:
    """The delay at which several group sizes were run (None when there is none)."""
    by_delay = {d: {r.group_size for r in runs if r.delay == d} for d in {r.delay for r in runs}}
    candidates = [d for d, sizes in by_delay.items() if len(sizes) > 1]
    return max(candidates, key=lambda d: len(by_delay[d])) if candidates else None


def figure_reward_by_group_size(runs: list[Run], out: Path, stem: str = "fig5_reward_by_group_size") -> list[Path]:
    """The paper's Figure 5 (App. B.2.2): training reward of GMC-GRPO and TIC-GRPO, one panel per group size G at
    the delay where several G were run (the paper: G in {4, 8, 32} at D = 128); faint per update, solid smoothed."""
    fixed = [r for r in runs if r.delay is not None and r.method in ("gmc", "tic") and r.eps_schedule == "constant"]
    delay = group_size_delay(fixed)
    if delay is None:
        return []
    sizes = sorted({r.group_size for r in fixed if r.delay == delay})
    fig, axes = panels(len(sizes), f"Training reward at D = {delay} (faint: per update, solid: centred mean of "
                                   f"{WINDOW})")  # fmt: skip
    for ax, g in zip(axes, sizes, strict=True):
        for label, members in group(fixed, FIXED_DELAY_ORDER, delay=delay, group_size=g).items():
            steps, mean, _ = seed_mean([r.series(REWARD_TAGS) for r in members])
            faint_and_smoothed(ax, steps, mean, f"{label} ({seeds(len(members))})")
        ax.set(title=f"G = {g}", xlabel="update")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("training reward")
    return save(fig, out, stem)


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
    return write_outputs(out, "tables.md", tables(runs, missing), written, args.doc, args.block)


def write_outputs(out: Path, name: str, text: str, written: list[Path], doc: str | None, block: str) -> list[Path]:
    """Write the tables ``text`` to ``out/name``, into ``doc``'s ``block`` when given; print every file written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text)
    written = [*written, out / name]
    if doc:
        update_doc(Path(doc), text, block)
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()

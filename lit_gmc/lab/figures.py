"""The lab's figures, PNG and PDF: bias against G for the group-size sweep, bias and second moment against delay.

Drawn with matplotlib's object API (``Figure``), so no backend or global state is touched. Relative bias is
``||E g - h|| / ||h||`` with ``h = grad J / T``; bars are 95% intervals of the Monte-Carlo estimates, hollow markers
the exact sums (``G = 2``), lines without markers the paper's bounds with their constants measured (log axes).
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure


def _save(fig: Figure, out: Path, name: str) -> list[Path]:
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path, dpi=150, bbox_inches="tight")
    return paths


def _relative(cell: dict, kind: str, norm: float) -> tuple[float, float, float]:
    """``(relative bias, low, high)`` of a cell's ``mc`` or ``exact`` estimate."""
    est = cell[kind]
    if norm <= 0:  # ||h|| estimated at 0 (sampled spaces, few draws): no relative bias to draw
        return math.nan, math.nan, math.nan
    return est["bias"] / norm, est["bias_low"] / norm, est["bias_high"] / norm


def _bars(ax, x: list, values: list[tuple[float, float, float]], **style) -> None:
    """Points with their 95% intervals."""
    ax.errorbar(x, [v for v, _, _ in values], yerr=[[v - lo for v, lo, _ in values], [hi - v for v, _, hi in values]],
                marker="o", capsize=3, **style)  # fmt: skip


def bias_vs_group_size(out: Path, records: list[dict], cells: list[dict], delay: int) -> list[Path]:
    """At one delay, for the rules measured at several G: bias, bias against the paper's bounds, second moment.

    (a) relative bias with Remark 8's TIC line, (b) the bias against the paper's bounds (log), (c) the second moment
    against Lemmas 5 and 8's bound (log).
    """
    record = next(r for r in records if r["delay"] == delay)
    norm = record["true_gradient_norm"]
    at = [c for c in cells if c["delay"] == delay]
    names = [n for n in dict.fromkeys(c["rule"] for c in at)
             if len({c["group_size"] for c in at if c["rule"] == n}) > 2]
    if not names or norm <= 0:
        return []
    fig = Figure(figsize=(15, 4.4))
    measured, bounded, moment = fig.subplots(1, 3)
    for index, name in enumerate(names):
        color = f"C{index}"
        own = sorted((c for c in at if c["rule"] == name), key=lambda c: c["group_size"])
        sizes = [c["group_size"] for c in own]
        _bars(measured, sizes, [_relative(c, "mc", norm) for c in own], color=color, label=f"{name}")
        exact = [(c["group_size"], c["exact"]["bias"] / norm) for c in own if c["exact"] is not None]
        if exact:
            measured.plot(*zip(*exact, strict=True), marker="D", linestyle="none", markerfacecolor="none",
                          markersize=10, color=color, label=f"{name}, exact")  # fmt: skip
        _bars(moment, sizes, [(c["mc"]["second_moment"]["value"], c["mc"]["second_moment"]["low"],
                               c["mc"]["second_moment"]["high"]) for c in own], color=color, label=name)  # fmt: skip
        if not own[0]["bounds"]:
            continue
        bounded.plot(sizes, [max(c["mc"]["bias"], c["mc"]["bias_high"]) / norm for c in own], marker="o",
                     color=color, label=f"{name}: measured (upper 95%)")  # fmt: skip
        bounded.plot(sizes, [c["bounds"]["bias_removed_mass"] / norm for c in own], linestyle="--", color=color,
                     label=f"{name}: eq. 7 (removed mass)")  # fmt: skip
        bounded.plot(sizes, [c["bounds"]["bias_chi2"] / norm for c in own], linestyle=":", color=color,
                     label=f"{name}: chi^2 branch (eq. {27 if name == 'GMC' else 40})")  # fmt: skip
        moment.plot(sizes, [c["bounds"]["second_moment"] for c in own], linestyle="--", color=color,
                    label=f"{name}: Lemma {5 if name == 'GMC' else 8}")  # fmt: skip
    for cap, value in record["tic_limit_bias"].items():
        measured.axhline(value / norm, linestyle="--", color="gray", label=f"TIC, Remark 8 (eps {cap}, any G)")
    for ax in (measured, bounded, moment):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("group size G")
        ax.legend(fontsize=7)
    bounded.set_yscale("log")
    moment.set_yscale("log")
    measured.set_ylim(bottom=0)
    measured.set_ylabel("||E[g] - grad J / T|| / ||grad J / T||")
    measured.set_title(f"(a) bias at delay {delay}")
    bounded.set_title("(b) bias and the paper's bounds (measured constants)")
    moment.set_ylabel("E||g||^2")
    moment.set_title("(c) second moment")
    return _save(fig, out, "bias_vs_group_size")


def by_delay(out: Path, records: list[dict], cells: list[dict], name: str, quantity: str) -> list[Path]:
    """``quantity`` against delay for every rule at the largest G measured at every delay, in two panels.

    ``quantity`` is ``bias`` or ``second_moment``; trajectory-weighting rules and token-level rules in the two panels.
    """
    delays = sorted(r["delay"] for r in records)
    norms = {r["delay"]: r["true_gradient_norm"] for r in records}
    common = [g for g in sorted({c["group_size"] for c in cells})
              if all(any(c["group_size"] == g and c["delay"] == d for c in cells) for d in delays)]  # fmt: skip
    if not common:
        return []
    g = common[-1]
    chosen = [c for c in cells if c["group_size"] == g]
    fig = Figure(figsize=(11, 4.4))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, family in zip(axes, ("trajectory", "token"), strict=True):
        names = list(dict.fromkeys(c["rule"] for c in chosen if c["family"] == family))
        for index, rule in enumerate(names):
            own = sorted((c for c in chosen if c["rule"] == rule), key=lambda c: c["delay"])
            x = [delays.index(c["delay"]) for c in own]
            color = f"C{index % 10}"
            if quantity == "bias":
                _bars(ax, x, [_relative(c, "mc", norms[c["delay"]]) for c in own], color=color, label=rule)
            else:
                ax.errorbar(x, [c["mc"]["second_moment"]["value"] for c in own],
                            yerr=[1.96 * c["mc"]["second_moment"]["se"] for c in own], marker="o", color=color,
                            capsize=2, label=rule)  # fmt: skip
                bound = [(delays.index(c["delay"]), c["bounds"]["second_moment"]) for c in own
                         if "second_moment" in c["bounds"]]  # fmt: skip
                if bound:
                    ax.plot(*zip(*bound, strict=True), linestyle="--", color=color, label=f"{rule}: Lemma 5/8 bound")
        ax.set_xticks(range(len(delays)), [str(d) for d in delays])
        if quantity == "bias":
            ax.set_ylim(bottom=0)
        else:
            ax.set_yscale("log")
        ax.set_xlabel("delay (updates)")
        ax.set_title(f"{'trajectory weights' if family == 'trajectory' else 'token-level rules'}, G = {g}")
        if ax.get_legend_handles_labels()[0]:  # a family with no rule measured has an empty panel
            ax.legend(fontsize=7, ncol=2)
    axes[0].set_ylabel("relative bias" if quantity == "bias" else "E||g||^2")
    return _save(fig, out, name)


def figures(out: Path, records: list[dict], cells: list[dict], sweep_delay: int) -> list[Path]:
    """Every figure the records support; returns the files written."""
    return [
        *bias_vs_group_size(out, records, cells, sweep_delay),
        *by_delay(out, records, cells, "bias_vs_delay", "bias"),
        *by_delay(out, records, cells, "second_moment_vs_delay", "second_moment"),
    ]

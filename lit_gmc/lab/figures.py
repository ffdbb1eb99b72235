"""The lab's figures, PNG and PDF: bias against G for the group-size sweep, bias and second moment against delay.

Drawn with matplotlib's object API (``Figure``), so no backend or global state is touched. Relative bias is
``||E g - h|| / ||h||`` with ``h = grad J / T``; bars are 95% intervals of the Monte-Carlo estimates, hollow markers
the exact sums (``G = 2``), lines without markers the paper's bounds with their constants measured.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

FLOOR = 1e-6
"""Where a relative bias (or its interval) at or below 0 is drawn on the log axes."""


def _save(fig: Figure, out: Path, name: str) -> list[Path]:
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path, dpi=150, bbox_inches="tight")
    return paths


def _relative(cell: dict, kind: str, norm: float) -> tuple[float, float, float]:
    est = cell[kind]
    return tuple(max(v / norm, FLOOR) for v in (est["bias"], est["bias_low"], est["bias_high"]))  # type: ignore[return-value]


def bias_vs_group_size(out: Path, records: list[dict], cells: list[dict], delay: int) -> list[Path]:
    """Relative bias against G at one delay for the rules measured at several G, with Remark 8 and the bounds."""
    norm = next(r for r in records if r["delay"] == delay)["true_gradient_norm"]
    at = [c for c in cells if c["delay"] == delay]
    names = [n for n in dict.fromkeys(c["rule"] for c in at) if len({c["group_size"] for c in at if c["rule"] == n}) > 2]
    if not names or norm <= 0:
        return []
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.subplots()
    for index, name in enumerate(names):
        color = f"C{index}"
        own = sorted((c for c in at if c["rule"] == name), key=lambda c: c["group_size"])
        sizes = [c["group_size"] for c in own]
        values = [_relative(c, "mc", norm) for c in own]
        ax.errorbar(sizes, [v for v, _, _ in values], yerr=[[v - lo for v, lo, _ in values],
                    [hi - v for v, _, hi in values]], marker="o", color=color, capsize=3, label=f"{name} (Monte Carlo)")
        exact = [(c["group_size"], max(c["exact"]["bias"] / norm, FLOOR)) for c in own if c["exact"] is not None]
        if exact:
            ax.plot(*zip(*exact), marker="D", linestyle="none", markerfacecolor="none", markersize=9, color=color,
                    label=f"{name} (exact)")  # fmt: skip
        chi2 = [(c["group_size"], c["bounds"]["bias_chi2"] / norm) for c in own if "bias_chi2" in c["bounds"]]
        if chi2:
            ax.plot(*zip(*chi2), linestyle=":", color=color, label=f"{name}: chi^2 bound (eq. 27/40)")
    limits = next(r for r in records if r["delay"] == delay)["tic_limit_bias"]
    for cap, value in limits.items():
        ax.axhline(max(value / norm, FLOOR), linestyle="--", color="gray", label=f"TIC, Remark 8 (eps {cap}, any G)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("group size G")
    ax.set_ylabel("||E[g] - grad J / T|| / ||grad J / T||")
    ax.set_title(f"Bias against G at delay {delay}")
    ax.legend(fontsize=7)
    return _save(fig, out, "bias_vs_group_size")


def by_delay(out: Path, records: list[dict], cells: list[dict], name: str, quantity: str) -> list[Path]:
    """``quantity`` (``bias`` or ``second_moment``) against delay for every rule at the largest G measured at every
    delay, trajectory-weighting rules and token-level rules in two panels."""
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
                values = [_relative(c, "mc", norms[c["delay"]]) if norms[c["delay"]] > 0 else (FLOOR,) * 3
                          for c in own]  # fmt: skip
                ax.errorbar(x, [v for v, _, _ in values], yerr=[[v - lo for v, lo, _ in values],
                            [hi - v for v, _, hi in values]], marker="o", color=color, capsize=2, label=rule)
            else:
                ax.errorbar(x, [c["mc"]["second_moment"]["value"] for c in own],
                            yerr=[1.96 * c["mc"]["second_moment"]["se"] for c in own], marker="o", color=color,
                            capsize=2, label=rule)  # fmt: skip
                bound = [(delays.index(c["delay"]), c["bounds"]["second_moment"]) for c in own
                         if "second_moment" in c["bounds"]]  # fmt: skip
                if bound:
                    ax.plot(*zip(*bound), linestyle="--", color=color, label=f"{rule}: Lemma 5/8 bound")
        ax.set_xticks(range(len(delays)), [str(d) for d in delays])
        ax.set_yscale("log")
        ax.set_xlabel("delay (updates)")
        ax.set_title(f"{'trajectory weights' if family == 'trajectory' else 'token-level rules'}, G = {g}")
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

"""The lab's outputs: ``lab.json`` (everything), ``lab.csv`` (a row per estimate), ``lab.md`` and the figures.

A cell record (:func:`lit_gmc.lab.run.cell_record`) holds the Monte-Carlo estimates (``mc``: bias with its 95%
interval, relative bias ``||E g - h|| / ||h||``, cosine, second moment and variance) and, for ``G = 2``, the exact ones
(``exact``); a delay record holds the policies' divergences, ``||h|| = ||grad J / T||`` and Remark 8's TIC bias.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

CSV_COLUMNS = ("rule", "group_size", "delay", "aggregation", "estimate", "bias", "bias_low", "bias_high",
               "relative_bias", "cosine", "cosine_se", "scale", "second_moment", "second_moment_se", "variance",
               "removed_mass", "bound_second_moment", "bound_bias_removed_mass", "bound_bias_chi2",
               "true_gradient_norm", "chi2", "kl_behavior_current")  # fmt: skip


def rows(records: list[dict], cells: list[dict]) -> list[dict]:
    """One flat row per estimate: the Monte-Carlo one of every cell, and the exact one where there is one."""
    by_delay = {r["delay"]: r for r in records}
    out = []
    for cell in cells:
        delay = by_delay[cell["delay"]]
        for kind in ("mc", "exact"):
            est = cell[kind]
            if est is None:
                continue
            bounds = cell["bounds"]
            out.append({
                "rule": cell["rule"], "group_size": cell["group_size"], "delay": cell["delay"],
                "aggregation": cell["aggregation"], "estimate": kind, "bias": est["bias"],
                "bias_low": est["bias_low"], "bias_high": est["bias_high"], "relative_bias": est["relative_bias"],
                "cosine": est["cosine"]["value"], "cosine_se": est["cosine"]["se"], "scale": est["scale"]["value"],
                "second_moment": cell["mc"]["second_moment"]["value"],
                "second_moment_se": cell["mc"]["second_moment"]["se"], "variance": cell["mc"]["variance"]["value"],
                "removed_mass": est.get("removed_mass", cell["removed_mass"]),
                "bound_second_moment": bounds.get("second_moment"),
                "bound_bias_removed_mass": bounds.get("bias_removed_mass"), "bound_bias_chi2": bounds.get("bias_chi2"),
                "true_gradient_norm": delay["true_gradient_norm"], "chi2": delay["chi2"],
                "kl_behavior_current": delay["kl_behavior_current"],
            })  # fmt: skip
    return out


def fmt(value: float | None, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits; ``–`` for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}g}"


def markdown(meta: dict, records: list[dict], table: list[dict]) -> str:
    """The table of every estimate, after a line per delay on how far the policies are apart."""
    lines = ["| delay | KL(pi_b \\|\\| pi) | chi^2 | reward pi_b -> pi | \\|\\|grad J / T\\|\\| | TIC bias, Remark 8 |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        limit = ", ".join(f"{fmt(v)} (eps {k})" for k, v in r["tic_limit_bias"].items()) or "–"
        lines.append(f"| {r['delay']} | {fmt(r['kl_behavior_current'])} | {fmt(r['chi2'])} | "
                     f"{r['reward_behavior']:.3f} -> {r['reward_current']:.3f} | {fmt(r['true_gradient_norm'])} | "
                     f"{limit} |")  # fmt: skip
    lines += ["", "| rule | G | delay | estimate | bias (95% CI) | relative bias | cosine | scale | E\\|\\|g\\|\\|^2 | "
              "variance | removed mass | bounds: E\\|\\|g\\|\\|^2, bias |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in sorted(table, key=lambda r: (r["rule"], r["group_size"], r["delay"], r["estimate"])):
        interval = "exact" if row["estimate"] == "exact" else f"[{fmt(row['bias_low'])}, {fmt(row['bias_high'])}]"
        bound = ", ".join(fmt(row[k]) for k in ("bound_second_moment", "bound_bias_removed_mass", "bound_bias_chi2")
                          if row[k] is not None) or "–"  # fmt: skip
        lines.append(f"| {row['rule']} | {row['group_size']} | {row['delay']} | {row['estimate']} | "
                     f"{fmt(row['bias'])} {interval} | {fmt(row['relative_bias'])} | {fmt(row['cosine'], 4)} | "
                     f"{fmt(row['scale'])} | "
                     f"{fmt(row['second_moment'])} | {fmt(row['variance'])} | {fmt(row['removed_mass'])} | {bound} |")
    return "\n".join(lines) + "\n"


def by_delay_table(records: list[dict], cells: list[dict]) -> str:
    """Relative bias, cosine and ``E||g||^2`` of every rule against the delay, at the largest G measured at all."""
    delays = [r["delay"] for r in records]
    sizes = [g for g in sorted({c["group_size"] for c in cells})
             if all(any(c["group_size"] == g and c["delay"] == d for c in cells) for d in delays)]  # fmt: skip
    if not sizes:
        return ""
    at = {(c["rule"], c["delay"]): c["mc"] for c in cells if c["group_size"] == sizes[-1]}
    lines = [f"Relative bias / cosine / E\\|\\|g\\|\\|^2 at G = {sizes[-1]} (Monte Carlo):", "",
             "| rule | " + " | ".join(f"delay {d}" for d in delays) + " |", "|---" * (len(delays) + 1) + "|"]
    for rule in dict.fromkeys(c["rule"] for c in cells):
        values = [at.get((rule, d)) for d in delays]
        lines.append(f"| {rule} | " + " | ".join(
            "–" if v is None else f"{fmt(v['relative_bias'], 2)} / {fmt(v['cosine']['value'], 2)} / "
            f"{fmt(v['second_moment']['value'], 3)}" for v in values) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def write_report(out: Path, meta: dict, records: list[dict], cells: list[dict], sweep_delay: int) -> list[Path]:
    """Write ``lab.json``, ``lab.csv``, ``lab.md`` and the figures to ``out``; returns the paths."""
    from lit_gmc.lab.figures import figures

    out.mkdir(parents=True, exist_ok=True)
    table = rows(records, cells)
    paths = [out / "lab.json", out / "lab.csv", out / "lab.md"]
    paths[0].write_text(json.dumps({"meta": meta, "delays": records, "cells": cells}, indent=1, default=str))
    with paths[1].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    paths[2].write_text(markdown(meta, records, table) + "\n" + by_delay_table(records, cells))
    return paths + figures(out, records, cells, sweep_delay)

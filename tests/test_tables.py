"""scripts/tables.py: the paper's Tables 1, 3 and 5 and Figure 6 from a synthetic simulated-async suite.

Every run writes real TensorBoard event files and eval JSONs whose values are simple functions of (method,
model, seed, benchmark, step), so each table cell can be checked against numbers worked out by hand.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib.image
import pytest
from test_plots import load_script
from torch.utils.tensorboard import SummaryWriter

tables = load_script("tables")
plots = sys.modules["plots"]  # the copy tables.py imported its run loading from (one Run class, one REWARD_TAGS)

STEPS = 60
CHECKPOINTS = (0, 30, 60)
BENCH_N = {"math500": 16, "gsm8k": 8, "gaokao2023en": 8, "olympiadbench": 8, "minerva": 16, "amc23": 16}
TITLES = {"math500": "MATH-500", "gsm8k": "GSM8K", "gaokao2023en": "Gaokao2023-En",
          "olympiadbench": "OlympiadBench", "minerva": "Minerva", "amc23": "AMC23"}  # fmt: skip
ORDER = list(BENCH_N)
BASE = {"grpo": 0.30, "tic": 0.32, "vcpo": 0.34, "gac": 0.36, "a3po": 0.20, "gmc": 0.40}
LABEL = {"grpo": "GRPO", "tic": "TIC", "vcpo": "VCPO", "gac": "GAC", "a3po": "A-3PO", "gmc": "GMC"}
SMALL, LARGE = "Qwen/Qwen3-1.7B-Base", "Qwen/Qwen3-8B-Base"
BONUS = {SMALL: 0.0, LARGE: 0.1}
SUITE = {LARGE: {"grpo": 1, "tic": 1, "vcpo": 1, "gac": 1, "a3po": 2, "gmc": 2}, SMALL: {"gmc": 2, "a3po": 2}}
"""Seeds per (model, method): the 8B model has every method, the 1.7B one only GMC and A-3PO."""


def greedy_of(method: str, model: str, seed: int, bench: str, step: int) -> float:
    return BASE[method] + BONUS[model] + 0.01 * ORDER.index(bench) + 0.001 * step + 0.02 * seed


def avg_of(method: str, model: str, seed: int, bench: str, step: int) -> float:
    return greedy_of(method, model, seed, bench, step) - 0.1


def pass_of(method: str, model: str, seed: int, bench: str, step: int, k: int) -> float:
    return avg_of(method, model, seed, bench, step) + 0.04 * (k.bit_length() - 1)  # +0.04 per doubling of k


def reward_of(method: str, step: int) -> float:
    return 0.0 if method == "a3po" and step >= STEPS // 2 else 0.3 + 0.004 * step  # A-3PO collapses half-way


def write_run(sweep: Path, method: str, model: str, seed: int) -> dict:
    name = f"{method}-{model.rsplit('/', 1)[-1]}-s{seed}"
    run_dir = sweep / "runs" / name
    writer = SummaryWriter(str(run_dir / "tb" / "version_0"))
    for step in range(STEPS):
        writer.add_scalar("train/reward", reward_of(method, step), step)
        writer.add_scalar("diag/reward/mean", -1.0, step)  # an old tag beside the final one: must be ignored
        writer.add_scalar("diag/entropy/mean", 1.0 - 0.01 * step, step)
        if method == "vcpo":  # only the running mean (DelayAccounting's), last value 7.3
            writer.add_scalar("delay/running_mean", 7.0 + 0.3 * step / (STEPS - 1), step)
        elif method != "grpo":  # grpo logged no delays at all
            writer.add_scalar("delay/mean", 10.0 + step % 4 + seed, step)  # mean over 60 updates: 11.5 + seed
    writer.close()
    (run_dir / "eval").mkdir(parents=True)
    for step in CHECKPOINTS:
        benchmarks = {}
        for bench in reversed(ORDER):  # file order must not decide the column order
            n, at = BENCH_N[bench], (method, model, seed, bench, step)
            entry = {"title": TITLES[bench], "problems": 5, "n": n, "greedy": greedy_of(*at), "avg@n": avg_of(*at)}
            entry.update({f"pass@{k}": pass_of(*at, k) for k in (1, 2, 4, 8, 16) if k <= n})
            benchmarks[bench] = entry
        (run_dir / "eval" / f"step_{step}.json").write_text(json.dumps({"step": step, "benchmarks": benchmarks}))
    # the simulated suite has no fixed delay: no "delay" field (the virtual clock decides the delays)
    return {name: {"method": method, "group_size": 8, "seed": seed, "overrides": {"model.actor": model},
                   "dir": str(run_dir), "status": "done"}}  # fmt: skip


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("simulated_async")
    runs = {}
    for model, methods in SUITE.items():
        for method, seeds in methods.items():
            for seed in range(seeds):
                runs.update(write_run(root, method, model, seed))
    runs["gac-Qwen3-8B-Base-s1"] = {"method": "gac", "group_size": 8, "seed": 1, "status": "training"}
    (root / "manifest.json").write_text(json.dumps({"invocations": [], "runs": runs}))
    return root


@pytest.fixture(scope="module")
def text(sweep) -> str:
    runs, missing = plots.load_sweep(sweep)
    assert missing == ["gac-Qwen3-8B-Base-s1"]
    return tables.tables(runs, missing)


def table_rows(text: str, title: str, key_cells: int = 1) -> tuple[list[str], dict]:
    """Header and ``{first key_cells cells: remaining cells}`` of the Markdown table following ``title``."""
    block = text.split(title, 1)[1].split("\n\n", 2)[1]
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()]
    rows = {tuple(cells[:key_cells]) if key_cells > 1 else cells[0]: cells[key_cells:] for cells in lines[2:]}
    return lines[0], rows


def spread(values: list[float], scale: float = 100.0) -> str:
    """What plots.cell prints: mean ± sample std, or the bare mean for one value (one decimal)."""
    scaled = [scale * v for v in values]
    if len(scaled) == 1:
        return f"{scaled[0]:.1f}"
    return f"{statistics.fmean(scaled):.1f} ± {statistics.stdev(scaled):.1f}"


def seeds_of(model: str, method: str) -> range:
    return range(SUITE[model][method])


def test_table1_cells_are_the_final_checkpoint_seed_statistics(text):
    header, rows = table_rows(text, "**Table 1 (Qwen3-8B-Base).**")
    assert header == ["method", "seeds", "MATH-500 (n = 16)", "GSM8K (n = 8)", "Gaokao2023-En (n = 8)",
                      "OlympiadBench (n = 8)", "Minerva (n = 16)", "AMC23 (n = 16)", "macro average",
                      "avg. delay"]  # fmt: skip
    assert list(rows) == ["GRPO", "TIC", "VCPO", "GAC", "A-3PO", "GMC"]  # baselines first, GMC last
    # by hand: GMC 8B MATH-500 at update 60 is 0.40 + 0.1 + 0 + 0.06 + 0.02 seed = 0.56 and 0.58 (greedy)
    assert rows["GMC"][:2] == ["2", "57.0 ± 1.4 / 47.0 ± 1.4"]
    # macro: the six benchmarks add 0.00..0.05, mean 0.025: 0.585 and 0.605 greedy
    assert rows["GMC"][7] == "59.5 ± 1.4 / 49.5 ± 1.4"
    # AMC23 (offset 0.05) of the single-seed TIC run: 0.32 + 0.1 + 0.05 + 0.06 = 0.53
    assert rows["TIC"][:1] + rows["TIC"][6:7] == ["1", "53.0 / 43.0"]
    # delays: mean of 10 + (t mod 4) + seed over 60 updates = 11.5 + seed; VCPO's last running mean 7.3; GRPO none
    assert rows["GMC"][8] == "12.0 ± 0.7" and rows["GAC"][8] == "11.5"
    assert rows["VCPO"][8] == "7.3" and rows["GRPO"][8] == "–"
    for method, label in LABEL.items():
        cells = rows[label]
        for col, bench in enumerate(ORDER, start=1):
            greedy = [greedy_of(method, LARGE, s, bench, 60) for s in seeds_of(LARGE, method)]
            avg = [avg_of(method, LARGE, s, bench, 60) for s in seeds_of(LARGE, method)]
            assert cells[col] == f"{spread(greedy)} / {spread(avg)}", (method, bench)
    assert "(update 60)" in text.split("**Table 1 (Qwen3-8B-Base).**", 1)[1].split("\n", 1)[0]


def test_table1_of_the_small_model_has_only_its_methods(text):
    _, rows = table_rows(text, "**Table 1 (Qwen3-1.7B-Base).**")
    assert list(rows) == ["A-3PO", "GMC"]
    assert rows["A-3PO"][1] == "27.0 ± 1.4 / 17.0 ± 1.4"  # 0.20 + 0.06 (+ 0.02) at MATH-500
    assert text.index("**Table 1 (Qwen3-1.7B-Base).**") < text.index("**Table 1 (Qwen3-8B-Base).**")


def test_table3_greedy_and_pass_at_k_on_math500(text):
    header, rows = table_rows(text, "**Table 3 (Qwen3-8B-Base).**", key_cells=2)
    assert header == ["D", "method", "seeds", "Greedy", "pass@1", "pass@2", "pass@4", "pass@8", "pass@16"]
    # the sweep's runs have no fixed delay field: D = 0; Base first, then the methods in order
    assert list(rows) == [("–", "Base (no RL)")] + [("0", LABEL[m]) for m in BASE]
    # by hand: GMC 8B MATH-500 at update 60, seeds 0 and 1: greedy 0.56 / 0.58, avg@16 0.1 lower, +0.04 a doubling
    assert rows[("0", "GMC")] == ["2", "57.0 ± 1.4", "47.0 ± 1.4", "51.0 ± 1.4", "55.0 ± 1.4", "59.0 ± 1.4",
                                  "63.0 ± 1.4"]  # fmt: skip
    assert rows[("0", "TIC")][:3] == ["1", "48.0", "38.0"]  # 0.32 + 0.1 + 0.06
    # Base: the step-0 MATH-500 entries, each distinct one once (here every run's differs: 8 values)
    base = [greedy_of(m, LARGE, s, "math500", 0) for m in BASE for s in seeds_of(LARGE, m)]
    assert rows[("–", "Base (no RL)")][:2] == ["–", spread(base)]
    assert "Table 3 (Qwen3-1.7B-Base)" in text


def test_table5_per_benchmark_a3po_against_gmc(text):
    header, rows = table_rows(text, "**Table 5.**", key_cells=2)
    assert header == ["model", "method", "seeds", "MATH-500 (n = 16)", "GSM8K (n = 8)", "Gaokao2023-En (n = 8)",
                      "OlympiadBench (n = 8)", "Minerva (n = 16)", "AMC23 (n = 16)", "macro average",
                      "avg. delay"]  # fmt: skip
    assert list(rows) == [("Qwen3-1.7B-Base", "A-3PO"), ("Qwen3-1.7B-Base", "GMC"), ("Qwen3-8B-Base", "A-3PO"),
                          ("Qwen3-8B-Base", "GMC")]  # fmt: skip
    # by hand: A-3PO 1.7B MATH-500 0.20 + 0.06 (+ 0.02 seed 1), macro + 0.025; 8B adds 0.1; delays 11.5 + seed
    assert rows[("Qwen3-1.7B-Base", "A-3PO")][:2] == ["2", "27.0 ± 1.4 / 17.0 ± 1.4"]
    assert rows[("Qwen3-1.7B-Base", "A-3PO")][-2:] == ["29.5 ± 1.4 / 19.5 ± 1.4", "12.0 ± 0.7"]
    assert rows[("Qwen3-8B-Base", "GMC")][-2:] == ["59.5 ± 1.4 / 49.5 ± 1.4", "12.0 ± 0.7"]
    assert rows[("Qwen3-8B-Base", "GMC")][6] == "62.0 ± 1.4 / 52.0 ± 1.4"  # AMC23: + 0.05
    assert text.rstrip().endswith("Not finished (left out): gac-Qwen3-8B-Base-s1.")


def test_figure6_and_doc_block_are_written(sweep, tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("# Paper\n\n<!-- paper_tables:begin -->\nSTALE\n<!-- paper_tables:end -->\n\nprose\n")
    written = tables.main(["--sweep", str(sweep), "--out", str(tmp_path / "out"), "--doc", str(doc)])
    figures_2_3 = [f"fig2_3_math500_pass_at_1_{model}" for model in ("Qwen3-1.7B-Base", "Qwen3-8B-Base")]
    for stem in ("fig6_a3po_reward", *figures_2_3):
        for suffix in ("png", "pdf"):  # Figures 2/3 from a sweep too: one per model, here one D = 0 panel each
            path = tmp_path / "out" / f"{stem}.{suffix}"
            assert path in written and path.stat().st_size > 5_000, path
    image = matplotlib.image.imread(tmp_path / "out" / "fig6_a3po_reward.png")
    assert image.ndim == 3 and image.shape[1] > image.shape[0]  # two model panels side by side (reward, entropy)
    text = (tmp_path / "out" / "paper_tables.md").read_text()
    content = doc.read_text()
    assert "STALE" not in content and text in content and content.endswith("prose\n")


def test_reward_curves_prefer_the_final_tag_and_a3po_is_highlighted(sweep):
    runs, _ = plots.load_sweep(sweep)
    a3po = next(r for r in runs if r.method == "a3po" and r.model == LARGE)
    assert a3po.series(plots.REWARD_TAGS)[-1] == (STEPS - 1, 0.0)  # train/reward, not the old diag/reward/mean
    fig, ax = tables.plt.subplots()
    colours = tables.method_colours(runs)
    tables.plot_curves(ax, [r for r in runs if r.model == LARGE], plots.REWARD_TAGS, colours)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["GRPO", "TIC", "VCPO", "GAC", "A-3PO", "GMC"]
    assert lines["A-3PO"].get_linewidth() > 2 * lines["GMC"].get_linewidth()
    assert lines["A-3PO"].get_color() == "tab:red" and len(set(colours.values())) == len(colours)
    smoothed = list(lines["A-3PO"].get_ydata())
    # centred window of 25 at update 0 averages updates 0..12; by update 59 it covers only collapsed updates
    assert smoothed[0] == pytest.approx(statistics.fmean(reward_of("a3po", t) for t in range(13)))
    assert smoothed[-1] == 0.0
    tables.plt.close(fig)
    assert tables.figure_a3po([plots.Run("x", "gmc", 0, 8, 0, "constant", {}, {})], Path("unused")) == []


def test_model_of_and_groups(tmp_path):
    assert plots.model_of({"actor": "Qwen/Qwen3-4B-Base", "overrides": {"model.actor": "x"}}, tmp_path) == (
        "Qwen/Qwen3-4B-Base"
    )
    assert plots.model_of({"model": "m"}, tmp_path) == "m"
    assert plots.model_of({"overrides": {"model.actor": "o"}}, tmp_path) == "o"
    assert plots.model_of({}, tmp_path) == ""  # no config.json either: one group
    (tmp_path / "config.json").write_text(json.dumps({"model": {"actor": "from-config"}}))
    assert plots.model_of({}, tmp_path) == "from-config"
    names = ["Qwen/Qwen3-14B-Base", "Qwen/Qwen3-8B-Base", "tiny", "Qwen/Qwen3-1.7B-Base"]
    assert sorted(names, key=tables.model_sort_key) == [names[3], names[1], names[0], "tiny"]
    assert tables.model_name("") == "all runs" and tables.model_name("Qwen/Qwen3-8B-Base") == "Qwen3-8B-Base"


def test_rows_never_average_over_delays():
    runs = [plots.Run(f"r{i}", m, d, 8, 0, "constant", {}, {}) for i, (m, d) in enumerate([("gmc", 0), ("gmc", 8)])]
    assert list(tables.method_rows(runs)) == ["GMC (D = 0)", "GMC (D = 8)"]
    assert list(tables.method_rows(runs[:1])) == ["GMC"]

"""scripts/tables.py: the paper's Tables 1 and 5 and Figure 6 from a synthetic simulated-async suite.

Every run writes real TensorBoard event files and eval JSONs whose values are simple functions of (method,
model, seed, benchmark, step), so each table cell can be checked against numbers worked out by hand. A-3PO's
reward collapses to 0 half-way on the 8B model (as in the paper's Table 5), not on the 1.7B one, where it beats
GMC-GRPO on avg@n and loses on greedy, so Table 5's bold marks split.
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
LABEL = {"grpo": "GRPO", "tic": "TIC-GRPO", "vcpo": "VCPO", "gac": "GAC", "a3po": "A-3PO", "gmc": "GMC-GRPO"}
SMALL, LARGE = "Qwen/Qwen3-1.7B-Base", "Qwen/Qwen3-8B-Base"
BONUS = {SMALL: 0.0, LARGE: 0.1}
SUITE = {LARGE: {"grpo": 1, "tic": 1, "vcpo": 1, "gac": 1, "a3po": 2, "gmc": 2}, SMALL: {"gmc": 2, "a3po": 2}}
"""Seeds per (model, method): the 8B model has every method, the 1.7B one only GMC and A-3PO."""


def greedy_of(method: str, model: str, seed: int, bench: str, step: int) -> float:
    return BASE[method] + BONUS[model] + 0.01 * ORDER.index(bench) + 0.001 * step + 0.02 * seed


def avg_of(method: str, model: str, seed: int, bench: str, step: int) -> float:
    gap = 0.15 if (method, model) == ("a3po", SMALL) else -0.1  # the small A-3PO: better sampled, worse greedy
    return greedy_of(method, model, seed, bench, step) + gap


def pass_of(method: str, model: str, seed: int, bench: str, step: int, k: int) -> float:
    return avg_of(method, model, seed, bench, step) + 0.04 * (k.bit_length() - 1)  # +0.04 per doubling of k


def reward_of(method: str, model: str, step: int) -> float:
    collapsed = (method, model) == ("a3po", LARGE) and step >= STEPS // 2  # 8B A-3PO collapses half-way
    return 0.0 if collapsed else 0.3 + 0.004 * step


def write_run(sweep: Path, method: str, model: str, seed: int) -> dict:
    name = f"{method}-{model.rsplit('/', 1)[-1]}-s{seed}"
    run_dir = sweep / "runs" / name
    writer = SummaryWriter(str(run_dir / "tb" / "version_0"))
    for step in range(STEPS):
        writer.add_scalar("train/reward", reward_of(method, model, step), step)
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


def table_lines(text: str, title: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows (lists of cells) of the Markdown table following ``title``; repeated labels kept."""
    block = text.split(title, 1)[1].split("\n\n", 2)[1]
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()]
    return lines[0], lines[2:]


def spread(values: list[float], scale: float = 100.0) -> str:
    """What the paper tables print: mean ± sample std, or the bare mean for one value (two decimals)."""
    scaled = [scale * v for v in values]
    if len(scaled) == 1:
        return f"{scaled[0]:.2f}"
    return f"{statistics.fmean(scaled):.2f} ± {statistics.stdev(scaled):.2f}"


def seeds_of(model: str, method: str) -> range:
    return range(SUITE[model][method])


def test_table1_cells_are_the_final_checkpoint_seed_statistics(text):
    header, lines = table_lines(text, "**Table 1.**")
    assert header == ["Method", "Avg. Delay", "MATH-500", "GSM8K", "Gaokao2023-En", "OlympiadBench", "Minerva",
                      "AMC23", "Avg. perf.", "seeds"]  # fmt: skip
    # the paper's Table 1: a heading per model, smallest first; GRPO, GAC, VCPO, TIC-GRPO, GMC-GRPO; no A-3PO
    assert [cells[0] for cells in lines] == ["*Qwen3-1.7B-Base*", "GMC-GRPO", "*Qwen3-8B-Base*", "GRPO", "GAC",
                                             "VCPO", "TIC-GRPO", "GMC-GRPO"]  # fmt: skip
    large = {cells[0]: cells[1:] for cells in lines[3:]}
    # by hand: GMC 8B MATH-500 at update 60 is 0.40 + 0.1 + 0 + 0.06 + 0.02 seed = 0.56 and 0.58 (greedy)
    assert large["GMC-GRPO"][1] == "57.00 ± 1.41 / 47.00 ± 1.41"
    # macro: the six benchmarks add 0.00..0.05, mean 0.025: 0.585 and 0.605 greedy
    assert large["GMC-GRPO"][7:] == ["59.50 ± 1.41 / 49.50 ± 1.41", "2"]
    # AMC23 (offset 0.05) of the single-seed TIC run: 0.32 + 0.1 + 0.05 + 0.06 = 0.53
    assert large["TIC-GRPO"][6:] == ["53.00 / 43.00", "50.50 / 40.50", "1"]
    # delays: mean of 10 + (t mod 4) + seed over 60 updates = 11.5 + seed; VCPO's last running mean 7.3; GRPO none
    assert large["GMC-GRPO"][0] == "12.00 ± 0.71" and large["GAC"][0] == "11.50"
    assert large["VCPO"][0] == "7.30" and large["GRPO"][0] == "–"
    for method, label in LABEL.items():
        if method == "a3po":
            continue
        for col, bench in enumerate(ORDER, start=1):
            greedy = [greedy_of(method, LARGE, s, bench, 60) for s in seeds_of(LARGE, method)]
            avg = [avg_of(method, LARGE, s, bench, 60) for s in seeds_of(LARGE, method)]
            assert large[label][col] == f"{spread(greedy)} / {spread(avg)}", (method, bench)
    assert "**" not in text.split("**Table 1.**", 1)[1].split("**Table 5.**")[0]  # Table 1 marks no best
    caption = text.split("**Table 1.**", 1)[1].split("\n", 1)[0]
    assert "(update 60)" in caption and "n = 16 for MATH-500, Minerva, AMC23; n = 8 for GSM8K" in caption


def test_no_fixed_delay_run_no_fixed_delay_table(text):
    assert "Table 3" not in text and "Table 4" not in text  # no run here has a fixed delay


def test_table5_bolds_the_better_entry_and_marks_the_collapsed_run(text):
    header, lines = table_lines(text, "**Table 5.**")
    assert header[:3] == ["Method", "Avg. Delay", "MATH-500"] and header[-2:] == ["Avg. perf.", "seeds"]
    assert [c[0] for c in lines] == ["*Qwen3-1.7B-Base*", "A-3PO", "GMC-GRPO", "*Qwen3-8B-Base*", "A-3PO", "GMC-GRPO"]
    cells = [c[1:] for c in lines]
    small_a3po, small_gmc, large_a3po, large_gmc = cells[1], cells[2], cells[4], cells[5]
    # 1.7B, MATH-500: A-3PO greedy 0.26/0.28, avg@16 0.15 higher; GMC greedy 0.46/0.48, avg@16 0.1 lower
    assert small_a3po[:2] == ["12.00 ± 0.71", "27.00 ± 1.41 / **42.00 ± 1.41**"]
    assert small_gmc[1] == "**47.00 ± 1.41** / 37.00 ± 1.41"
    # macro: + 0.025 (the mean of the benchmark offsets)
    assert small_a3po[7] == "29.50 ± 1.41 / **44.50 ± 1.41**" and small_gmc[7] == "**49.50 ± 1.41** / 39.50 ± 1.41"
    # 8B: A-3PO's reward is 0 from update 30 to the end (30 updates >= 25): collapsed, no numbers, nothing to beat
    assert large_a3po[:3] == ["–", "Training collapsed (update 30)", ""] and large_a3po[-1] == "2"
    assert large_gmc[1] == "57.00 ± 1.41 / 47.00 ± 1.41" and "**" not in "".join(large_gmc)
    assert text.rstrip().endswith("Not finished (left out): gac-Qwen3-8B-Base-s1.")


def test_collapse_is_read_from_the_records():
    def run(rewards, losses=()):
        scalars = {"train/reward": list(enumerate(rewards)), "train/loss": list(enumerate(losses))}
        return plots.Run("r", "a3po", None, 8, 0, "constant", scalars, {})

    assert tables.collapse_step(run([0.5] * 10 + [0.0] * 25)) == 10
    assert tables.collapse_step(run([0.5] * 10 + [0.0] * 24)) is None  # too short a stretch
    assert tables.collapse_step(run([0.5] * 10 + [0.0] * 20 + [0.02] + [0.0] * 10)) is None  # not staying at 0
    assert tables.collapse_step(run([0.0] * 40)) is None  # never above zero: nothing fell
    assert tables.collapse_step(run([0.5] * 5, [1.0, 2.0, float("nan"), 1.0])) == 2  # non-finite loss


def test_figure6_and_doc_block_are_written(sweep, tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("# Paper\n\n<!-- paper_tables:begin -->\nSTALE\n<!-- paper_tables:end -->\n\nprose\n")
    written = tables.main(["--sweep", str(sweep), "--out", str(tmp_path / "out"), "--doc", str(doc)])
    for suffix in ("png", "pdf"):
        path = tmp_path / "out" / f"fig6_a3po_reward.{suffix}"
        assert path in written and path.stat().st_size > 5_000, path
    assert not list((tmp_path / "out").glob("fig[2-5]*"))  # no fixed-delay run: no Figures 2-5
    image = matplotlib.image.imread(tmp_path / "out" / "fig6_a3po_reward.png")
    assert image.ndim == 3 and image.shape[1] > image.shape[0]  # two model panels side by side
    text = (tmp_path / "out" / "paper_tables.md").read_text()
    content = doc.read_text()
    assert "STALE" not in content and text in content and content.endswith("prose\n")


def test_figure6_is_a3po_against_gmc_faint_and_smoothed(sweep):
    runs, _ = plots.load_sweep(sweep)
    captured = {}
    real_save = tables.save
    tables.save = lambda fig, out, stem: captured.setdefault(stem, fig) and []
    try:
        tables.figure_a3po(runs, Path("unused"))
    finally:
        tables.save = real_save
    axes = captured["fig6_a3po_reward"].axes
    assert [ax.get_title() for ax in axes] == ["Qwen3-1.7B-Base", "Qwen3-8B-Base"]
    lines = axes[1].get_lines()  # per method: the faint per-update curve, then the smoothed one
    assert [line.get_label() for line in lines[1::2]] == ["A-3PO (2 seeds)", "GMC-GRPO (2 seeds)"]
    assert lines[0].get_color() == "tab:red" and lines[0].get_alpha() == 0.25
    smoothed = list(lines[1].get_ydata())
    # centred window of 25 at update 0 averages updates 0..12; by update 59 it covers only collapsed updates
    assert smoothed[0] == pytest.approx(statistics.fmean(reward_of("a3po", LARGE, t) for t in range(13)))
    assert smoothed[-1] == 0.0
    plots.plt.close(captured["fig6_a3po_reward"])
    assert tables.figure_a3po([plots.Run("x", "gmc", None, 8, 0, "constant", {}, {})], Path("unused")) == []


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

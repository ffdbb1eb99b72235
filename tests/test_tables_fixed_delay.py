"""scripts/tables.py on the fixed-delay suite and the group-size study, from run folders as `lit_gmc fit` writes them.

Qwen3-1.7B runs at D = 0 (Sync), 32 and 128 for GRPO, TIC and GMC (GMC at D = 128 with two seeds), and GMC at
G = 4 and 32 at D = 128, each evaluated on MATH-500 at steps 0, 2, 4 and 8 (the paper's 0/200/400/800, scaled).
Every run's step-0 entry is the same (the base model); later values are simple functions of (method, D, G,
seed, step), so each cell of Tables 3 and 4 is worked out by hand below.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest
from test_tables import plots, table_rows, tables
from test_tables_runs import FIXED_D64, SYNC, config, write_version

MODEL = "Qwen/Qwen3-1.7B-Base"
STEPS = 8
CHECKPOINTS = (0, 2, 4, 8)
GAIN = {"grpo": 0.02, "tic": 0.04, "gmc": 0.06}


def greedy_of(method: str, delay: int, group_size: int, seed: int, step: int) -> float:
    """0.30 at step 0 (the base model, the same for every run); then the method's gain and 0.01 an update,
    -0.0001 a unit of delay, +0.001 a response per group and +0.02 a seed."""
    if step == 0:
        return 0.30
    return 0.30 + GAIN[method] + 0.01 * step - 0.0001 * delay + 0.001 * group_size + 0.02 * seed


def write_run(root: Path, method: str, delay: int, group_size: int = 8, seed: int = 0) -> None:
    save_dir = root / (f"fixed_delay_d{delay}" if group_size == 8 else f"group_size_g{group_size}")
    name = f"qwen3_1p7b_{method}" + (f"_s{seed}" if seed else "")
    schedule = SYNC if delay == 0 else {**FIXED_D64, "init_args": {"delay": delay}}
    cfg = config(method, seed, schedule, save_dir, name, max_steps=STEPS)
    cfg["model"]["actor"], cfg["data"]["group_size"] = MODEL, group_size
    version_dir = write_version(save_dir / name, 0, cfg, range(STEPS), lambda t: float(delay))
    for step in CHECKPOINTS:
        greedy = greedy_of(method, delay, group_size, seed, step)
        entry = {"title": "MATH-500", "problems": 5, "n": 16, "greedy": greedy, "avg@n": greedy - 0.1}
        entry.update({f"pass@{k}": greedy - 0.1 + 0.04 * (k.bit_length() - 1) for k in (1, 2, 4, 8, 16)})
        out = version_dir / "eval" / f"step_{step}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"step": step, "version": step, "benchmarks": {"math500": entry}}))


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("runs")
    for delay in (0, 32, 128):
        for method in GAIN:
            write_run(root, method, delay)
    write_run(root, "gmc", 128, seed=1)
    for group_size in (4, 32):
        write_run(root, "gmc", 128, group_size)
    out = root / "tables"
    written = tables.main(["--runs-root", *(str(p) for p in sorted(root.iterdir())), "--out", str(out)])
    return out, written


def test_table3_rows_are_delay_by_method_after_the_base_model(suite):
    out, _ = suite
    header, rows = table_rows((out / "paper_tables.md").read_text(), "**Table 3.**", key_cells=2)
    assert header == ["D", "method", "seeds", "Greedy", "pass@1", "pass@2", "pass@4", "pass@8", "pass@16"]
    assert list(rows) == [("–", "Base (no RL)")] + [(str(d), m) for d in (0, 32, 128) for m in ("GRPO", "TIC", "GMC")]
    # the 12 runs' step-0 entries are one evaluation of the base model: 0.30 greedy, 0.20 + 0.04 a doubling
    assert rows[("–", "Base (no RL)")] == ["–", "30.0", "20.0", "24.0", "28.0", "32.0", "36.0"]
    # GMC, D = 128, update 8: 0.30 + 0.06 + 0.08 - 0.0128 + 0.008 = 0.4352, seed 1 0.4552 (G = 4, 32 left out)
    assert rows[("128", "GMC")] == ["2", "44.5 ± 1.4", "34.5 ± 1.4", "38.5 ± 1.4", "42.5 ± 1.4", "46.5 ± 1.4",
                                    "50.5 ± 1.4"]  # fmt: skip
    # TIC, D = 32: 0.30 + 0.04 + 0.08 - 0.0032 + 0.008 = 0.4248; GRPO, D = 0 (Sync): 0.408
    assert rows[("32", "TIC")][:3] == ["1", "42.5", "32.5"]
    assert rows[("0", "GRPO")][:3] == ["1", "40.8", "30.8"]


def test_table4_group_sizes_per_checkpoint_with_deltas_from_g8(suite):
    out, _ = suite
    text = (out / "paper_tables.md").read_text()
    header, rows = table_rows(text, "**Table 4.**", key_cells=2)
    assert header == ["method", "G", "seeds", "update 2", "update 4", "update 8"]
    assert list(rows) == [("GRPO", "8"), ("TIC", "8"), ("GMC", "4"), ("GMC", "8"), ("GMC", "32")]
    # G = 8 at update 2: 0.30 + 0.06 + 0.02 - 0.0128 + 0.008 = 0.3752 and 0.3952 (seed 1)
    assert rows[("GMC", "8")][:2] == ["2", "38.5 ± 1.4 / 28.5 ± 1.4"]
    # G = 4 adds 0.004 instead of 0.008: 0.3712 at update 2 against the G = 8 seed mean 0.3852, 0.4312 at update 8
    # against 0.4452; G = 32 adds 0.032: 0.4592 at update 8
    assert rows[("GMC", "4")] == ["1", "37.1 / 27.1 (Δ -1.4 / -1.4)", "39.1 / 29.1 (Δ -1.4 / -1.4)",
                                  "43.1 / 33.1 (Δ -1.4 / -1.4)"]  # fmt: skip
    assert rows[("GMC", "32")][3] == "45.9 / 35.9 (Δ +1.4 / +1.4)"
    assert "Δ" not in rows[("TIC", "8")][1] and "D = 128" in text.split("**Table 4.**", 1)[1].split("\n", 1)[0]
    assert "avg@16" in text.split("**Table 4.**", 1)[1].split("\n", 1)[0]


def test_figures_2_3_are_drawn_from_run_folders(suite):
    out, written = suite
    for suffix in ("png", "pdf"):
        path = out / f"fig2_3_math500_pass_at_1.{suffix}"
        assert path in written and path.stat().st_size > 5_000
    image = matplotlib.image.imread(out / "fig2_3_math500_pass_at_1.png")
    assert image.shape[1] > 2 * image.shape[0]  # three delay panels side by side


def test_figure_lines_are_the_math500_seed_means(suite):
    out, _ = suite
    roots = [p for p in sorted(out.parent.iterdir()) if p != out]
    runs, _ = plots.load_run_folders([folder for root in roots for folder in plots.find_run_folders(root)])
    members = [r for r in runs if r.delay == 128 and r.group_size == 8 and r.method == "gmc"]
    assert len(members) == 2
    steps, mean, std = tables.math500_curve(members)
    assert steps == list(CHECKPOINTS)
    assert mean[0] == pytest.approx(0.20) and std[0] == 0.0  # the base model's pass@1 (avg@16)
    # update 8: 0.4352 - 0.1 and 0.4552 - 0.1
    assert mean[-1] == pytest.approx(0.3452) and std[-1] == pytest.approx(0.02 / 2**0.5)

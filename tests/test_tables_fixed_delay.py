"""scripts/tables.py on the fixed-delay suite and the group-size study, from run folders as `lit_gmc fit` writes them.

Qwen3-1.7B runs at D = 0 (Sync), 32 and 128 for GRPO, TIC and GMC (GMC at D = 128 with two seeds), and GMC and TIC
at G = 4 and 32 at D = 128 (the paper's group-size study), each evaluated on MATH-500 at steps 0, 2, 4 and 8 (the
paper's 0/200/400/800, scaled). Every run's step-0 entry is the same (the base model); later values are simple
functions of (method, D, G, seed, step), so each cell of Tables 3 and 4, each Δ included, is worked out by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest
from test_tables import plots, table_rows, tables
from test_tables_runs import FIXED_D64, SYNC, config, write_version
from torch.utils.tensorboard import SummaryWriter

MODEL = "Qwen/Qwen3-1.7B-Base"
STEPS = 8
CHECKPOINTS = (0, 2, 4, 8)
GAIN = {"grpo": 0.02, "tic": 0.04, "gmc": 0.06}


def greedy_of(method: str, delay: int, group_size: int, seed: int, step: int) -> float:
    """0.30 at step 0 (the base model, the same for every run); then the method's gain and 0.01 an update,
    -0.0001 a unit of delay, +0.001 a response per group (GMC: +0.003) and +0.02 a seed."""
    if step == 0:
        return 0.30
    per_response = 0.003 if method == "gmc" else 0.001
    return 0.30 + GAIN[method] + 0.01 * step - 0.0001 * delay + per_response * group_size + 0.02 * seed


def entropy_of(method: str, delay: int, step: int) -> float:
    return 1.0 - 0.01 * step - 0.1 * list(GAIN).index(method) + 0.001 * delay


def write_run(root: Path, method: str, delay: int, group_size: int = 8, seed: int = 0) -> None:
    save_dir = root / (f"fixed_delay_d{delay}" if group_size == 8 else f"group_size_g{group_size}")
    name = f"qwen3_1p7b_{method}" + (f"_s{seed}" if seed else "")
    schedule = SYNC if delay == 0 else {**FIXED_D64, "init_args": {"delay": delay}}
    cfg = config(method, seed, schedule, save_dir, name, max_steps=STEPS)
    cfg["model"]["actor"], cfg["data"]["group_size"] = MODEL, group_size
    version_dir = write_version(save_dir / name, 0, cfg, range(STEPS), lambda t: float(delay))
    writer = SummaryWriter(str(version_dir), filename_suffix=".diag")
    for step in range(STEPS):
        writer.add_scalar("diag/entropy/mean", entropy_of(method, delay, step), step)
    if delay:  # Diagnostics' one-off marker: the queue starts draining D updates before the end
        writer.add_scalar("diag/drain/step", float(max(STEPS - delay, 1)), max(STEPS - delay, 1))
    writer.close()
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
        for method in ("gmc", "tic"):
            write_run(root, method, 128, group_size)
    out = root / "tables"
    written = tables.main(["--runs-root", *(str(p) for p in sorted(root.iterdir())), "--out", str(out)])
    return out, written


def test_table3_rows_are_delay_by_method_after_the_base_model(suite):
    out, _ = suite
    header, rows = table_rows((out / "paper_tables.md").read_text(), "**Table 3.**", key_cells=2)
    assert header == ["Delay", "Method", "Greedy", "pass@1", "pass@2", "pass@4", "pass@8", "pass@16", "seeds"]
    methods = ("GMC-GRPO", "TIC-GRPO", "GRPO")  # the paper's order
    assert list(rows) == [("–", "Base (no RL)")] + [(str(d), m) for d in (0, 32, 128) for m in methods]
    # the 16 runs' step-0 entries are one evaluation of the base model: 0.30 greedy, 0.20 + 0.04 a doubling
    assert rows[("–", "Base (no RL)")] == ["30.00", "20.00", "24.00", "28.00", "32.00", "36.00", "–"]
    # GMC, D = 128, update 8: 0.30 + 0.06 + 0.08 - 0.0128 + 0.024 = 0.4512, seed 1 0.4712 (G = 4, 32 left out)
    assert rows[("128", "GMC-GRPO")] == ["46.12 ± 1.41", "36.12 ± 1.41", "40.12 ± 1.41", "44.12 ± 1.41",
                                         "48.12 ± 1.41", "52.12 ± 1.41", "2"]  # fmt: skip
    # TIC, D = 32: 0.30 + 0.04 + 0.08 - 0.0032 + 0.008 = 0.4248; GRPO, D = 0 (Sync): 0.408
    assert rows[("32", "TIC-GRPO")][:2] == ["42.48", "32.48"]
    assert rows[("0", "GRPO")][:2] == ["40.80", "30.80"]


def test_table4_rows_checkpoint_by_group_size_with_gmc_minus_tic(suite):
    out, _ = suite
    text = (out / "paper_tables.md").read_text()
    header, rows = table_rows(text, "**Table 4.**", key_cells=2)
    assert header == ["Checkpoint", "G", "GMC-GRPO", "TIC-GRPO", "Δ Pass@1 (pp)", "seeds"]
    assert list(rows) == [(str(step), str(g)) for step in (2, 4, 8) for g in (4, 8, 32)]
    # Δ = GMC's avg@16 minus TIC's: 0.02 (gain) + 0.002 G (GMC's extra per response), + 0.01 at G = 8 (GMC's seeds
    # 0 and 1 average +0.01), whatever the checkpoint: +2.80 at G = 4, +4.60 at G = 8, +8.40 at G = 32
    for step in ("2", "4", "8"):
        assert [rows[(step, g)][2] for g in ("4", "8", "32")] == ["+2.80", "+4.60", "+8.40"]
    # update 2, G = 8: GMC 0.30 + 0.06 + 0.02 - 0.0128 + 0.024 = 0.3912 and 0.4112; TIC 0.3552
    assert rows[("2", "8")] == ["40.12 ± 1.41 / 30.12 ± 1.41", "35.52 / 25.52", "+4.60", "2 / 1"]
    # update 8, G = 32: GMC 0.30 + 0.06 + 0.08 - 0.0128 + 0.096 = 0.5232; TIC 0.30 + 0.04 + 0.08 - 0.0128 + 0.032
    assert rows[("8", "32")] == ["52.32 / 42.32", "43.92 / 33.92", "+8.40", "1 / 1"]
    caption = text.split("**Table 4.**", 1)[1].split("\n", 1)[0]
    assert "checkpoints 2, 4, 8" in caption and "delay 128" in caption and "avg@16" in caption


def test_figures_2_to_5_are_drawn_from_run_folders(suite):
    out, written = suite
    for stem in ("fig2_pass_at_1", "fig3_pass_at_1", "fig4_entropy", "fig5_reward_by_group_size"):
        for suffix in ("png", "pdf"):
            path = out / f"{stem}.{suffix}"
            assert path in written and path.stat().st_size > 5_000, path
    fig2, fig3 = (matplotlib.image.imread(out / f"fig{n}_pass_at_1.png") for n in (2, 3))
    assert fig3.shape[1] > fig2.shape[1]  # Figure 2: D = 0 and 128 (of 0, 64, 128); Figure 3: 0, 32 and 128
    assert not (out / "fig6_a3po_reward.png").exists()


def drawn(function, *args):
    """The figure ``function`` draws, caught before it is saved."""
    captured = {}
    real = plots.save
    plots.save = tables.save = lambda fig, out, stem: captured.setdefault("fig", fig) and []
    try:
        function(*args)
    finally:
        plots.save = tables.save = real
    return captured["fig"]


def test_figure_panels_lines_and_drain_markers(suite):
    out, _ = suite
    runs, _ = plots.load_run_folders(plots.find_run_folders(out.parent))
    fig2 = drawn(tables.figure_pass_at_1, runs, Path("unused"), "fig2", tables.FIGURE2_DELAYS)
    assert [ax.get_title() for ax in fig2.axes] == ["D = 0", "D = 128"]
    assert [line.get_label() for line in fig2.axes[1].get_lines()] == ["GMC-GRPO (2 seeds)", "TIC-GRPO (1 seed)",
                                                                       "GRPO (1 seed)"]  # fmt: skip
    fig4 = drawn(plots.figure_entropy, runs, Path("unused"))
    assert [ax.get_title() for ax in fig4.axes] == ["D = 0", "D = 32", "D = 128"]
    lines = fig4.axes[0].get_lines()  # D = 0: faint and smoothed per method, no drain (Sync never drains)
    assert [line.get_label() for line in lines[1::2]] == ["GMC-GRPO", "TIC-GRPO", "GRPO"]
    assert list(lines[0].get_ydata()) == pytest.approx([entropy_of("gmc", 0, t) for t in range(STEPS)])
    drains = [line for line in fig4.axes[2].get_lines() if line.get_linestyle() == "--"]
    assert [line.get_label() for line in drains] == ["queue drains (1)"]  # max(8 - 128, 1), from the records
    fig5 = drawn(plots.figure_reward_by_group_size, runs, Path("unused"))
    assert [ax.get_title() for ax in fig5.axes] == ["G = 4", "G = 8", "G = 32"]
    assert [line.get_label() for line in fig5.axes[1].get_lines()[1::2]] == ["GMC-GRPO (2 seeds)",
                                                                             "TIC-GRPO (1 seed)"]  # fmt: skip
    for fig in (fig2, fig4, fig5):
        plots.plt.close(fig)


def test_figure_lines_are_the_math500_seed_means(suite):
    out, _ = suite
    runs, _ = plots.load_run_folders(plots.find_run_folders(out.parent))
    members = [r for r in runs if r.delay == 128 and r.group_size == 8 and r.method == "gmc"]
    assert len(members) == 2
    steps, mean, std = tables.pass_curve(members, "math500")
    assert steps == list(CHECKPOINTS)
    assert mean[0] == pytest.approx(0.20) and std[0] == 0.0  # the base model's pass@1 (avg@16)
    # update 8: 0.4512 - 0.1 and 0.4712 - 0.1
    assert mean[-1] == pytest.approx(0.3612) and std[-1] == pytest.approx(0.02 / 2**0.5)

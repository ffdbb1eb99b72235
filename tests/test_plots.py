"""scripts/plots.py renders every figure and table from a small synthetic sweep (TensorBoard logs + eval JSONs)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import matplotlib.image
import pytest
from torch.utils.tensorboard import SummaryWriter

REPO = Path(__file__).resolve().parents[1]
STEPS = 40
CHECKPOINTS = (0, 20, 40)


def load_script(name: str):
    """Import a script by path (scripts are entry points, not a package)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script executes
    spec.loader.exec_module(module)
    return module


plots = load_script("plots")
OFFSET = {"grpo": 0.0, "tic": 0.05, "gmc": 0.1}


def greedy_of(method: str, delay: int, g: int, seed: int, schedule: str, step: int) -> float:
    bonus = 0.02 if schedule == "corollary1" else 0.0
    return 0.2 + OFFSET[method] + bonus + 0.001 * g - 0.001 * delay + 0.01 * seed + 0.002 * step


def reward_of(method: str, delay: int, g: int, seed: int, schedule: str, step: int) -> float:
    return 0.3 + OFFSET[method] + 0.005 * step + 0.01 * seed - 0.0005 * delay + 0.001 * g


def dropped_of(delay: int, seed: int, step: int) -> float:
    return 0.01 * delay + 0.1 * seed + 0.0013 * step


def write_run(sweep: Path, method: str, delay: int, g: int, seed: int, schedule: str = "constant") -> dict:
    name = f"{method}-d{delay}-g{g}-s{seed}" + ("-corollary1" if schedule != "constant" else "")
    run_dir = sweep / "runs" / name
    writer = SummaryWriter(str(run_dir / "tb" / "version_0"))
    for step in range(STEPS):
        writer.add_scalar("diag/reward/mean", reward_of(method, delay, g, seed, schedule, step), step)
        writer.add_scalar("diag/entropy/mean", 1.0 - 0.01 * step + 0.1 * (step % 2), step)
        writer.add_scalar("correction/eps", 0.28 if schedule == "constant" else 0.5 + 0.01 * seed, step)
        writer.add_scalar("diag/tic/dropped_fraction", dropped_of(delay, seed, step), step)
        writer.add_scalar("diag/removed_mass/mean", float(step % 5), step)  # median over 0..39 = 2
    if delay:
        writer.add_scalar("diag/drain/step", STEPS - delay, STEPS - delay)
    writer.close()
    (run_dir / "eval").mkdir(parents=True)
    for step in CHECKPOINTS:
        greedy = greedy_of(method, delay, g, seed, schedule, step)
        bench = {"title": "addition", "problems": 10, "n": 4, "greedy": greedy, "avg@n": greedy - 0.05,
                 "pass@1": greedy - 0.05, "pass@4": greedy + 0.1}  # fmt: skip
        entry = {"step": step, "version": step, "benchmarks": {"heldout": bench}, "macro": {}}
        (run_dir / "eval" / f"step_{step}.json").write_text(json.dumps(entry))
    return {name: {"method": method, "delay": delay, "group_size": g, "seed": seed, "eps_schedule": schedule,
                   "dir": str(run_dir), "status": "done"}}  # fmt: skip


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    runs = {}
    for method in ("grpo", "tic", "gmc"):
        for delay in (0, 16):
            for seed in (0, 1):
                runs.update(write_run(root, method, delay, 8, seed))
    for method in ("tic", "gmc"):
        for g in (4, 32):
            for seed in (0, 1):
                runs.update(write_run(root, method, 16, g, seed))
    for seed in (0, 1):
        runs.update(write_run(root, "gmc", 16, 8, seed, "corollary1"))
    runs["tic-d16-g8-s9"] = {"method": "tic", "delay": 16, "group_size": 8, "seed": 9, "status": "failed",
                             "dir": str(root / "runs" / "tic-d16-g8-s9")}  # fmt: skip
    (root / "manifest.json").write_text(json.dumps({"invocations": [], "runs": runs}))
    return root


def test_every_figure_and_table_is_rendered(sweep, tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\nprose stays\n\n<!-- tables:begin -->\nSTALE-TABLES\n<!-- tables:end -->\n\nafter\n")
    written = plots.main(["--sweep", str(sweep), "--out", str(tmp_path / "fig"), "--doc", str(doc)])
    for stem in ("fig2_pass_at_1", "fig4_entropy", "fig5_reward_by_group_size"):
        for suffix in ("png", "pdf"):
            path = tmp_path / "fig" / f"{stem}.{suffix}"
            assert path in written and path.stat().st_size > 5_000, path
        image = matplotlib.image.imread(tmp_path / "fig" / f"{stem}.png")
        assert image.ndim == 3 and image.shape[1] > image.shape[0]  # panels side by side
    text = (tmp_path / "fig" / "tables.md").read_text()
    content = doc.read_text()
    assert "prose stays" in content and "after" in content and "STALE-TABLES" not in content and text in content
    assert "Not finished (left out): tic-d16-g8-s9." in text


def expected(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    scaled = [scale * v for v in values]
    return f"{statistics.fmean(scaled):.{digits}f} ± {statistics.stdev(scaled):.{digits}f}"


def table_rows(text: str, title: str) -> dict[str, list[str]]:
    block = text.split(title, 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in block.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_table_cells_are_the_seed_statistics(sweep):
    runs, missing = plots.load_sweep(sweep)
    assert missing == ["tic-d16-g8-s9"]
    text = plots.tables(runs, missing)
    table1 = table_rows(text, "**Table 1.**")
    assert list(table1) == ["GMC-GRPO", "TIC-GRPO", "GRPO"]  # the paper's order, constant threshold only
    label = {"grpo": "GRPO", "tic": "TIC-GRPO", "gmc": "GMC-GRPO"}
    for method in ("grpo", "gmc"):
        for col, delay in enumerate((0, 16)):
            greedy = [greedy_of(method, delay, 8, s, "constant", 40) for s in (0, 1)]
            want = f"{expected(greedy)} / {expected([v - 0.05 for v in greedy])}"
            assert table1[label[method]][col] == want
    table1b = table_rows(text, "**Table 1b.**")
    final = [statistics.fmean(reward_of("tic", 16, 8, s, "constant", t) for t in range(STEPS - 25, STEPS))
             for s in (0, 1)]  # fmt: skip
    assert table1b["TIC-GRPO"][1] == expected(final, scale=1.0, digits=3)
    table3 = table_rows(text, "**Table 3.**")
    greedy = [greedy_of("gmc", 16, 32, s, "constant", 40) for s in (0, 1)]
    assert table3["GMC-GRPO"][2].startswith(f"{expected(greedy)} / ")  # columns G = 4, 8, 32
    table2 = table_rows(text, "**Table 2.**")  # keyed by method; the last delay's row wins
    want = statistics.fmean(statistics.fmean(dropped_of(16, s, t) for t in range(STEPS)) for s in (0, 1))
    assert table2["TIC-GRPO"][0] == "16" and table2["TIC-GRPO"][1] == f"{want:.3f}" and table2["TIC-GRPO"][3] == "2.000"
    assert table2["TIC-GRPO"][4] == "–"  # no ESS logged in this sweep
    table4 = table_rows(text, "**Table 4.**")
    assert table4["GMC-GRPO + Cor. 1"][0] == "2" and table4["GMC-GRPO + Cor. 1"][3] == expected([0.5, 0.51], 1.0, 3)
    assert table4["GMC-GRPO"][3] == "0.280 ± 0.000"


def test_single_seed_cells_show_no_spread():
    assert plots.cell([0.5]) == "50.0" and plots.cell([0.5, 0.7]) == "60.0 ± 14.1" and plots.cell([]) == "–"


def test_series_helpers():
    steps, mean, std = plots.seed_mean([[(0, 1.0), (1, 2.0), (2, 3.0)], [(1, 4.0), (2, 5.0)]])
    assert steps == [1, 2] and mean == [3.0, 4.0] and std == pytest.approx([2**0.5, 2**0.5])
    entry = {"step": 3, "benchmarks": {"a": {"greedy": 0.5, "avg@n": 0.25, "n": 4},
                                       "b": {"greedy": 1.0, "avg@n": 0.75, "pass@1": 0.75, "n": 4}}}  # fmt: skip
    assert plots.eval_summary(entry) == {"greedy": 0.75, "avg@n": 0.5, "pass@1": 0.5, "n": 4}


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json not found"):
        plots.load_sweep(tmp_path)
    doc = tmp_path / "doc.md"
    doc.write_text("no markers")
    with pytest.raises(ValueError, match="no <!-- tables:begin -->"):
        plots.update_doc(doc, "x")
    doc.write_text("a <!-- n400:begin -->old<!-- n400:end --> b <!-- tables:begin -->keep<!-- tables:end -->")
    plots.update_doc(doc, "new\n", block="n400")
    want = "a <!-- n400:begin -->\nnew\n<!-- n400:end --> b <!-- tables:begin -->keep<!-- tables:end -->"
    assert doc.read_text() == want

"""scripts/tables.py on runs launched directly with the CLI: logger folders with version_*/config.yaml.

Each run folder is laid out as `python -m lit_gmc fit` leaves it: real TensorBoard event files and LightningCLI's
config.yaml in ``<save_dir>/<name>/version_<n>/``, the Evaluation callback's JSONs in ``version_<n>/eval/``, a
``checkpoints/`` folder beside the versions; one run is resumed into ``version_1``. Values are simple functions of
(method, seed, benchmark, step), so the cells below are worked out by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_tables import plots, table_rows, tables
from torch.utils.tensorboard import SummaryWriter

MODEL = "Qwen/Qwen3-4B-Base"
STEPS = 20
BENCH_N = {"math500": 16, "gsm8k": 8}
TITLES = {"math500": "MATH-500", "gsm8k": "GSM8K"}
BASE = {"grpo": 0.30, "tic": 0.32, "gmc": 0.40}
VIRTUAL_CLOCK = {
    "class_path": "lit_gmc.data.schedules.virtual_clock.VirtualClock",
    "init_args": {"c_gen": 85.0, "lam": 28.0, "c_update": 1.0, "max_launches": 1351, "overlap": True},
}
FIXED_D64 = {"class_path": "lit_gmc.data.schedules.base.FixedDelay", "init_args": {"delay": 64}}
SYNC = {"class_path": "lit_gmc.data.schedules.base.Sync", "init_args": {"inner_steps": 4}}


def greedy_of(method: str, seed: int, bench: str, step: int, bonus: float = 0.0) -> float:
    return BASE[method] + bonus + 0.01 * list(BENCH_N).index(bench) + 0.001 * step + 0.02 * seed


def config(method: str, seed: int, schedule: dict, save_dir: Path, name: str, max_steps: int = STEPS) -> dict:
    """A LightningCLI config.yaml of `lit_gmc fit` (the keys the loader reads, among others it ignores)."""
    return {
        "seed_everything": seed,
        "trainer": {"accelerator": "gpu", "devices": 1, "max_steps": max_steps, "log_every_n_steps": 1,
                    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": str(save_dir), "name": name, "version": None}}},
        "model": {"actor": MODEL, "correction": method, "eps": None, "aggregation": None, "eps_schedule": "constant",
                  "eps_scale": 0.375, "lr": 1.0e-6},
        "data": {"schedule": schedule, "group_size": 8, "batch_prompts": 8, "max_new_tokens": 4096, "seed": 0},
        "checkpoint": {"at_steps": [10, 20], "save_last": True},
    }  # fmt: skip


def write_eval(version_dir: Path, method: str, seed: int, step: int, bonus: float = 0.0) -> None:
    """``eval/step_<step>.json`` as lit_gmc.callbacks.evaluation.Evaluation.run writes it."""
    benchmarks = {}
    for bench, n in BENCH_N.items():
        greedy = greedy_of(method, seed, bench, step, bonus)
        entry = {"title": TITLES[bench], "problems": 5, "n": n, "greedy": greedy, "avg@n": greedy - 0.1}
        entry.update({f"pass@{k}": greedy - 0.1 + 0.04 * (k.bit_length() - 1) for k in (1, 2, 4, 8, 16) if k <= n})
        benchmarks[bench] = entry
    macro = {"greedy": sum(b["greedy"] for b in benchmarks.values()) / len(benchmarks),
             "avg@n": sum(b["avg@n"] for b in benchmarks.values()) / len(benchmarks)}  # fmt: skip
    out = version_dir / "eval" / f"step_{step}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"step": step, "version": step, "benchmarks": benchmarks, "macro": macro}, indent=2))


def write_version(run_dir: Path, version: int, cfg: dict, steps: range, delay_of, reward: float = 0.5) -> Path:
    version_dir = run_dir / f"version_{version}"
    version_dir.mkdir(parents=True)
    (version_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    writer = SummaryWriter(str(version_dir))
    for step in steps:
        writer.add_scalar("train/reward", reward + 0.01 * step, step)
        writer.add_scalar("delay/mean", delay_of(step), step)
    writer.close()
    return version_dir


def write_run(save_dir: Path, name: str, method: str, seed: int, schedule: dict, delay_of, bonus: float = 0.0,
              last_step: int = STEPS - 1) -> Path:  # fmt: skip
    """A run that was never interrupted (``last_step`` < STEPS - 1: one still going), evaluated at 0 and 20."""
    run_dir = save_dir / name
    version_dir = write_version(run_dir, 0, config(method, seed, schedule, save_dir, name), range(last_step + 1),
                                delay_of)  # fmt: skip
    for step in (0, STEPS) if last_step == STEPS - 1 else (0,):
        write_eval(version_dir, method, seed, step, bonus)
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    return run_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    suite = root / "simulated_async"
    # GMC crashed after update 11 (checkpoint at 8) and was resumed into version_1, which re-logged 8..19 and
    # re-evaluated step 10: version_0 logged delay/mean 2 at 0..11, version_1 4 at 8..19.
    gmc = suite / "qwen3_4b_gmc"
    v0 = write_version(gmc, 0, config("gmc", 0, VIRTUAL_CLOCK, suite, gmc.name), range(12), lambda t: 2.0, -1.0)
    write_eval(v0, "gmc", 0, 0)
    write_eval(v0, "gmc", 0, 10, bonus=-0.3)  # stale: version_1's evaluation of step 10 must win
    v1 = write_version(gmc, 1, config("gmc", 0, VIRTUAL_CLOCK, suite, gmc.name), range(8, STEPS), lambda t: 4.0)
    write_eval(v1, "gmc", 0, 10)
    write_eval(v1, "gmc", 0, STEPS)
    (gmc / "checkpoints").mkdir()
    for seed, name in enumerate(("qwen3_4b_tic", "qwen3_4b_tic_s1")):  # delay/mean 1 + (t mod 2) + seed
        write_run(suite, name, "tic", seed, VIRTUAL_CLOCK, lambda t, s=seed: 1.0 + t % 2 + s)
    write_run(suite, "qwen3_4b_grpo", "grpo", 0, VIRTUAL_CLOCK, lambda t: 1.0, last_step=9)  # still running
    write_run(root / "fixed_delay_d64", "qwen3_4b_gmc", "gmc", 0, FIXED_D64, lambda t: 64.0, bonus=-0.1)
    write_run(root / "fixed_delay_d0", "qwen3_4b_gmc", "gmc", 0, SYNC, lambda t: float(t % 4), bonus=0.05)
    return root


def test_run_folders_are_found_and_loaded_with_their_config(root):
    found = plots.find_run_folders(root)
    assert [p.relative_to(root).as_posix() for p in found] == [
        "fixed_delay_d0/qwen3_4b_gmc", "fixed_delay_d64/qwen3_4b_gmc", "simulated_async/qwen3_4b_gmc",
        "simulated_async/qwen3_4b_grpo", "simulated_async/qwen3_4b_tic", "simulated_async/qwen3_4b_tic_s1"]  # fmt: skip
    runs, missing = plots.load_run_folders(found)
    assert missing == ["qwen3_4b_grpo (10/20 updates)"]  # logs stop at update 9 of max_steps 20
    by_path = {run.name: run for run in runs}  # two folders are named qwen3_4b_gmc: those are named by path
    sync, d64, suite = (by_path[str((root / d / "qwen3_4b_gmc").resolve())]
                        for d in ("fixed_delay_d0", "fixed_delay_d64", "simulated_async"))  # fmt: skip
    assert (sync.delay, sync.schedule, d64.delay, d64.schedule) == (0, "Sync", 64, "FixedDelay")
    assert (suite.delay, suite.schedule) == (None, "VirtualClock")
    tic = by_path["qwen3_4b_tic_s1"]
    assert (tic.method, tic.seed, tic.group_size, tic.eps_schedule, tic.model) == ("tic", 1, 8, "constant", MODEL)


def test_resumed_versions_merge_into_one_run(root):
    run, unfinished = plots.load_run_folder(root / "simulated_async" / "qwen3_4b_gmc")
    assert unfinished is None and run.name == "qwen3_4b_gmc"
    # version_0's 0..7, then version_1's 8..19 (it wins 8..11, which both logged)
    assert run.scalars["delay/mean"] == [(t, 2.0 if t < 8 else 4.0) for t in range(STEPS)]
    assert run.scalars["train/reward"][7][1] == pytest.approx(-1.0 + 0.07)
    assert run.scalars["train/reward"][8][1] == pytest.approx(0.5 + 0.08)
    assert sorted(run.evals) == [0, 10, STEPS]
    assert run.evals[10]["benchmarks"]["math500"]["greedy"] == pytest.approx(0.41)  # version_1's, not 0.11


def test_tables_of_the_simulated_async_suite_from_run_folders(root, tmp_path):
    written = tables.main(["--runs-root", str(root / "simulated_async"), "--out", str(tmp_path / "out")])
    assert {p.name for p in written} == {"paper_tables.md"}  # no A-3PO run: no Figure 6; no fixed delay: no 2-5
    text = (tmp_path / "out" / "paper_tables.md").read_text()
    header, rows = table_rows(text, "**Table 1.**")
    assert header == ["Method", "Avg. Delay", "MATH-500", "GSM8K", "Avg. perf.", "seeds"]
    assert list(rows) == ["*Qwen3-4B-Base*", "TIC-GRPO", "GMC-GRPO"]  # the unfinished GRPO run is left out
    # GMC at update 20: 0.40 + 0.02 (MATH-500) and + 0.01 (GSM8K), avg@n 0.1 lower; average delay over the merged
    # 20 updates: (8 x 2 + 12 x 4) / 20 = 3.2 (version_1 alone: 4.0; version_0 winning 8..11: 3.0)
    assert rows["GMC-GRPO"] == ["3.20", "42.00 / 32.00", "43.00 / 33.00", "42.50 / 32.50", "1"]
    # TIC seeds 0 and 1 (+0.02): 0.34 and 0.36 at MATH-500; delays 1.5 and 2.5
    assert rows["TIC-GRPO"] == ["2.00 ± 0.71", "35.00 ± 1.41 / 25.00 ± 1.41", "36.00 ± 1.41 / 26.00 ± 1.41",
                                "35.50 ± 1.41 / 25.50 ± 1.41", "2"]  # fmt: skip
    caption = text.split("**Table 1.**", 1)[1].split("\n", 1)[0]
    assert "(update 20)" in caption and "n = 16 for MATH-500; n = 8 for GSM8K" in caption
    # the virtual clock sets no delay (no Table 3 or 4), and there is no A-3PO run (no Table 5)
    assert "**Table 3" not in text and "**Table 4" not in text and "**Table 5" not in text
    assert text.rstrip().endswith("Not finished (left out): qwen3_4b_grpo (10/20 updates).")


def test_runs_are_placed_by_their_schedule(root, tmp_path):
    folders = [root / "fixed_delay_d64" / "qwen3_4b_gmc", root / "fixed_delay_d0" / "qwen3_4b_gmc",
               root / "simulated_async" / "qwen3_4b_gmc", root / "simulated_async" / "qwen3_4b_tic"]  # fmt: skip
    tables.main(["--runs", *map(str, folders), "--out", str(tmp_path)])
    text = (tmp_path / "paper_tables.md").read_text()
    _, rows = table_rows(text, "**Table 1.**")
    assert list(rows) == ["*Qwen3-4B-Base*", "TIC-GRPO", "GMC-GRPO"]  # VirtualClock runs only
    assert rows["GMC-GRPO"][0] == "3.20"
    # Sync (D = 0) and FixedDelay (D = 64) go to Table 3; MATH-500 at update 20: Sync 0.42 + 0.05, D = 64 0.42 - 0.1
    _, rows = table_rows(text, "**Table 3.**", key_cells=2)
    assert list(rows) == [("–", "Base (no RL)"), ("0", "GMC-GRPO"), ("64", "GMC-GRPO")]
    assert rows[("0", "GMC-GRPO")][0] == "47.00" and rows[("64", "GMC-GRPO")][0] == "32.00"
    assert "Not finished" not in text


def test_unfinished_runs_can_be_included(root, tmp_path):
    tables.main(["--runs-root", str(root / "simulated_async"), "--include-unfinished", "--out", str(tmp_path)])
    text = (tmp_path / "paper_tables.md").read_text()
    _, rows = table_rows(text, "**Table 1.**")
    assert list(rows) == ["*Qwen3-4B-Base*", "GRPO", "TIC-GRPO", "GMC-GRPO"]
    assert rows["GRPO"][:2] == ["1.00", "30.00 / 20.00"]  # its last evaluation: update 0
    assert "(update 0, 20)" in text and "Not finished" not in text


def test_config_parameters_and_errors(root, tmp_path):
    where = Path("config.yaml")
    cfg = config("gmc", 5, FIXED_D64, tmp_path, "x")
    cfg["seed_everything"], cfg["data"]["seed"], cfg["model"]["eps_schedule"] = None, 3, "corollary1"
    assert plots.run_parameters(cfg, where) == {"method": "gmc", "delay": 64, "group_size": 8, "seed": 3,
                                                "eps_schedule": "corollary1", "model": MODEL,
                                                "schedule": "FixedDelay"}  # fmt: skip
    live_schedule = {"class_path": "lit_gmc.data.schedules.live.Live", "init_args": {"workers": 1}}
    live = config("tic", 0, live_schedule, tmp_path, "x")
    assert plots.run_parameters(live, where)["delay"] is None
    del cfg["data"]["group_size"]
    with pytest.raises(ValueError, match="data.group_size"):
        plots.run_parameters(cfg, where)
    # a version that is not the same run (another rule under the same logger name) is refused
    clash = tmp_path / "clash"
    write_version(clash, 0, config("tic", 0, VIRTUAL_CLOCK, tmp_path, "clash"), range(3), lambda t: 1.0)
    write_version(clash, 1, config("gmc", 0, VIRTUAL_CLOCK, tmp_path, "clash"), range(3, 6), lambda t: 1.0)
    with pytest.raises(ValueError, match="not the same run"):
        plots.load_run_folder(clash)
    with pytest.raises(FileNotFoundError, match="version_<n>/config.yaml"):
        plots.load_run_folder(root / "simulated_async")  # the save_dir, not a logger folder
    with pytest.raises(SystemExit):
        tables.main(["--out", str(tmp_path)])  # no source
    with pytest.raises(SystemExit):
        tables.main(["--runs-root", str(tmp_path / "nothing"), "--out", str(tmp_path)])


@pytest.mark.slow
def test_tables_from_real_tiny_runs(tmp_path, shared_data):
    """Two real tiny runs (GMC and TIC on the virtual clock, evaluated on the six benchmarks) through the CLI."""
    from run_helpers import component, fit, write_config

    from lit_gmc.tblog import read_scalars

    evaluation = {"class_path": "lit_gmc.callbacks.evaluation.Evaluation",
                  "init_args": {"at_steps": [3], "data_dir": str(shared_data), "samples": 2, "max_new_tokens": 4,
                                "max_prompt_tokens": 60, "max_problems": 1, "verifier_workers": 1}}  # fmt: skip
    (tmp_path / "suite").mkdir()
    for rule in ("gmc", "tic"):
        config = write_config(tmp_path / "suite", f"tiny_{rule}", total=3, extra_callbacks=[evaluation],
                              schedule=component("VirtualClock", lam=300.0))  # fmt: skip
        fit(config, "--model.correction", rule.upper())
    out = tmp_path / "tables"
    tables.main(["--runs-root", str(tmp_path / "suite"), "--out", str(out)])
    text = (out / "paper_tables.md").read_text()
    header, rows = table_rows(text, "Table 1")
    assert list(rows)[1:] == ["TIC-GRPO", "GMC-GRPO"]
    assert len(header) == 1 + 1 + 6 + 1 + 1  # method, average delay, six benchmarks, average, seeds
    for rule, label in (("gmc", "GMC-GRPO"), ("tic", "TIC-GRPO")):
        cells = rows[label]
        assert all(" / " in cell for cell in cells[1:8])  # greedy / avg@n of each benchmark and the macro average
        delays = [value for _, value in read_scalars(tmp_path / "suite" / f"tiny_{rule}")["delay/mean"]]
        assert cells[0] == f"{sum(delays) / len(delays):.2f}"
    assert not (out / "fig6_a3po_reward.png").exists()  # no A-3PO run

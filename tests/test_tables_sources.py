"""scripts/tables.py: the same six runs, given as a sweep and as run folders, give identical tables and figures.

GMC-GRPO and TIC-GRPO at D = 128 with G = 4 and 8 (fixed-delay suite, group-size study), A-3PO and GMC-GRPO on the
virtual clock (simulated suite): enough for Tables 1, 3, 4 and 5 and Figures 2-6. Each run is written twice with the
same records: once as ``scripts/sweep.py`` lays a sweep out (manifest, ``runs/<name>/config.json``, ``tb/``,
``eval/``), once as ``python -m lit_gmc fit`` leaves a logger folder (``version_0/config.yaml``, events, ``eval/``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_tables import tables
from torch.utils.tensorboard import SummaryWriter

MODEL = "Qwen/Qwen3-1.7B-Base"
STEPS = 30
RULES = {"gmc": "GMC", "tic": "TIC", "a3po": "A3PO"}
FIXED = {"class_path": "lit_gmc.data.schedules.FixedDelay", "init_args": {"delay": 128}}
CLOCK = {"class_path": "lit_gmc.data.schedules.virtual_clock.VirtualClock", "init_args": {"c_gen": 85.0, "lam": 28.0}}
RUNS = [("gmc", FIXED, 8), ("tic", FIXED, 8), ("gmc", FIXED, 4), ("tic", FIXED, 4), ("a3po", CLOCK, 8),
        ("gmc", CLOCK, 8)]  # fmt: skip


def config(method: str, schedule: dict, group_size: int) -> dict:
    return {"seed_everything": 0, "trainer": {"max_steps": STEPS},
            "model": {"actor": MODEL, "correction": {"class_path": f"lit_gmc.rules.{RULES[method]}"}},
            "data": {"schedule": schedule, "group_size": group_size, "seed": 0}}  # fmt: skip


def write_records(folder: Path, eval_dir: Path, index: int, method: str, fixed: bool) -> None:
    """Scalars and evaluations that differ from run to run (``index``), the same however the run is laid out."""
    writer = SummaryWriter(str(folder))
    for step in range(STEPS):
        writer.add_scalar("train/reward", 0.0 if method == "a3po" and step >= 3 else 0.3 + 0.01 * index * step, step)
        writer.add_scalar("diag/entropy/mean", 1.0 - 0.02 * index * step, step)
        writer.add_scalar("delay/mean", 128.0 if fixed else 10.0 + index + step % 3, step)
    if fixed:
        writer.add_scalar("diag/drain/step", 5.0, 5)
    writer.close()
    eval_dir.mkdir(parents=True, exist_ok=True)
    for step in (0, 10, STEPS):
        benchmarks = {}
        for offset, bench in enumerate(("math500", "gsm8k")):
            greedy = 0.3 + (0.0 if step == 0 else 0.01 * index + 0.002 * step) + 0.02 * offset
            entry = {"title": bench.upper(), "problems": 5, "n": 16, "greedy": greedy, "avg@n": greedy - 0.1}
            benchmarks[bench] = entry | {f"pass@{k}": greedy - 0.1 + 0.03 * k.bit_length() for k in (1, 2, 4, 8, 16)}
        (eval_dir / f"step_{step}.json").write_text(json.dumps({"step": step, "benchmarks": benchmarks}))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sources")
    manifest = {}
    for index, (method, schedule, g) in enumerate(RUNS):
        cfg, fixed = config(method, schedule, g), schedule is FIXED
        name = f"{method}-{'d128' if fixed else 'clock'}-g{g}-s0"
        sweep_dir = root / "sweep" / "runs" / name
        write_records(sweep_dir / "tb" / "version_0", sweep_dir / "eval", index, method, fixed)
        (sweep_dir / "config.json").write_text(json.dumps(cfg))
        manifest[name] = {"method": method, "group_size": g, "seed": 0, "actor": MODEL, "dir": str(sweep_dir),
                          "status": "done"} | ({"delay": 128} if fixed else {})  # fmt: skip
        version = root / "folders" / ("fixed_delay_d128" if fixed else "simulated_async") / f"{name}" / "version_0"
        write_records(version, version / "eval", index, method, fixed)
        (version / "config.yaml").write_text(yaml.safe_dump(cfg))
    (root / "sweep" / "manifest.json").write_text(json.dumps({"invocations": [], "runs": manifest}))
    tables.main(["--sweep", str(root / "sweep"), "--out", str(root / "from_sweep")])
    tables.main(["--runs-root", str(root / "folders"), "--out", str(root / "from_folders")])
    return root / "from_sweep", root / "from_folders"


def test_a_sweep_and_run_folders_give_the_same_tables(outputs):
    from_sweep, from_folders = outputs
    text = (from_sweep / "paper_tables.md").read_text()
    for title in ("**Table 1.**", "**Table 3.**", "**Table 4.**", "**Table 5.**"):
        assert title in text
    assert "Training collapsed (update 3)" in text  # A-3PO's reward is 0 from update 3 to 29: 27 updates
    assert text == (from_folders / "paper_tables.md").read_text()


def test_a_sweep_and_run_folders_give_the_same_figures(outputs):
    from_sweep, from_folders = outputs
    stems = ("fig2_pass_at_1", "fig3_pass_at_1", "fig4_entropy", "fig5_reward_by_group_size", "fig6_a3po_reward")
    assert sorted(p.name for p in from_sweep.glob("*.png")) == sorted(f"{s}.png" for s in stems)
    for stem in stems:
        assert (from_sweep / f"{stem}.png").read_bytes() == (from_folders / f"{stem}.png").read_bytes(), stem

"""``examples/own_module``: another project's LightningModule, engine and DataModule using lit_gmc's callbacks.

The example runs as a script from a folder outside the repository (so it relies on the installed package, not
on the repository being the working directory), and the test checks what each callback did to that project.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lit_gmc.tblog import read_scalars

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_module" / "train.py"


def run_example(root: Path, steps: int, accumulate: int = 1) -> dict:
    root.mkdir()
    args = [sys.executable, str(EXAMPLE), "--root", str(root), "--steps", str(steps)]
    done = subprocess.run([*args, "--accumulate-grad-batches", str(accumulate)], cwd=root, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((root / "summary.json").read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, dict]:
    summary = run_example(tmp_path_factory.mktemp("outside") / "own", steps=12)
    return summary, read_scalars(summary["log_dir"])


def test_weights_reached_the_projects_engine(run):
    summary, _ = run
    # WeightSync(prefix="policy.") published the initial weights and then after each of the 12 steps ...
    assert (summary["global_step"], summary["engine_version"], summary["engine_loads"]) == (12, 12, 13)
    # ... every tensor, so the engine's behaviour copy is exactly the trained policy, which moved from its start
    assert summary["engine_matches_policy"] and summary["engine_left_initial"]


def test_delays_and_diagnostics_are_logged_at_the_global_steps(run):
    _, scalars = run
    steps = list(range(12))
    for tag in ("delay/running_mean", "delay/tau_bar_2", "delay/tau_bar_4", "diag/log_rho/mean", "diag/ess/mean"):
        assert [step for step, _ in scalars[tag]] == steps, tag
    # The example's FIFO holds 2 batches: update n trains on rows sampled by the weights of version max(0, n - 2)
    delays = [min(n, 2) for n in steps]
    running = [value for _, value in scalars["delay/running_mean"]]
    assert running == pytest.approx([sum(delays[: n + 1]) / (n + 1) for n in steps])


def test_evaluation_used_the_projects_own_file_template_and_scorer(run):
    summary, scalars = run
    assert summary["evaluated_steps"] == [0, 6, 12]
    for step in (0, 6, 12):
        entry = json.loads((Path(summary["log_dir"]) / "eval" / f"step_{step}.json").read_text())
        assert (entry["step"], entry["version"]) == (step, step)
        sums = entry["benchmarks"]["sums"]
        assert (sums["title"], sums["problems"], sums["n"]) == ("Sums", 12, 4)
        assert set(sums) >= {"greedy", "avg@n", "pass@1", "pass@2", "pass@4"}
    for tag in ("eval/sums/greedy", "eval/sums/avg@4", "eval/sums/pass@4", "eval/macro/greedy"):
        assert [step for step, _ in scalars[tag]] == [0, 6, 12], tag


def test_under_gradient_accumulation_delays_are_logged_once_per_optimizer_step(tmp_path):
    summary = run_example(tmp_path / "own", steps=4, accumulate=2)
    assert (summary["global_step"], summary["engine_version"]) == (4, 4)
    scalars = read_scalars(summary["log_dir"])
    for tag in ("delay/tau_bar_4", "diag/log_rho/mean"):  # the user saw -1, 0, 0, 1, 1, ... against 0..7
        assert [step for step, _ in scalars[tag]] == [0, 1, 2, 3], tag
    assert [step for step, _ in scalars["train/reward"]] == [0, 1, 2, 3]  # the module's own self.log agrees

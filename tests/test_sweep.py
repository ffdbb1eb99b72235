"""scripts/sweep.py: the grid, the per-run config, argument checks, and a real resumable sweep of two tiny runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_plots import load_script

from lit_gmc.tblog import read_scalars

REPO = Path(__file__).resolve().parents[1]
sweep = load_script("sweep")


def grid_args(*extra: str):
    return sweep.parse_args(["run", "--out", "x", "--max-steps", "4", "--checkpoint-every", "2", *extra])


def test_grid_order_and_names():
    args = grid_args("--methods", "gmc", "tic", "--delays", "0", "8", "--seeds", "0", "1", "--group-sizes", "8")
    names = [spec.name for spec in sweep.expand_grid(args)]
    assert names == ["gmc-d0-g8-s0", "gmc-d0-g8-s1", "gmc-d8-g8-s0", "gmc-d8-g8-s1",
                     "tic-d0-g8-s0", "tic-d0-g8-s1", "tic-d8-g8-s0", "tic-d8-g8-s1"]  # fmt: skip
    adaptive = grid_args("--methods", "GMC", "--delays", "128", "--seeds", "2", "--eps-schedule", "corollary1",
                         "--tag", "fast", "--set", "optimizer.init_args.lr=1e-4")  # fmt: skip
    (spec,) = sweep.expand_grid(adaptive)
    assert spec.name == "gmc-d128-g8-s2-corollary1-fast" and spec.overrides == {"optimizer.init_args.lr": 1e-4}
    gmc = {"class_path": "lit_gmc.rules.GMC", "init_args": {"cap_schedule": "corollary1"}}
    assert sweep.run_config(spec, Path("x"))["model"]["correction"] == gmc


def test_run_config_sets_the_axes_and_keeps_rule_defaults(tmp_path):
    (spec,) = sweep.expand_grid(grid_args("--methods", "grpo", "--delays", "32", "--seeds", "1", "--group-sizes", "4",
                                          "--set", "data.batch_prompts=2"))  # fmt: skip
    config = sweep.run_config(spec, tmp_path)
    assert config["seed_everything"] == 1 and config["data"]["seed"] == 1
    fixed_delay = {"class_path": "lit_gmc.data.schedules.base.FixedDelay", "init_args": {"delay": 32}}
    assert config["data"] == {"schedule": fixed_delay, "group_size": 4, "seed": 1, "batch_prompts": 2}
    # GRPO keeps its own options (clip 0.2, its authors' aggregation)
    assert config["model"]["correction"] == {"class_path": "lit_gmc.rules.GRPO", "init_args": {}}
    classes = [c["class_path"].rsplit(".", 1)[1] for c in config["trainer"]["callbacks"]]
    assert classes == ["WeightSync", "DelayAccounting", "Diagnostics"]
    assert config["checkpoint"]["dirpath"] == str(tmp_path / "checkpoints")


def test_aggregation_held_fixed_across_rules_is_in_every_config_and_name(tmp_path):
    args = grid_args("--methods", "grpo", "a3po", "--delays", "8", "--seeds", "0", "--aggregation", "seq_sum_over_T")
    specs = sweep.expand_grid(args)
    assert [s.name for s in specs] == ["grpo-d8-g8-s0-seq_sum_over_T", "a3po-d8-g8-s0-seq_sum_over_T"]
    for spec, rule in zip(specs, ("GRPO", "A3PO"), strict=True):
        correction = sweep.run_config(spec, tmp_path)["model"]["correction"]
        assert correction == {"class_path": f"lit_gmc.rules.{rule}", "init_args": {"aggregation": "seq_sum_over_T"}}


def test_d0_is_the_papers_synchronous_protocol(tmp_path):
    """D = 0 of the fixed-delay suite is Algorithm 1 with 4 inner steps, not one on-policy update per batch."""
    (spec,) = sweep.expand_grid(grid_args("--methods", "gmc", "--delays", "0", "--seeds", "0"))
    sync = {"class_path": "lit_gmc.data.schedules.base.Sync", "init_args": {"inner_steps": 4}}
    assert sweep.run_config(spec, tmp_path)["data"]["schedule"] == sync
    fragment = yaml.safe_load((REPO / "configs" / "experiment" / "fixed_delay_d0.yaml").read_text())
    assert fragment["data"]["schedule"] == sync


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "data.schedule.init_args.delay=3"], "data.schedule.init_args.delay is a grid axis"),
        (["--set", "lr"], "expected SECTION.KEY=VALUE"),
        (["--max-steps", "5"], "--max-steps=5 must be a multiple of --checkpoint-every=2"),
        (["--delays", "-1"], "--delays: -1 must be >= 0"),
        (["--group-sizes", "1"], "--group-sizes: 1 must be >= 2"),
        (["--parallel", "0"], "--parallel must be >= 1"),
        (["--methods", "nope"], "--methods: nope is not one of a3po cispo dppo gac geomis geotis gmc grpo gspo icepop is m2po seqmis seqtis tic tis vcpo"),
        (["--methods", "gmc", "tic", "--eps-schedule", "corollary1"], "is GMC's cap schedule: use it with --methods"),
        (["--set", "model.correction.init_args.cap=0.3"], "model.correction.init_args.cap is a grid axis"),
    ],
)
def test_bad_arguments_are_named(extra, message, capsys):
    with pytest.raises(SystemExit):
        grid_args(*extra)
    assert message in capsys.readouterr().err


def test_a_run_with_another_config_under_the_same_name_is_refused(tmp_path):
    (spec,) = sweep.expand_grid(grid_args("--methods", "gmc", "--delays", "0", "--seeds", "0"))
    run_dir = tmp_path / "runs" / spec.name
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"model": {"lr": 1.0}}))
    manifest = sweep.Manifest(tmp_path)
    with pytest.raises(ValueError, match=f"run {spec.name} exists .* with a different config"):
        sweep.execute(spec, tmp_path, manifest, grid_args())


@pytest.mark.slow
def test_a_real_sweep_runs_skips_and_resumes(tmp_path):
    """Two tiny runs in parallel; a second invocation skips both; an interrupted one resumes from last.ckpt."""
    out = tmp_path / "sweep"
    command = [sys.executable, str(REPO / "scripts" / "sweep.py"), "run", "--out", str(out), "--methods", "gmc", "tic",
               "--delays", "1", "--seeds", "0", "--max-steps", "2", "--checkpoint-every", "1", "--eval-samples", "2",
               "--eval-limit", "12", "--set", "data.batch_prompts=2", "--parallel", "2"]  # fmt: skip
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert {n: r["status"] for n, r in manifest["runs"].items()} == {"gmc-d1-g8-s0": "done", "tic-d1-g8-s0": "done"}
    run_dir = out / "runs" / "gmc-d1-g8-s0"
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == ["step_0.json", "step_1.json", "step_2.json"]
    entry = json.loads((run_dir / "eval" / "step_2.json").read_text())
    assert entry["step"] == 2 and entry["benchmarks"]["heldout"]["problems"] == 12
    scalars = read_scalars(run_dir / "tb")
    assert [s for s, _ in scalars["diag/log_rho/mean"]] == [0, 1] and [s for s, _ in scalars["delay/mean"]] == [0, 1]
    assert len(list((out / "eval_cache").glob("initial-*.json"))) == 1  # step 0 evaluated once for both runs
    stamp = (run_dir / "done.json").stat().st_mtime_ns

    second = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert (
        second.returncode == 0 and "gmc-d1-g8-s0: skipped" in second.stdout and "tic-d1-g8-s0: skipped" in second.stdout
    )
    assert (run_dir / "done.json").stat().st_mtime_ns == stamp

    (run_dir / "done.json").unlink()  # as if killed during evaluation
    (run_dir / "eval" / "step_2.json").unlink()
    third = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0 and "gmc-d1-g8-s0: done" in third.stdout, third.stdout + third.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runs"]["gmc-d1-g8-s0"]["command"].endswith("--ckpt_path last")
    assert json.loads((run_dir / "eval" / "step_2.json").read_text()) == entry  # same weights, same seed
    assert len(manifest["invocations"]) == 3

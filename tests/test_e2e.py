"""Each rule's fit through the real CLI, once: GMC's long enough that reward rises, with checkpoints and every
TensorBoard scalar written; every other rule's a few updates past the queue's fill, with its own scalars logged."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from run_helpers import component, fit, write_config

from lit_gmc.tblog import read_scalars

REPO = Path(__file__).resolve().parents[1]
STEPS = 600
DELAY = 8
EXPECTED_SCALARS = {
    "train/reward", "train/loss", "train/lr", "train/grad_norm", "delay/mean", "delay/max", "correction/eps",
    "diag/log_rho/mean", "diag/log_rho/max", "diag/gmc/rescaled_fraction", "diag/tic/dropped_fraction",
    "diag/removed_mass/mean", "diag/response_length/mean", "diag/entropy/mean", "diag/reward/zero_variance_fraction",
    "diag/ess/mean", "delay/tau_bar_4",
}  # fmt: skip
# One name per quantity: the learner's per-step scalars and the Diagnostics callback's never overlap.
RETIRED = {"diag/reward/mean", "train/entropy", "train/response_length", "train/zero_variance_groups",
           "gmc/rescaled_fraction", "tic/dropped_fraction", "correction/removed_mass", "ratio/log_rho_mean"}


SHORT = 8  # past the delay-2 queue's fill (from step 2 on every delay is 2), with 6 steady updates
# rule -> (its class, the options its fit adds, a scalar of its own); GRPO's clip is given as a user types it
RULE_FITS = {
    "TIC": ("TIC", (), "diag/tic/dropped_fraction"),
    "GRPO": ("GRPO", ("--model.correction.clip", "0.25"), "grpo/clip_fraction"),
    "VCPO": ("VCPO", (), "vcpo/lr_factor"),
    "GAC": ("GAC", (), "gac/cosine"),
    "A3PO": ("A3PO", (), "a3po/over_cap_fraction"),
    "A3PO_capped": ("A3PO", ("--model.correction.behavior_cap", "5"), "a3po/over_cap_fraction"),  # AReaL's cap
    "CISPO": ("CISPO", (), "cispo/truncated_fraction"),
    "TIS": ("TIS", (), "tis/truncated_fraction"),
}


class LrSeen(pl.Callback):
    """The optimizer's learning rate at each step."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("rule", [pytest.param("GMC", marks=pytest.mark.slow), *RULE_FITS])
def test_each_rule_trains_through_the_cli(rule, tmp_path):
    if rule == "GMC":
        fit_gmc_until_reward_rises(tmp_path)
        return
    name, options, own_scalar = RULE_FITS[rule]
    lrs = LrSeen()
    config = write_config(tmp_path, "run", total=SHORT, batch_prompts=4, schedule=component("FixedDelay", delay=2))
    cli = fit(config, "--model.correction", name, *options, "--model.micro_batch_groups", "2", callbacks=[lrs])
    assert cli.trainer.global_step == SHORT and type(cli.model.correction).__name__ == name
    scalars = {tag: dict(points) for tag, points in read_scalars(tmp_path / "run").items()}
    assert sorted(scalars["train/loss"]) == list(range(SHORT))
    assert all(math.isfinite(x) for x in scalars["train/loss"].values())
    assert SHORT - 1 in scalars[own_scalar]
    assert scalars["delay/mean"][SHORT - 1] == 2.0
    if rule == "GRPO":
        assert list(scalars["correction/eps"].values()) == [0.25] * SHORT
    if rule == "A3PO_capped":
        assert cli.model.correction.behavior_cap == 5.0
    if rule == "VCPO":  # the step used the scheduled lr times this step's ESS factor, and only that step
        for step, lr in enumerate(lrs.lrs):
            scheduled = 2e-4 * 0.5 * (1 + math.cos(math.pi * step / SHORT))  # the default AdamW's, cosine to 0
            assert lr == pytest.approx(scheduled * scalars["vcpo/lr_factor"][step], rel=1e-6)
        assert len(lrs.lrs) == SHORT


def fit_gmc_until_reward_rises(tmp_path: Path) -> None:
    """The embedded default (GMC) from a bare folder, as the README runs it: reward rises, every scalar and the
    checkpoint are written."""
    cmd = [sys.executable, "-m", "lit_gmc", "fit", "--data.schedule", "FixedDelay", "--data.schedule.delay",
           str(DELAY), "--trainer.max_steps", str(STEPS)]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ})
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = tmp_path / "runs" / "addition_tiny" / "version_0"
    assert list(run_dir.glob("events.out.tfevents.*")), "no TensorBoard event file"
    scalars = read_scalars(run_dir)
    assert EXPECTED_SCALARS <= set(scalars), EXPECTED_SCALARS - set(scalars)
    assert not RETIRED & set(scalars), RETIRED & set(scalars)
    rewards = [v for _, v in scalars["train/reward"]]
    assert len(rewards) == STEPS
    first = sum(rewards[:20]) / 20
    assert 0.05 <= first <= 0.6, f"the warm-started policy should start with some reward, got {first:.3f}"
    # The README's check, against a bound: the records, and so the figures, differ between CPUs.
    rise = subprocess.run([sys.executable, str(REPO / "scripts" / "reward_rise.py"), str(run_dir), "--min-rise", "0.1"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert rise.returncode == 0, rise.stderr
    assert re.fullmatch(rf"train/reward: {STEPS} steps \| first 20: {first:.3f} \| last 20: \d\.\d{{3}} \| "
                        r"rise \+\d\.\d{3}", rise.stdout.strip()), rise.stdout  # fmt: skip
    delays = [v for _, v in scalars["delay/max"]]
    assert delays == [float(min(step, DELAY)) for step in range(STEPS)]
    ckpt = tmp_path / "runs" / "addition_tiny" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=False)
    assert state["global_step"] == STEPS
    assert any(key.startswith("actor.") for key in state["state_dict"])


def test_reward_rise_exits_1_with_one_line_below_its_bound(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(40):
        writer.add_scalar("train/reward", 0.2 if step < 20 else 0.25, step)
    writer.close()
    script = [sys.executable, str(REPO / "scripts" / "reward_rise.py"), str(tmp_path)]
    done = subprocess.run([*script, "--min-rise", "0.1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stdout.strip() == "train/reward: 40 steps | first 20: 0.200 | last 20: 0.250 | rise +0.050"
    assert done.stderr.strip() == f"{tmp_path}: train/reward rose +0.050, below --min-rise +0.100"
    assert subprocess.run([*script, "--min-rise", "0.04"], capture_output=True, timeout=120).returncode == 0

"""Corollary-1 adaptive cap: the formula, GMC's running moments, its options (GMC only), and a real run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from run_helpers import component, fit, main_stderr, write_config
from test_cli import parse

import lit_gmc.rules
from lit_gmc.errors import UserError
from lit_gmc.objectives import corollary1_eps
from lit_gmc.rules import GMC
from lit_gmc.tblog import read_scalars


def direct(tau4: float, n: int, c: float) -> float:
    """Corollary 1's rate, written with logs rather than powers: c * exp(ln(tau4)/7 - 3 ln(N)/14)."""
    return c * math.exp(math.log(tau4) / 7 - 3 * math.log(n) / 14)


@pytest.mark.parametrize(("tau4", "n", "c"), [(128.0**4, 400, 0.375), (8.0**4, 1000, 0.375), (3.7, 17, 2.0)])
def test_formula_matches_the_rate(tau4, n, c):
    assert corollary1_eps(tau4, n, c, 1e-9, 1e9) == pytest.approx(direct(tau4, n, c), rel=1e-12)


def test_hand_values():
    # tau = 128 everywhere: tau4^(1/7) = 2^(28/7) = 16; N = 2^14: N^(-3/14) = 2^-3.
    assert corollary1_eps(128.0**4, 2**14, 1.0, 1e-9, 1e9) == pytest.approx(2.0, rel=1e-12)
    # the tiny default (delay 8, 1,000 updates) with c = 0.375 lands on the paper's 0.28
    assert corollary1_eps(8.0**4, 1000, 0.375, 0.05, 2.0) == pytest.approx(0.28, abs=5e-4)


def test_scaling_laws_and_clip():
    base = corollary1_eps(50.0, 300, 0.5, 1e-9, 1e9)
    assert corollary1_eps(50.0 * 2**7, 300, 0.5, 1e-9, 1e9) == pytest.approx(2 * base)  # tau4^(1/7)
    assert corollary1_eps(50.0, 300 * 2**14, 0.5, 1e-9, 1e9) == pytest.approx(base / 8)  # N^(-3/14)
    assert corollary1_eps(0.0, 300, 0.5, 0.05, 2.0) == 0.05  # on-policy: the lower clip
    assert corollary1_eps(1e30, 300, 0.5, 0.05, 2.0) == 2.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cap_scale": 0.0}, "cap_scale=0.0 must be finite and > 0"),
        ({"cap_scale": float("inf")}, "cap_scale=inf must be finite and > 0"),
        ({"cap_min": 0.0}, "cap_min=0.0 must be > 0"),
        ({"cap_max": 0.01}, "cap_max=0.01 must be finite and >= cap_min=0.05"),
        ({"cap_max": float("inf")}, "cap_max=inf must be finite"),
    ],
)
def test_bad_schedule_options_are_named(options, message):
    """Checked once, with GMC's options: the formula itself takes checked values."""
    with pytest.raises(ValueError, match=message):
        GMC(cap_schedule="corollary1", **options)


@pytest.mark.parametrize("cap", [float("inf"), float("nan"), 0.0, -0.1])
def test_the_cap_must_be_finite_and_positive(cap):
    """An infinite 1 + eps cap would silently turn GMC and TIC into unclipped IS."""
    for rule in ("GMC", "TIC"):
        with pytest.raises(ValueError, match=f"cap={cap} must be finite and > 0"):
            getattr(lit_gmc.rules, rule)(cap=cap)


def test_validation_collects_every_problem():
    problems = GMC.option_problems(0.28, "adaptive", -1.0, -1.0, -2.0, None)
    assert len(problems) == 4 and [p.split("=")[0] for p in problems[1:]] == ["cap_scale", "cap_min", "cap_max"]
    assert "cap_schedule='adaptive' is not one of constant, corollary1" in problems[0]


def test_running_schedule_uses_the_average_fourth_moment_including_the_current_update():
    rng = np.random.default_rng(0)
    schedule = GMC(cap_schedule="corollary1", cap_scale=0.375, cap_min=0.01, cap_max=10.0)
    history = []
    for _ in range(30):
        delays = torch.as_tensor(rng.integers(0, 40, size=16))  # per-row delays, as under the live schedule
        history.append(float(np.mean(delays.double().numpy() ** 4)))
        schedule.begin_update(delays, 500)
        want = min(max(direct(float(np.mean(history)), 500, 0.375), 0.01), 10.0) if np.mean(history) else 0.01
        assert schedule.threshold == pytest.approx(want, rel=1e-12)
    copy = GMC(cap_schedule="corollary1", cap_scale=0.375, cap_min=0.01, cap_max=10.0)
    copy.load_state_dict(schedule.state_dict())
    nxt = torch.full((16,), 7)
    copy.begin_update(nxt, 500)
    schedule.begin_update(nxt, 500)
    assert copy.threshold == schedule.threshold


def test_constant_cap():
    gmc = GMC(cap=0.28)
    gmc.begin_update(torch.tensor([100]), 10)
    assert gmc.threshold == 0.28 and gmc.state_dict() == {}
    with pytest.raises(ValueError, match="set --trainer.max_steps"):
        GMC(cap_schedule="corollary1").begin_update(torch.tensor([1]), -1)


@pytest.mark.parametrize("rule", ["TIC", "VCPO", "GRPO", "A3PO", "IS"])
def test_corollary1_is_gmc_only_and_the_refusal_names_the_flag_and_the_reason(rule):
    """Corollary 1's rate is derived for GMC's group-mass cap: no other rule has the option, and giving it to one is
    refused in one line naming the flag, the rule and the reason."""
    gmc = parse("--model.correction.cap_schedule", "corollary1").model.correction
    assert gmc.init_args.cap_schedule == "corollary1"
    assert "cap_schedule" not in getattr(lit_gmc.rules, rule).__init__.__code__.co_varnames
    with pytest.raises(UserError) as refused:
        parse("--model.correction", rule, "--model.correction.cap_schedule", "corollary1")
    message = str(refused.value)
    assert f"--model.correction.cap_schedule: {rule} has no option cap_schedule" in message
    assert "the Corollary-1 cap schedule is GMC's alone" in message


def test_cli_rejects_bad_schedule_options(monkeypatch):
    """A closed choice is refused by the parser (its type is a Literal); range errors by the one-message check."""

    def fit_with(*args: str) -> str:
        return main_stderr(monkeypatch, "fit", *args, "--trainer.max_steps", "2")

    choice = fit_with("--model.correction.cap_schedule", "adaptive")
    assert "cap_schedule" in choice and "corollary1" in choice
    ranges = fit_with("--model.correction.cap_schedule", "corollary1", "--model.correction.cap_min", "0",
                      "--model.correction.cap_max", "-1")  # fmt: skip
    assert ranges.count("invalid options") == 1
    assert "--model.correction.cap_min=0.0 must be > 0" in ranges
    assert "--model.correction.cap_max=-1.0" in ranges


def test_a_real_run_logs_the_schedule_and_checkpoints_its_moments(tmp_path):
    """Fixed delay 2 over 5 updates: delays 0, 1, 2, 2, 2. Logged eps equals the formula on the logged delays,
    and a run resumed from the step-2 checkpoint continues with the same thresholds."""
    opts = ["--model.correction.cap_schedule", "corollary1", "--model.correction.cap_scale", "0.375",
            "--model.correction.cap_min", "0.01"]  # fmt: skip
    config = write_config(tmp_path, "whole", total=5, every=2, schedule=component("FixedDelay", delay=2))
    cli = fit(config, *opts)
    # the progress bar's figures (Lightning's bar shows what the module logs with prog_bar=True)
    assert {"reward", "delay", "queue"} <= set(cli.trainer.progress_bar_metrics)
    assert cli.trainer.progress_bar_metrics["delay"] == 2.0
    scalars = read_scalars(tmp_path / "whole")
    delays = [v for _, v in scalars["delay/mean"]]
    assert delays == [0, 1, 2, 2, 2]
    fourth = np.cumsum(np.array(delays) ** 4) / np.arange(1, 6)
    want = [min(max(direct(t, 5, 0.375), 0.01), 2.0) if t else 0.01 for t in fourth]
    assert [v for _, v in scalars["correction/eps"]] == pytest.approx(want, rel=1e-6)

    ckpt = torch.load(tmp_path / "whole" / "checkpoints" / "epoch=0-step=2.ckpt", weights_only=False)
    assert ckpt["correction"]["moments"]["updates"] == 2
    assert ckpt["correction"]["moments"]["sum_p4"] == pytest.approx(1.0)
    resumed = write_config(tmp_path, "resumed", total=5, schedule=component("FixedDelay", delay=2))
    fit(resumed, *opts, "--ckpt_path", str(tmp_path / "whole" / "checkpoints" / "epoch=0-step=2.ckpt"))
    again = dict(read_scalars(tmp_path / "resumed")["correction/eps"])
    assert [again[s] for s in (2, 3, 4)] == pytest.approx(want[2:], rel=1e-6)

"""Corollary-1 adaptive threshold: the formula, its running moments, its options (GMC only), and a real run."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from run_helpers import component, fit, write_config

from lit_gmc.eps_schedules import (
    ConstantEps,
    Corollary1Eps,
    build_eps_schedule,
    corollary1_eps,
    validate_eps_schedule_args,
)
from lit_gmc.module import GMCModule, validate_model_args
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
    ("kwargs", "message"),
    [
        ({"tau4": -1.0}, "tau4 must be >= 0"),
        ({"total_updates": 0}, "total_updates must be >= 1"),
        ({"c": 0.0}, "--model.eps_scale=0.0 must be finite and > 0"),
        ({"c": float("inf")}, "--model.eps_scale=inf must be finite and > 0"),
        ({"eps_min": 0.0}, "--model.eps_min=0.0 must be > 0"),
        ({"eps_max": 0.01}, "--model.eps_max=0.01 must be finite and >= --model.eps_min=0.05"),
        ({"eps_max": float("inf")}, "--model.eps_max=inf must be finite"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    args = {"tau4": 1.0, "total_updates": 10, "c": 1.0, "eps_min": 0.05, "eps_max": 2.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        corollary1_eps(**args)


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), 0.0, -0.1])
def test_the_threshold_must_be_finite_and_positive(eps):
    """An infinite 1 + eps cap would silently turn GMC and TIC into unclipped IS."""
    from lit_gmc.module import validate_model_args

    (problem,) = validate_model_args(**{**MODEL_ARGS, "correction": "gmc", "eps": eps})
    assert f"--model.eps={eps} must be finite and > 0" in problem


def test_validation_collects_every_problem():
    problems = validate_eps_schedule_args(eps_schedule="adaptive", eps_scale=-1.0, eps_min=-1.0, eps_max=-2.0)
    assert len(problems) == 4
    assert "--model.eps_schedule='adaptive' is not one of constant, corollary1" in problems[0]


def test_running_schedule_uses_the_average_fourth_moment_including_the_current_update():
    rng = np.random.default_rng(0)
    schedule = Corollary1Eps(c=0.375, eps_min=0.01, eps_max=10.0)
    history = []
    for _ in range(30):
        delays = torch.as_tensor(rng.integers(0, 40, size=16))  # per-row delays, as under the live schedule
        history.append(float(np.mean(delays.double().numpy() ** 4)))
        got = schedule.next_eps(delays, 500)
        want = min(max(direct(float(np.mean(history)), 500, 0.375), 0.01), 10.0) if np.mean(history) else 0.01
        assert got == pytest.approx(want, rel=1e-12)
    copy = Corollary1Eps(c=0.375, eps_min=0.01, eps_max=10.0)
    copy.load_state_dict(schedule.state_dict())
    nxt = torch.full((16,), 7)
    assert copy.next_eps(nxt, 500) == schedule.next_eps(nxt, 500)


def test_constant_schedule_and_the_registry():
    assert build_eps_schedule("constant", eps=0.28, eps_scale=1.0, eps_min=0.05, eps_max=2.0).next_eps(
        torch.tensor([100]), 10
    ) == 0.28  # fmt: skip
    assert isinstance(build_eps_schedule("constant", eps=0.2, eps_scale=1, eps_min=0.05, eps_max=2.0), ConstantEps)
    with pytest.raises(ValueError, match="unknown eps schedule 'nope'"):
        build_eps_schedule("nope", eps=0.2, eps_scale=1, eps_min=0.05, eps_max=2.0)
    with pytest.raises(ValueError, match="set --trainer.max_steps"):
        Corollary1Eps(1.0, 0.05, 2.0).next_eps(torch.tensor([1]), -1)


MODEL_ARGS = {"eps": None, "aggregation": None, "lr": 1e-4, "warmup_fraction": 0.0, "optimizer": "adamw",
              "max_grad_norm": 1.0, "micro_batch_groups": 1, "logit_chunk_tokens": 8, "dtype": "float32"}  # fmt: skip


def test_corollary1_is_gmc_only_and_the_refusal_names_the_flags_and_the_reason():
    """Corollary 1's rate is derived for GMC's group-mass cap: TIC (a different bias term) and rules whose eps is
    not a cap are refused, each in one line naming both flags."""
    assert validate_model_args(correction="gmc", eps_schedule="corollary1", **MODEL_ARGS) == []
    for rule in ("tic", "vcpo", "grpo", "a3po"):
        assert validate_model_args(correction=rule, eps_schedule="constant", **MODEL_ARGS) == []
        (problem,) = validate_model_args(correction=rule, eps_schedule="corollary1", **MODEL_ARGS)
        assert "--model.eps_schedule=corollary1" in problem and f"--model.correction={rule!r}" in problem
        assert "derived for GMC's group-mass cap" in problem and "--model.correction=gmc" in problem
    (tic,) = validate_model_args(correction="tic", eps_schedule="corollary1", **MODEL_ARGS)
    assert "rho > 1 + eps, a different bias term" in tic
    with pytest.raises(ValueError, match="--model.correction='tic'"):
        GMCModule(correction="tic", eps_schedule="corollary1")  # fails before the actor is built


def test_cli_rejects_bad_schedule_options():
    """A closed choice is refused by the parser (its type is a Literal); range errors by the one-message check."""
    def fit_with(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lit_gmc", "fit", *args, "--trainer.max_steps", "2"],
                              capture_output=True, text=True, timeout=180)  # fmt: skip

    choice = fit_with("--model.eps_schedule", "adaptive")
    assert choice.returncode == 2 and "eps_schedule" in choice.stderr and "corollary1" in choice.stderr
    ranges = fit_with("--model.eps_schedule", "corollary1", "--model.eps_min", "0", "--model.eps_max", "-1")
    assert ranges.returncode == 2 and ranges.stderr.count("invalid options") == 1
    assert "--model.eps_min=0.0 must be > 0" in ranges.stderr and "--model.eps_max=-1.0" in ranges.stderr


def test_a_real_run_logs_the_schedule_and_checkpoints_its_moments(tmp_path):
    """Fixed delay 2 over 5 updates: delays 0, 1, 2, 2, 2. Logged eps equals the formula on the logged delays,
    and a run resumed from the step-2 checkpoint continues with the same thresholds."""
    opts = ["--model.eps_schedule", "corollary1", "--model.eps_scale", "0.375", "--model.eps_min", "0.01"]
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
    assert ckpt["eps_schedule"]["moments"]["updates"] == 2
    assert ckpt["eps_schedule"]["moments"]["sum_p4"] == pytest.approx(1.0)
    resumed = write_config(tmp_path, "resumed", total=5, schedule=component("FixedDelay", delay=2))
    fit(resumed, *opts, "--ckpt_path", str(tmp_path / "whole" / "checkpoints" / "epoch=0-step=2.ckpt"))
    again = dict(read_scalars(tmp_path / "resumed")["correction/eps"])
    assert [again[s] for s in (2, 3, 4)] == pytest.approx(want[2:], rel=1e-6)

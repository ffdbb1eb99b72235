"""lit_gmc.optim: the LR schedule's multiplier at every step, and optimizers named by import path."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from lit_gmc.errors import UserError
from lit_gmc.optim import CosineWithWarmup, build_optimizer, build_scheduler


def old_lr_multiplier(step: int, total: int, warmup: int) -> float:
    """The multiplier lit_gmc used before its schedule came from transformers (``cosine_with_warmup``), written out."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def scheduled_lrs(total: int, warmup_fraction: float, lr: float = 1e-6) -> list[float]:
    """The learning rate each of ``total`` updates uses, stepping the schedule once per update as the module does."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = CosineWithWarmup(optimizer, warmup_fraction=warmup_fraction, total_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return lrs


@pytest.mark.parametrize(
    ("total", "warmup_fraction"), [(800, 0.03), (2000, 0.0), (4, 0.03), (1, 0.0), (37, 0.25), (10, 0.5)]
)
def test_schedule_equals_the_old_formula_at_every_step(total, warmup_fraction):
    """The Qwen3 configs' 800 updates with 3% warm-up, the tiny default's 2,000 without, and edge cases."""
    warmup = int(warmup_fraction * total)
    expected = [1e-6 * old_lr_multiplier(step, total, warmup) for step in range(total)]
    assert scheduled_lrs(total, warmup_fraction) == expected  # bit for bit: the per-step records stay the same


def test_after_warm_up_the_multiplier_is_transformers_own():
    total, warmup = 100, 10
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_cosine_schedule_with_warmup(optimizer, warmup, total).lr_lambdas[0]
    ours = CosineWithWarmup(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 0.1, total)
    assert [ours.lr_lambdas[0](s) for s in range(warmup, total)] == [reference(s) for s in range(warmup, total)]
    assert [ours.lr_lambdas[0](s) for s in range(warmup)] == [reference(s + 1) for s in range(warmup)]
    assert ours.lr_lambdas[0](0) == 0.1 and reference(0) == 0.0  # no update at a learning rate of 0


def test_schedule_state_is_plain():
    """Checkpoints load with ``weights_only=True``: the state holds no function or partial."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    state = CosineWithWarmup(optimizer, 0.1, 50).state_dict()
    assert all(isinstance(v, (int, float, list, dict, bool, type(None))) for v in state.values()), state


@pytest.mark.parametrize(
    ("options", "message"),
    [({"warmup_fraction": 1.0, "total_steps": 10}, "warmup_fraction=1.0 must be in [0, 1)"),
     ({"total_steps": None}, "needs the planned number of updates")],
)  # fmt: skip
def test_schedule_options_are_checked(options, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace(")", r"\)")):
        CosineWithWarmup(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), **options)


def test_an_optimizer_from_a_missing_package_gets_one_message():
    spec = {"class_path": "bitsandbytes_absent.optim.AdamW8bit", "init_args": {"lr": 1e-6}}
    with pytest.raises(UserError, match="--optimizer bitsandbytes_absent.optim.AdamW8bit: cannot import"):
        build_optimizer(spec, [torch.nn.Parameter(torch.zeros(1))])


def test_any_torch_optimizer_by_import_path():
    params = [torch.nn.Parameter(torch.zeros(1))]
    sgd = build_optimizer({"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.9}}, params)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9
    with pytest.raises(UserError, match="is not a torch.optim.optimizer.Optimizer"):
        build_optimizer({"class_path": "torch.nn.Linear"}, params)


def test_a_schedule_that_needs_a_metric_is_refused():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(UserError, match="needs a monitored metric"):
        build_scheduler({"class_path": "torch.optim.lr_scheduler.ReduceLROnPlateau"}, optimizer)

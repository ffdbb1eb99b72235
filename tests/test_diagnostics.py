"""The Diagnostics callback, fed by a real Trainer and a trivial LightningModule.

Nothing of lit_gmc's training stack is used here (no actor, no DataModule, no GMCModule): the module below
returns the documented dict of tensors, which is all the callbacks may read.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lit_gmc.callbacks.diagnostics import (
    CentredRollingMean,
    Diagnostics,
    centred_rolling_mean,
    check_stats,
    merged,
    pearson,
    step_scalars,
    step_tensors,
)
from lit_gmc.tblog import read_scalars

G, B = 4, 3
DRAIN_AT = 30
DRIFT_AT = 20


def fake_stats(step: int) -> dict[str, torch.Tensor]:
    """A step's dict with the documented keys and shapes, seeded by the step (so a resumed run sees the same)."""
    gen = torch.Generator().manual_seed(step)
    n = G * B
    log_rho = torch.randn(n, generator=gen) * 0.5
    grouped = log_rho.view(B, G)
    log_rho_bar = torch.logsumexp(grouped, -1) - math.log(G)
    rewards = (torch.rand(n, generator=gen) < 0.5).float()
    rewards[:G] = 1.0  # one all-tied group
    lengths = torch.randint(1, 7, (n,), generator=gen)
    return {
        "log_rho": log_rho,
        "coefficients": log_rho.exp(),
        "advantages": torch.zeros(n),
        "log_rho_bar": log_rho_bar,
        "removed_mass": torch.rand(B, generator=gen),
        "ess": 1 + 3 * torch.rand(B, generator=gen),
        "rewards": rewards,
        "response_lengths": lengths,
        "delays": torch.randint(0, 5, (B,), generator=gen).repeat_interleave(G),
        "entropy": torch.rand(int(lengths.sum()), generator=gen) * 2,
        # small log-ratios first, past every warning bound from update DRIFT_AT on
        "token_log_ratio": torch.randn(int(lengths.sum()), generator=gen) * (0.05 if step < DRIFT_AT else 1.5),
        "schedule/draining": torch.tensor(float(step >= DRAIN_AT)),
        "schedule/queue_depth": torch.tensor(float(max(0, 40 - step))),
    }


class StatsModule(pl.LightningModule):
    """A linear layer trained on a dummy loss; ``training_step`` returns the loss plus the fake stats."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        stats = fake_stats(self.global_step)
        self.seen[self.global_step] = stats
        return {"loss": self.layer(batch).pow(2).mean(), **stats}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(steps: int) -> DataLoader:
    return DataLoader(torch.randn(steps, 2), batch_size=None)


def trainer(tmp_path: Path, max_steps: int, callbacks: list, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=tmp_path, max_steps=max_steps, max_epochs=1, log_every_n_steps=1, enable_model_summary=False,
        logger=TensorBoardLogger(tmp_path, name="tb", version=0), callbacks=callbacks, accelerator="cpu", **kwargs,
    )  # fmt: skip


# --- pure functions ---------------------------------------------------------------------------------------


def test_step_scalars_match_direct_formulas():
    stats = fake_stats(3)
    got = step_scalars(stats)
    lr = stats["log_rho"].double().numpy()
    lengths = stats["response_lengths"].double().numpy()
    rewards = stats["rewards"].numpy().reshape(B, G)
    bar = stats["log_rho_bar"].double().numpy()
    want = {
        "log_rho/mean": lr.mean(), "log_rho/std": lr.std(), "log_rho/min": lr.min(), "log_rho/max": lr.max(),
        "log_rho/abs_mean": np.abs(lr).mean(),
        "rho_bar/log_mean": bar.mean(), "rho_bar/log_median": np.median(bar), "rho_bar/log_q90": np.quantile(bar, 0.9),
        "rho_bar/log_max": bar.max(),
        "gmc/rescaled_fraction": (bar > math.log1p(0.28)).mean(),
        "tic/dropped_fraction": (lr > math.log1p(0.28)).mean(),
        "removed_mass/mean": stats["removed_mass"].double().mean().item(),
        "removed_mass/max": stats["removed_mass"].max().item(),
        "ess/mean": stats["ess"].double().mean().item(), "ess/min": stats["ess"].min().item(),
        "ess/mean_fraction_of_G": stats["ess"].double().mean().item() / G,
        "response_length/mean": lengths.mean(), "response_length/max": lengths.max(),
        "reward/zero_variance_fraction": np.mean([len(set(row)) == 1 for row in rewards]),
        "entropy/mean": stats["entropy"].double().mean().item(),
        "corr/log_rho_vs_length": np.corrcoef(lr, lengths)[0, 1],
        "corr/delay_vs_length": np.corrcoef(stats["delays"].double().numpy(), lengths)[0, 1],
        "drain/active": 0.0,
    }  # fmt: skip
    t = stats["token_log_ratio"].double().numpy()
    want.update({"divergence/k1": np.mean(-t), "divergence/k3": np.mean(np.exp(t) - 1 - t),
                 "divergence/chi2_token": np.mean(np.exp(t) ** 2) - 1, "divergence/chi2_seq": np.mean(np.exp(lr) ** 2) - 1})
    fresh = stats["delays"].numpy() == 0  # the engine/learner gap, on the rows the current weights generated
    fresh_groups = fresh.reshape(B, G).all(-1)
    want["gap/on_policy_rows"] = fresh.sum()
    if fresh.any():
        want.update({"gap/seq_abs_mean": np.abs(lr[fresh]).mean(), "gap/seq_abs_max": np.abs(lr[fresh]).max()})
    if fresh_groups.any():
        want["gap/gmc_rescaled_group_fraction"] = (bar[fresh_groups] > math.log1p(0.28)).mean()
        dropped = (lr > math.log1p(0.28)).reshape(B, G).any(-1)
        want["gap/tic_dropped_group_fraction"] = dropped[fresh_groups].mean()
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(float(value), rel=1e-6, abs=1e-6), key
    assert got["reward/zero_variance_fraction"] >= 1 / B  # the tied group is counted


def test_step_scalars_only_for_present_keys():
    assert step_scalars({}) == {}
    got = step_scalars({"rewards": torch.tensor([1.0, 0.0]), "entropy": torch.empty(0)})
    assert got == {}  # no G without a group key, no entropy without tokens; the mean reward is the learner's


@pytest.mark.parametrize(("gmc_cap", "tic_cap"), [(0.1, 1.0), (0.28, 0.28), (1.0, 0.1)])
def test_cross_rule_shares_use_the_callbacks_own_thresholds(gmc_cap, tic_cap):
    """The GMC-rescaled share depends on ``gmc_cap`` only, the TIC-dropped share on ``tic_cap`` only."""
    stats = fake_stats(5)
    got = step_scalars(stats, gmc_cap=gmc_cap, tic_cap=tic_cap)
    bar, lr = stats["log_rho_bar"].double().numpy(), stats["log_rho"].double().numpy()
    assert got["gmc/rescaled_fraction"] == pytest.approx((np.exp(bar) > 1 + gmc_cap).mean(), abs=1e-12)
    assert got["tic/dropped_fraction"] == pytest.approx((np.exp(lr) > 1 + tic_cap).mean(), abs=1e-12)
    for name in ("gmc_cap", "tic_cap"):
        with pytest.raises(ValueError, match=name):
            Diagnostics(**{name: float("inf")})
    callback = Diagnostics(gmc_cap=gmc_cap, tic_cap=tic_cap)
    assert (callback.gmc_cap, callback.tic_cap) == (gmc_cap, tic_cap)


def test_step_scalars_propagate_a_non_finite_ratio_as_torch_does():
    stats = fake_stats(2)
    stats["log_rho"] = stats["log_rho"].clone()
    stats["log_rho"][1] = math.nan
    got = step_scalars(stats)
    for key in ("mean", "std", "min", "max", "abs_mean"):
        assert math.isnan(got[f"log_rho/{key}"]), key
    assert "corr/log_rho_vs_length" in got  # the correlation leaves the non-finite pair out
    bar = stats["log_rho_bar"].clone()
    bar[0] = math.nan
    got = step_scalars({**stats, "log_rho_bar": bar})
    assert all(math.isnan(got[f"rho_bar/log_{key}"]) for key in ("mean", "median", "q90", "max"))


def test_step_scalars_copy_to_the_host_once(monkeypatch):
    """Every scalar of an update reaches the host in one ``tolist``: no ``item``, ``float`` or ``bool`` of a tensor."""
    stats = fake_stats(4)
    calls = []
    for name in ("tolist", "item", "__float__", "__bool__", "__int__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)
        counted = lambda self, *args, _original=original, _name=name, **kwargs: (  # noqa: E731
            calls.append(_name) or _original(self, *args, **kwargs)
        )
        monkeypatch.setattr(torch.Tensor, name, counted)
    got = step_scalars(stats)
    monkeypatch.undo()
    assert calls == ["tolist"]
    assert got == step_scalars(stats) and "corr/delay_vs_length" in got and "drain/active" in got


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_step_scalars_on_a_gpu_are_the_cpus():
    stats = fake_stats(6)
    on_gpu = {key: value.cuda() for key, value in stats.items()}
    got, want = step_scalars(on_gpu), step_scalars(stats)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def pearson_or_none(x: torch.Tensor, y: torch.Tensor) -> float | None:
    r, defined = pearson(x, y)
    return float(r) if bool(defined) else None


def test_pearson_matches_numpy_and_is_undefined_where_it_should_be():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, generator=gen), torch.randn(50, generator=gen)
    assert pearson_or_none(x, y) == pytest.approx(np.corrcoef(x.double().numpy(), y.double().numpy())[0, 1], rel=1e-12)
    assert pearson_or_none(torch.full((8,), 3.0), y[:8]) is None  # constant delay (fixed_delay schedule)
    assert pearson_or_none(torch.full((3,), 0.1), torch.tensor([1.0, 2.0, 4.0])) is None  # 0.1 * 3 / 3 != 0.1
    assert pearson_or_none(torch.tensor([1.0]), torch.tensor([2.0])) is None
    assert pearson_or_none(torch.empty(0), torch.empty(0)) is None
    with_inf = torch.cat([x, torch.tensor([math.inf, 1.0])])
    with_nan = torch.cat([y, torch.tensor([0.0, math.nan])])
    assert pearson_or_none(with_inf, with_nan) == pytest.approx(pearson_or_none(x, y), rel=1e-12)
    assert pearson_or_none(torch.tensor([1, 2, 4]), torch.tensor([2, 3, 9])) == pytest.approx(
        np.corrcoef([1, 2, 4], [2, 3, 9])[0, 1], rel=1e-12
    )  # integer tensors (delays, lengths)


def zero_variance_fraction(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``reward/zero_variance_fraction`` of a batch with these rewards (and a group key, which sets ``B``)."""
    groups = max(1, rewards.numel() // group_size)
    out, _ = step_tensors({"rewards": rewards, "ess": torch.ones(groups)})
    return out["reward/zero_variance_fraction"]


def test_zero_variance_fraction_against_a_loop_over_groups():
    """Diagnostics' share of tied groups: a float32 share of groups whose rewards all equal their first exactly."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(400):
        group_size, groups = 1 + trial % 7, 1 + trial % 23
        rewards = torch.randint(0, 1 + trial % 3, (groups * group_size,), generator=gen).double() * 0.7
        if trial % 5 == 0:
            rewards[trial % rewards.numel()] = math.nan  # NaN ties with nothing, itself included
        rows = rewards.tolist()
        tied = sum(all(r == rows[b * group_size] for r in rows[b * group_size : (b + 1) * group_size])
                   for b in range(groups))  # fmt: skip
        for dtype in (torch.float32, torch.float64):
            got = zero_variance_fraction(rewards.to(dtype), group_size)
            assert got.dtype == torch.float32 and float(got) == pytest.approx(tied / groups, rel=1e-7)
    assert math.isnan(float(zero_variance_fraction(torch.empty(0), 4)))
    assert float(zero_variance_fraction(torch.tensor([math.nan] * 4 + [0.5] * 4), 4)) == 0.5


def test_zero_variance_fraction_by_hand():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    assert float(zero_variance_fraction(rewards, 2)) == 0.75
    assert float(zero_variance_fraction(rewards, 4)) == 0.0


@pytest.mark.parametrize(
    ("stats", "message"),
    [
        ({"log_rho": torch.zeros(8), "rewards": torch.zeros(6)}, "rows keys disagree"),
        ({"log_rho": torch.zeros(2, 4)}, "'log_rho' must be a 1-D tensor"),
        ({"ess": [1.0, 2.0]}, "'ess' must be a 1-D tensor"),
        ({"log_rho": torch.zeros(8), "ess": torch.zeros(3)}, "not a multiple of groups"),
        ({"entropy": torch.zeros(2, 2)}, "'entropy' must be a 1-D tensor"),
        ({"schedule/draining": torch.zeros(1)}, "'schedule/draining' must be a 0-D tensor"),
    ],
)
def test_check_stats_names_the_bad_key(stats, message):
    with pytest.raises(ValueError, match=message):
        check_stats(stats)


def direct_centred_mean(values: list[float], window: int) -> list[float]:
    """Written out from the definition: mean over indices i - w//2 .. i + (w - 1 - w//2), cut at the ends."""
    out = []
    for i in range(len(values)):
        idx = [j for j in range(i - window // 2, i + window - window // 2) if 0 <= j < len(values)]
        out.append(float(np.mean([values[j] for j in idx])))
    return out


@pytest.mark.parametrize("window", [1, 2, 4, 25])
@pytest.mark.parametrize("length", [0, 1, 5, 12, 13, 30, 60])
def test_centred_rolling_mean_online_equals_offline_and_definition(window, length):
    values = [float(v) for v in np.random.default_rng(window * 100 + length).normal(size=length)]
    offline = centred_rolling_mean(values, window)
    assert offline == pytest.approx(direct_centred_mean(values, window))
    pd = pytest.importorskip("pandas")
    if length:
        ref = pd.Series(values).rolling(window, center=True, min_periods=1).mean().tolist()
        assert offline == pytest.approx(ref)
    online = CentredRollingMean(window)
    emitted = []
    for step, v in enumerate(values):
        emitted += online.push(100 + step, v)
        assert len(emitted) == max(0, step + 1 - (window - 1 - window // 2))  # delayed by the window's right half
    emitted += online.flush()
    assert [s for s, _ in emitted] == [100 + i for i in range(length)]
    assert [m for _, m in emitted] == pytest.approx(offline)


def test_rolling_state_round_trip():
    values = [float(i * i % 7) for i in range(40)]
    whole = CentredRollingMean(25)
    out_whole = [m for v in values for _, m in whole.push(0, v)] + [m for _, m in whole.flush()]
    first = CentredRollingMean(25)
    out = [m for v in values[:17] for _, m in first.push(0, v)]
    second = CentredRollingMean(25)
    second.load_state_dict(first.state_dict())
    out += [m for v in values[17:] for _, m in second.push(0, v)] + [m for _, m in second.flush()]
    assert out == out_whole


# --- the callback in a real Trainer ------------------------------------------------------------------------


def histogram_tags(logdir: Path) -> set[str]:
    tags = set()
    for path in logdir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(path), size_guidance={"histograms": 0})
        acc.Reload()
        tags |= set(acc.Tags()["histograms"])
    return tags


def test_callback_logs_every_diagnostic_at_the_right_step(tmp_path):
    module = StatsModule()
    trainer(tmp_path, 40, [Diagnostics(histogram_every_n_steps=5)]).fit(module, loader(40))
    scalars = read_scalars(tmp_path / "tb")
    for step in (0, 17, 39):
        want = step_scalars(module.seen[step])
        for key, value in want.items():
            assert dict(scalars[f"diag/{key}"])[step] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, step)
    assert [s for s, _ in scalars["diag/log_rho/mean"]] == list(range(40))
    assert scalars["diag/drain/step"] == [(DRAIN_AT, float(DRAIN_AT))]  # one point, at the first draining update
    entropy = [step_scalars(module.seen[s])["entropy/mean"] for s in range(40)]
    rolling = scalars["diag/entropy/centred_rolling_mean"]
    assert [s for s, _ in rolling] == list(range(40))
    assert [v for _, v in rolling] == pytest.approx(centred_rolling_mean(entropy, 25), rel=1e-5)
    assert {f"diag/{t}" for t in ("log_rho", "log_rho_bar", "ess", "removed_mass", "response_length", "entropy")} <= (
        histogram_tags(tmp_path / "tb")
    )


def test_callback_warns_once_per_kind_when_the_policies_drift_apart(tmp_path, recwarn):
    module = StatsModule()
    trainer(tmp_path, 40, [Diagnostics(warn_ess_fraction=0.2)]).fit(module, loader(40))
    messages = [str(w.message) for w in recwarn if str(w.message).startswith("Diagnostics: at update")]
    assert len(messages) == 2, messages  # k3 and chi^2, each once, though every update from DRIFT_AT on is past them
    assert f"at update {DRIFT_AT} diag/divergence/k3" in messages[0] and "warn_kl" in messages[0]
    assert f"at update {DRIFT_AT} diag/divergence/chi2_token" in messages[1] and "warn_chi2" in messages[1]
    ess = [step_scalars(module.seen[s])["ess/mean_fraction_of_G"] for s in range(40)]
    assert min(ess) >= 0.2  # the ESS bound was never crossed, so it never warned
    recwarn.clear()
    trainer(tmp_path / "strict", 3, [Diagnostics(warn_ess_fraction=0.999)]).fit(StatsModule(), loader(3))
    assert [str(w.message) for w in recwarn if "ess/mean_fraction_of_G" in str(w.message)] != []


class AccumulatingModule(StatsModule):
    """Two batches an update (``accumulate_grad_batches=2``): each batch returns its own half of the rows."""

    def training_step(self, batch, batch_idx):
        stats = fake_stats(100 + batch_idx)
        self.seen[batch_idx] = stats
        return {"loss": self.layer(batch).pow(2).mean(), **stats}


def test_under_gradient_accumulation_each_update_is_logged_once_at_its_global_step(tmp_path):
    module = AccumulatingModule()
    trainer(tmp_path, 6, [Diagnostics(histogram_every_n_steps=1)], accumulate_grad_batches=2).fit(module, loader(12))
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["diag/log_rho/mean"]] == list(range(6))
    for step in range(6):
        both = merged([module.seen[2 * step], module.seen[2 * step + 1]])  # the update's rows, group-major
        assert torch.equal(
            both["log_rho"], torch.cat([module.seen[2 * step]["log_rho"], module.seen[2 * step + 1]["log_rho"]])
        )
        for key, value in step_scalars(both).items():
            assert dict(scalars[f"diag/{key}"])[step] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, step)
    assert step_scalars(both)["ess/mean_fraction_of_G"] == pytest.approx(float(both["ess"].double().mean()) / G)


def test_callback_state_survives_resume(tmp_path):
    """Stopped at 20 and resumed from the checkpoint with a fresh callback: the same series as one run of 40."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=20, save_top_k=-1)
    trainer(tmp_path, 20, [Diagnostics(), checkpoints]).fit(StatsModule(), loader(40))
    fresh = Diagnostics()
    trainer(tmp_path, 40, [fresh]).fit(
        StatsModule(), loader(40), ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=20.ckpt")
    )
    assert fresh.drain_step == DRAIN_AT
    scalars = read_scalars(tmp_path / "tb")
    entropy = [step_scalars(fake_stats(s))["entropy/mean"] for s in range(40)]
    rolling = scalars["diag/entropy/centred_rolling_mean"]
    assert [s for s, _ in rolling] == list(range(40))
    assert [v for _, v in rolling] == pytest.approx(centred_rolling_mean(entropy, 25), rel=1e-5)


def test_callback_rejects_a_step_without_the_dict(tmp_path):
    class LossOnly(StatsModule):
        def training_step(self, batch, batch_idx):
            return self.layer(batch).pow(2).mean()

    with pytest.raises(TypeError, match="training_step to return a dict"):
        trainer(tmp_path, 2, [Diagnostics()]).fit(LossOnly(), loader(2))


"""``DelayAccounting``: per-update delay histogram, running tau_bar_2 / tau_bar_4 (eq. 11), virtual-clock prediction.

The callback is meant for any Lightning project, so it is tested with a real Trainer on a one-parameter module
whose batches carry prescribed delays; every logged value is checked against eq. 11 written out directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lit_gmc.callbacks.delays import DelayAccounting
from lit_gmc.tblog import read_scalars

DELAYS = [[0, 0], [1, 1], [2, 0], [3, 5], [4, 4], [7, 1], [2, 2], [9, 0]]  # per update, two trajectories each
LENGTHS = [[3, 5], [4, 4], [2, 6], [1, 1], [8, 2], [3, 3], [5, 5], [4, 2]]


@dataclass
class DelayBatch:
    delays: torch.Tensor
    lengths: torch.Tensor
    info: dict = field(default_factory=dict)


class DelayModule(pl.LightningModule):
    """Fits one scalar; returns the batch's delays and lengths as the GMC learner does."""

    def __init__(self, with_delays: bool = True) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.with_delays = with_delays

    def training_step(self, batch: DelayBatch, batch_idx: int):
        loss = ((self.w - 1.0) ** 2).sum()
        if not self.with_delays:
            return {"loss": loss}
        return {"loss": loss, "delays": batch.delays, "response_lengths": batch.lengths}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(per_length: float | None, steps: range = range(len(DELAYS))):
    info = {} if per_length is None else {"delay_per_length": per_length}
    batches = [DelayBatch(torch.tensor(DELAYS[k]), torch.tensor(LENGTHS[k]), dict(info)) for k in steps]
    return torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


def trainer(tmp_path, callbacks, max_steps=None, name="run", **kwargs) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps or len(DELAYS), logger=TensorBoardLogger(tmp_path, name=name), callbacks=callbacks,
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", **kwargs,
    )  # fmt: skip


def direct_moments(upto: int) -> tuple[float, float, float]:
    """eq. 11 written out: (1/n) sum_{k<n} of the update's mean tau^p, for p = 1, 2, 4."""
    n = upto + 1
    per_update = [[float(t) for t in DELAYS[k]] for k in range(n)]
    return tuple(sum(sum(t**p for t in d) / len(d) for d in per_update) / n for p in (1, 2, 4))


def test_logs_eq_11_moments_and_the_virtual_clock_prediction(tmp_path):
    trainer(tmp_path, [DelayAccounting()], enable_checkpointing=False).fit(DelayModule(), loader(per_length=0.5))
    scalars = {tag: dict(points) for tag, points in read_scalars(tmp_path / "run").items()}
    for step in range(len(DELAYS)):
        mean, tau2, tau4 = direct_moments(step)
        assert scalars["delay/running_mean"][step] == pytest.approx(mean, rel=1e-6)
        assert scalars["delay/tau_bar_2"][step] == pytest.approx(tau2, rel=1e-6)
        assert scalars["delay/tau_bar_4"][step] == pytest.approx(tau4, rel=1e-6)
        lengths = [x for k in range(step + 1) for x in LENGTHS[k]]
        assert scalars["delay/predicted_mean"][step] == pytest.approx(0.5 * sum(lengths) / len(lengths), rel=1e-6)


def test_histogram_every_n_steps_and_no_prediction_without_a_clock(tmp_path):
    trainer(tmp_path, [DelayAccounting(histogram_every_n_steps=3)], enable_checkpointing=False).fit(
        DelayModule(), loader(per_length=None)
    )
    assert "delay/predicted_mean" not in read_scalars(tmp_path / "run")
    (events,) = (tmp_path / "run").rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"histograms": 0})
    acc.Reload()
    histograms = acc.Histograms("delay/histogram")
    assert [h.step for h in histograms] == [0, 3, 6]
    assert [h.histogram_value.num for h in histograms] == [2.0, 2.0, 2.0]
    assert histograms[1].histogram_value.sum == pytest.approx(sum(DELAYS[3]))


def test_state_survives_a_checkpoint_resume(tmp_path):
    unbroken = DelayAccounting()
    trainer(tmp_path, [unbroken], enable_checkpointing=False, name="unbroken").fit(DelayModule(), loader(0.5))

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    trainer(tmp_path, [DelayAccounting(), checkpoint], max_steps=5, name="first").fit(DelayModule(), loader(0.5))
    resumed = DelayAccounting()
    trainer(tmp_path, [resumed], enable_checkpointing=False, name="second").fit(
        DelayModule(), loader(0.5, range(5, len(DELAYS))), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=5.ckpt"
    )
    assert resumed.moments.state_dict() == pytest.approx(unbroken.moments.state_dict())
    assert (resumed.length_sum, resumed.length_count) == (unbroken.length_sum, unbroken.length_count)
    assert resumed.moments.tau1 == pytest.approx(unbroken.moments.tau1)


def test_missing_delays_is_a_clear_error(tmp_path):
    with pytest.raises(KeyError, match="DelayAccounting needs training_step to return a dict with 'delays'"):
        trainer(tmp_path, [DelayAccounting()], enable_checkpointing=False).fit(
            DelayModule(with_delays=False), loader(None)
        )


def test_bad_period_is_named():
    with pytest.raises(ValueError, match="histogram_every_n_steps must be >= 1"):
        DelayAccounting(histogram_every_n_steps=0)


def test_moments_are_the_float64_torch_means_bit_for_bit_where_those_are_exact():
    from lit_gmc.delays import RunningDelayMoments

    generator = torch.Generator().manual_seed(0)
    for rows, largest in [(1, 0), (2, 1), (64, 8), (64, 1000), (512, 128), (8192, 1000)]:
        delays = torch.randint(0, largest + 1, (rows,), generator=generator)
        moments = RunningDelayMoments()
        moments.update(delays.view(-1, 1) if rows % 2 else delays.view(2, -1))  # any shape
        as_double = delays.double()
        expected = [float(as_double.mean()), float((as_double**2).mean()), float((as_double**4).mean())]
        assert [moments.tau1, moments.tau2, moments.tau4] == expected
    # Past 2**53 the sum is correctly rounded: eq. 11 in exact rational arithmetic, rounded once (64 rows: the
    # division by 64 is exact).
    from fractions import Fraction

    huge = torch.tensor([9_000, 8_999, 1, 0] * 16)
    moments = RunningDelayMoments()
    moments.update(huge)
    exact = Fraction(sum(int(d) ** 4 for d in huge.tolist()), huge.numel())
    assert sum(int(d) ** 4 for d in huge.tolist()) > 2**53 and moments.tau4 == float(exact)
    with pytest.raises(ValueError, match="at least one delay"):
        moments.update(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="must be >= 0"):
        moments.update(torch.tensor([3.0, float("nan"), -1.0]))


def test_gradient_accumulation_logs_once_per_optimizer_step_with_the_updates_pooled_delays(tmp_path):
    # 8 batches, 2 per optimizer step: 4 updates, logged at global steps 0..3 (as the user expected,
    # instead of one record per batch at -1, 0, 0, 1, 1, ...). Update k trains on batches 2k and 2k+1, so its
    # delays are both batches' trajectories together.
    accounting = DelayAccounting(histogram_every_n_steps=2)
    trainer(tmp_path, [accounting], max_steps=4, accumulate_grad_batches=2, enable_checkpointing=False).fit(
        DelayModule(), loader(per_length=0.5)
    )
    scalars = read_scalars(tmp_path / "run")
    pooled = [[float(t) for t in DELAYS[2 * k] + DELAYS[2 * k + 1]] for k in range(4)]
    for tag in ("delay/running_mean", "delay/tau_bar_2", "delay/tau_bar_4", "delay/predicted_mean"):
        assert [step for step, _ in scalars[tag]] == [0, 1, 2, 3], tag
    for n in range(4):
        for tag, p in (("delay/running_mean", 1), ("delay/tau_bar_2", 2), ("delay/tau_bar_4", 4)):
            expected = sum(sum(t**p for t in d) / len(d) for d in pooled[: n + 1]) / (n + 1)
            assert dict(scalars[tag])[n] == pytest.approx(expected, rel=1e-6), (tag, n)
        lengths = [x for k in range(2 * n + 2) for x in LENGTHS[k]]
        assert dict(scalars["delay/predicted_mean"])[n] == pytest.approx(0.5 * sum(lengths) / len(lengths), rel=1e-6)
    assert accounting.moments.updates == 4 and accounting.pending == []
    (events,) = (tmp_path / "run").rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"histograms": 0})
    acc.Reload()
    histograms = acc.Histograms("delay/histogram")
    assert [(h.step, h.histogram_value.num) for h in histograms] == [(0, 4.0), (2, 4.0)]
    assert histograms[1].histogram_value.sum == pytest.approx(sum(pooled[2]))


def test_lengths_are_required_with_a_clock_prediction(tmp_path):
    class NoLengths(DelayModule):
        def training_step(self, batch, batch_idx):
            return {"loss": ((self.w - 1.0) ** 2).sum(), "delays": batch.delays}

    with pytest.raises(KeyError, match="DelayAccounting needs training_step to return 'response_lengths'"):
        trainer(tmp_path, [DelayAccounting()], enable_checkpointing=False).fit(NoLengths(), loader(0.5))

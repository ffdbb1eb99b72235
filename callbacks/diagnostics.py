"""Per-update diagnostics of off-policy group RL, logged from what ``training_step`` already computed.

The callback runs no forward pass and knows no model: it reads the dict of detached tensors that
``training_step`` returns (Lightning hands it to ``on_train_batch_end`` as ``outputs``), so any project
whose training step returns the keys below can use it. Rows are group-major (row ``b * G + i`` is
response ``i`` of group ``b``); ``N = B * G`` rows, ``B`` groups, and ``G`` is inferred as ``N / B``.

Keys read (every key is optional; a diagnostic is logged when its inputs are present):

=========================  ============  ==========================================================
key                        shape         meaning
=========================  ============  ==========================================================
``log_rho``                ``(N,)``      trajectory log-ratio ``log pi_theta(y) - log pi_behaviour(y)``
``log_rho_bar``            ``(B,)``      group log mean ratio ``logsumexp_i log rho_i - log G``
``removed_mass``           ``(B,)``      ``(1/G) sum_i (rho_i - c_i)``, importance mass the rule removed
``ess``                    ``(B,)``      group effective sample size ``(sum rho)^2 / sum rho^2``
``rewards``                ``(N,)``      rewards
``response_lengths``       ``(N,)``      real response tokens per row
``delays``                 ``(N,)``      delay ``tau = n - s`` of each row
``entropy``                ``(tokens,)`` current policy's entropy at every real response token
``schedule/draining``      ``()``        1 once the delay queue drains (no new generation)
=========================  ============  ==========================================================

The cross-rule diagnostics (the share of groups GMC would rescale, ``rho_bar > 1 + cap_eps``, and of trajectories
TIC would drop, ``rho > 1 + cap_eps``) use the callback's own fixed ``cap_eps``, whatever rule trains, so runs of
different rules are compared at one threshold. The training reward itself is the learner's ``train/reward``.

Scalars go to every logger's ``log_metrics`` under ``{prefix}/...``, at the step Lightning logs the batch
at. (Not through ``pl_module.log``: Lightning re-logs a value at later steps until it is logged again, which
would repeat an undefined correlation or the one-off drain marker.) Histograms and the centred rolling mean
of the entropy are written to the TensorBoard logger only. The centred mean of update ``n`` needs the
entropies up to ``n + window // 2``, so it is written that many updates late (at step ``n``), and the last
ones when training ends.
Delay moments and delay histograms are not logged here (the delay accounting callback owns them).
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

ROW_KEYS = ("log_rho", "rewards", "response_lengths", "delays")
GROUP_KEYS = ("log_rho_bar", "removed_mass", "ess")
HISTOGRAMS = {"log_rho": "log_rho", "log_rho_bar": "log_rho_bar", "ess": "ess", "removed_mass": "removed_mass",
              "response_lengths": "response_length", "entropy": "entropy"}  # fmt: skip


def check_stats(stats: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """Check the shapes of the known keys; returns ``(N, B)`` (None where no key of that kind is present).

    Raises:
        ValueError: naming the key, when a known key is not a tensor of the documented shape, when row keys
            (or group keys) disagree in length, or when ``N`` is not a multiple of ``B``.
    """
    sizes: dict[str, dict[str, int]] = {"rows": {}, "groups": {}}
    for kind, keys in (("rows", ROW_KEYS), ("groups", GROUP_KEYS)):
        for key in keys:
            if key not in stats:
                continue
            value = stats[key]
            if not isinstance(value, Tensor) or value.dim() != 1:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"diagnostics key {key!r} must be a 1-D tensor ({kind}), got {shape}")
            sizes[kind][key] = value.numel()
        if len(set(sizes[kind].values())) > 1:
            raise ValueError(f"diagnostics {kind} keys disagree in length: {sizes[kind]}")
    for key in ("entropy", "schedule/draining"):
        want = 1 if key == "entropy" else 0
        if key in stats and (not isinstance(stats[key], Tensor) or stats[key].dim() != want):
            raise ValueError(f"diagnostics key {key!r} must be a {want}-D tensor, got {stats[key]!r:.80}")
    rows = next(iter(sizes["rows"].values()), None)
    groups = next(iter(sizes["groups"].values()), None)
    if rows is not None and groups is not None and (groups == 0 or rows % groups):
        raise ValueError(f"diagnostics rows ({rows}, from {list(sizes['rows'])}) are not a multiple of groups "
                         f"({groups}, from {list(sizes['groups'])})")  # fmt: skip
    return rows, groups


def pearson(x: Tensor, y: Tensor) -> float | None:
    """Pearson correlation of two ``(N,)`` tensors over the pairs where both are finite.

    Returns None when fewer than two pairs remain or either side is constant (the correlation is undefined,
    e.g. the delay under a fixed-delay schedule).
    """
    return correlations([x], y)[0]


def correlations(xs: Sequence[Tensor | list[float]], y: Tensor | list[float]) -> list[float | None]:
    """:func:`pearson` of each of ``xs`` with one ``y`` (tensors, or their values as lists), computed on floats."""
    y_values = as_values(y)
    y_finite = all(map(math.isfinite, y_values))
    y_whole: tuple[list[float], float] | None = None  # y's deviations and their sum of squares over every pair
    out: list[float | None] = []
    for x in xs:
        xk, yk = as_values(x), y_values
        if len(xk) != len(yk):
            raise ValueError(f"correlations: {len(xk)} values against {len(yk)}")
        if not (y_finite and all(map(math.isfinite, xk))):
            kept = [(a, b) for a, b in zip(xk, yk, strict=True) if math.isfinite(a) and math.isfinite(b)]
            xk, yk = [a for a, _ in kept], [b for _, b in kept]
        if len(xk) < 2:
            out.append(None)
            continue
        dx, sxx = deviations(xk)
        if sxx == 0:  # x is constant: undefined whatever y is
            out.append(None)
            continue
        if yk is not y_values:
            dy, syy = deviations(yk)
        else:  # every pair kept: y's side is the same for each x
            y_whole = y_whole or deviations(y_values)
            dy, syy = y_whole
        sxy = math.fsum([a * b for a, b in zip(dx, dy, strict=True)])
        denominator = math.sqrt(sxx * syy)
        out.append(sxy / denominator if denominator > 0 else None)
    return out


def deviations(values: Sequence[float]) -> tuple[list[float], float]:
    """Each value less their mean (:func:`exact_mean`), and the correctly rounded sum of their squares."""
    mean = exact_mean(values)
    centred = [v - mean for v in values]
    return centred, math.fsum([d * d for d in centred])


def as_values(values: Tensor | list[float]) -> list[float]:
    """A tensor's values as Python numbers, exactly (flattened); a list is returned as it is."""
    return values.detach().flatten().tolist() if isinstance(values, Tensor) else values


def exact_mean(values: Sequence[float]) -> float:
    """Mean of a non-empty sequence of floats, its sum correctly rounded (``math.fsum``); IEEE results otherwise.

    A sum that holds both infinities is NaN and one that overflows is infinite, as a float64 torch reduction gives.
    """
    try:
        return math.fsum(values) / len(values)
    except ValueError:  # inf + -inf
        return math.nan
    except OverflowError:  # finite values past the float64 range
        return sum(values) / len(values)


def extremes(values: Sequence[float]) -> tuple[float, float]:
    """``(min, max)`` of a non-empty sequence, both NaN when one value is (Python's ``min`` would depend on order)."""
    if any(map(math.isnan, values)):
        return math.nan, math.nan
    return float(min(values)), float(max(values))


def linear_quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated linearly between neighbours; ``torch.quantile``'s value.

    Between neighbours ``a <= b`` at weight ``w``: ``a + w (b - a)`` for ``w < 1/2``, else ``b + (w - 1)(b - a)``,
    each as one fused multiply-add (torch's ``lerp``), here exactly rounded through ``Fraction``.
    """
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    weight, a, b = position - low, ordered[low], ordered[high]
    if not all(map(math.isfinite, (a, b))):
        return a + weight * (b - a) if weight < 0.5 else b + (weight - 1) * (b - a)  # inf or NaN, as torch
    start, coefficient = (a, weight) if weight < 0.5 else (b, weight - 1)
    return float(Fraction(coefficient) * Fraction(b - a) + Fraction(start))


def tied_fraction(rewards: Sequence[float], group_size: int) -> float:
    """:func:`lit_gmc.objectives.zero_variance_fraction` of the rewards' values, the same float.

    The share of groups whose rewards all equal their first exactly (NaN never ties), rounded to float32 as
    that function's float32 mean rounds it (a ratio of integers below 2**24 rounds to the same float32 from its
    float64 value as from the exact quotient).
    """
    starts = range(0, len(rewards), group_size)
    if not starts:
        return math.nan  # the mean over no groups
    # list.count counts an object as equal to itself, NaN included: hence the separate test of the first reward.
    groups = (rewards[s : s + group_size] for s in starts)
    tied = sum(g[0] == g[0] and g.count(g[0]) == len(g) for g in groups)
    return array("f", [tied / len(starts)])[0]


def centred_window(index: int, count: int, window: int) -> tuple[int, int]:
    """``[start, stop)`` of the centred window of width ``window`` around ``index`` in a series of ``count``.

    It spans ``window // 2`` values before and ``window - 1 - window // 2`` after, cut at the series' ends (as
    pandas' ``rolling(window, center=True, min_periods=1)``).
    """
    before = window // 2
    return max(0, index - before), min(count, index + window - before)


def centred_rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Centred rolling mean of a whole series (the offline form of :class:`CentredRollingMean`)."""
    out = []
    for i in range(len(values)):
        start, stop = centred_window(i, len(values), window)
        out.append(sum(values[start:stop]) / (stop - start))
    return out


class CentredRollingMean:
    """Online centred rolling mean, exactly :func:`centred_rolling_mean` of the pushed series.

    Push ``(step, value)`` in order; a centre's mean is emitted once its window is complete, the last ones on
    :meth:`flush`. The state (the last ``window`` values and two counters) is checkpointable.
    """

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.after = window - 1 - window // 2
        self.buffer: deque[tuple[int, float]] = deque(maxlen=window)
        self.count = 0
        self.emitted = 0

    def push(self, step: int, value: float) -> list[tuple[int, float]]:
        """Add the next value; returns the ``(step, mean)`` of every centre whose window it completes."""
        self.buffer.append((step, value))
        self.count += 1
        return self._emit(last=self.count - 1 - self.after)

    def flush(self) -> list[tuple[int, float]]:
        """``(step, mean)`` of the centres still pending, over windows cut at the end of the series."""
        return self._emit(last=self.count - 1)

    def _emit(self, last: int) -> list[tuple[int, float]]:
        out = []
        first = self.count - len(self.buffer)  # series index of buffer[0]
        while self.emitted <= last:
            start, stop = centred_window(self.emitted, self.count, self.window)
            values = [v for k, (_, v) in enumerate(self.buffer) if start <= first + k < stop]
            out.append((self.buffer[self.emitted - first][0], sum(values) / len(values)))
            self.emitted += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The buffered values and counters."""
        return {"buffer": list(self.buffer), "count": self.count, "emitted": self.emitted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.buffer = deque(((int(s), float(v)) for s, v in state["buffer"]), maxlen=self.window)
        self.count, self.emitted = state["count"], state["emitted"]


def step_scalars(stats: Mapping[str, Tensor], cap_eps: float = 0.28) -> dict[str, float]:
    """Every per-update scalar the stats support (tags without the prefix); ``cap_eps``: the GMC/TIC threshold.

    Computed on Python floats, each input converted once: the tensors hold a few dozen values, where a torch
    reduction costs ~8 us of dispatch for nanoseconds of arithmetic (~0.7 ms an update, one by one). Sums are
    correctly rounded (``math.fsum``), so a mean does not depend on the order a reduction happens to add in.
    """
    rows, groups = check_stats(stats)
    # Python numbers, exactly the tensors' values (int for integer tensors; fsum and the comparisons take either).
    values = {key: stats[key].tolist() for key in (*ROW_KEYS, *GROUP_KEYS, "entropy") if key in stats}
    out: dict[str, float] = {}
    cap = math.log1p(cap_eps)
    if values.get("log_rho"):
        lr = values["log_rho"]  # (N,)
        mean = exact_mean(lr)
        low, high = extremes(lr)
        std = math.sqrt(exact_mean([(x - mean) ** 2 for x in lr]))  # the population std, as the paper's spread
        out.update({"log_rho/mean": mean, "log_rho/std": std, "log_rho/min": low, "log_rho/max": high,
                    "log_rho/abs_mean": exact_mean(list(map(abs, lr)))})  # fmt: skip
    if values.get("log_rho_bar"):
        lb = values["log_rho_bar"]  # (B,)
        ordered = [math.nan] * len(lb) if any(map(math.isnan, lb)) else sorted(lb)  # NaN, as torch.quantile
        out.update({"rho_bar/log_mean": exact_mean(lb), "rho_bar/log_median": linear_quantile(ordered, 0.5),
                    "rho_bar/log_q90": linear_quantile(ordered, 0.9), "rho_bar/log_max": extremes(lb)[1]})  # fmt: skip
    for key, tag in (("log_rho_bar", "gmc/rescaled_fraction"), ("log_rho", "tic/dropped_fraction")):
        if values.get(key):
            out[tag] = sum(x > cap for x in values[key]) / len(values[key])
    if values.get("removed_mass"):
        mass = values["removed_mass"]  # (B,)
        out.update({"removed_mass/mean": exact_mean(mass), "removed_mass/max": extremes(mass)[1]})
    if values.get("ess"):
        ess = values["ess"]  # (B,)
        out.update({"ess/mean": exact_mean(ess), "ess/min": extremes(ess)[0]})
        if rows is not None:
            out["ess/mean_fraction_of_G"] = out["ess/mean"] / (rows // groups)
    if values.get("response_lengths"):
        lengths = values["response_lengths"]  # (N,)
        out.update({"response_length/mean": exact_mean(lengths), "response_length/max": extremes(lengths)[1]})
    if "rewards" in stats and groups is not None:
        out["reward/zero_variance_fraction"] = tied_fraction(values["rewards"], rows // groups)
    if values.get("entropy"):
        out["entropy/mean"] = exact_mean(values["entropy"])
    if "response_lengths" in stats:
        pairs = [(key, tag) for key, tag in (("log_rho", "corr/log_rho_vs_length"), ("delays", "corr/delay_vs_length"))
                 if key in stats]  # fmt: skip
        found = correlations([values[key] for key, _ in pairs], values["response_lengths"])
        out.update({tag: r for (_, tag), r in zip(pairs, found, strict=True) if r is not None})
    if "schedule/draining" in stats:
        out["drain/active"] = float(stats["schedule/draining"])
    return out


class Diagnostics(pl.Callback):
    """Logs the diagnostics of every update from ``training_step``'s returned dict (see the module docstring).

    Args:
        entropy_window: Width of the centred rolling mean of the entropy (the paper's Figure 4 uses 25).
        histogram_every_n_steps: Period of the histograms (each costs a binning pass; scalars are every step).
        prefix: Tag prefix.
        cap_eps: Threshold of the cross-rule diagnostics: the share of groups with ``rho_bar > 1 + cap_eps`` (GMC
            would rescale them) and of trajectories with ``rho > 1 + cap_eps`` (TIC would drop them). Fixed, not
            the active rule's eps (which is a PPO clip for GRPO, a truncation for VCPO, ...); the paper's 0.28.
    """

    def __init__(
        self, entropy_window: int = 25, histogram_every_n_steps: int = 10, prefix: str = "diag", cap_eps: float = 0.28
    ) -> None:
        if histogram_every_n_steps < 1:
            raise ValueError(f"histogram_every_n_steps must be >= 1, got {histogram_every_n_steps}")
        if not (cap_eps > 0 and math.isfinite(cap_eps)):
            raise ValueError(f"cap_eps must be finite and > 0, got {cap_eps}")
        self.cap_eps = cap_eps
        self.entropy_window = entropy_window
        self.histogram_every_n_steps = histogram_every_n_steps
        self.prefix = prefix
        self.rolling = CentredRollingMean(entropy_window)
        self.drain_step: int | None = None
        self._warned_no_tensorboard = False

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(entropy_window=self.entropy_window, prefix=self.prefix)

    def tensorboard(self, trainer: pl.Trainer):
        """The ``SummaryWriter`` of the first TensorBoard logger, or None (then only scalars are logged)."""
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                return logger.experiment
        if not self._warned_no_tensorboard and trainer.loggers:
            rank_zero_warn("Diagnostics: no TensorBoardLogger, so histograms and the centred entropy mean are skipped")
            self._warned_no_tensorboard = True
        return None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        known = (*ROW_KEYS, *GROUP_KEYS, "entropy", "schedule/draining")
        if not isinstance(outputs, Mapping) or not any(key in outputs for key in known):
            got = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
            raise TypeError("Diagnostics needs training_step to return a dict with some of the keys "
                            f"{', '.join(known)} (see lit_gmc.callbacks.diagnostics); got {got}")  # fmt: skip
        step = trainer.fit_loop.total_batch_idx  # the step Lightning logs this batch's metrics at
        scalars = step_scalars(outputs, self.cap_eps)
        if "drain/active" in scalars and scalars["drain/active"] > 0.5 and self.drain_step is None:
            self.drain_step = step
            scalars["drain/step"] = float(step)  # a single point: the update at which the queue started draining
        if scalars:
            for logger in trainer.loggers:
                logger.log_metrics({f"{self.prefix}/{k}": v for k, v in scalars.items()}, step=step)
        writer = self.tensorboard(trainer) if trainer.is_global_zero else None
        if "entropy/mean" in scalars:
            for centre, mean in self.rolling.push(step, scalars["entropy/mean"]):
                if writer is not None:
                    writer.add_scalar(f"{self.prefix}/entropy/centred_rolling_mean", mean, centre)
        if writer is not None and step % self.histogram_every_n_steps == 0:
            for key, tag in HISTOGRAMS.items():
                value = outputs.get(key)
                if not isinstance(value, Tensor):
                    continue
                flat = value.detach().float().flatten()
                finite = flat[torch.isfinite(flat)].cpu()  # a diverged ratio must not break the binning
                if finite.numel():
                    writer.add_histogram(f"{self.prefix}/{tag}", finite, step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        writer = self.tensorboard(trainer) if trainer.is_global_zero else None
        for centre, mean in self.rolling.flush():
            if writer is not None:
                writer.add_scalar(f"{self.prefix}/entropy/centred_rolling_mean", mean, centre)
        if writer is not None:
            writer.flush()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rolling": self.rolling.state_dict(), "drain_step": self.drain_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rolling.load_state_dict(state_dict["rolling"])
        self.drain_step = state_dict["drain_step"]

"""Per-update diagnostics of off-policy group RL, logged from what ``training_step`` already computed.

The callback runs no forward pass and knows no model: it reads the dict of detached tensors that ``training_step``
returns (``outputs`` of ``on_train_batch_end``), so any project whose step returns these keys can use it. Every
key is optional; rows are group-major (row ``b * G + i`` is response ``i`` of group ``b``), ``N = B * G``:

- ``log_rho`` ``(N,)``: trajectory log-ratio ``log pi_theta(y) - log pi_behaviour(y)``
- ``log_rho_bar`` ``(B,)``: group log mean ratio ``logsumexp_i log rho_i - log G``
- ``removed_mass`` ``(B,)``: ``(1/G) sum_i (rho_i - c_i)``, the importance mass the rule removed
- ``ess`` ``(B,)``: group effective sample size ``(sum rho)^2 / sum rho^2``
- ``rewards``, ``response_lengths`` (real tokens), ``delays`` (``tau = n - s``): ``(N,)`` each
- ``entropy`` ``(tokens,)``: the current policy's entropy at every real response token
- ``token_log_ratio`` ``(tokens,)``: ``log pi_theta(y_t) - l_t`` at every real response token
- ``schedule/draining`` ``()``: 1 once the delay queue drains
- ``mismatch/abs_mean``, ``mismatch/abs_max`` ``()``: mean and max ``|l - log pi_theta|`` on delay-0 rows' tokens

The cross-rule shares (GMC's rescaled groups, TIC's dropped trajectories) use the callback's own thresholds. How far
the current policy is from the behaviour one (``divergence/...``: the k1 and k3 estimates of ``KL(pi_b || pi_theta)``
per token, ``chi^2`` per token and per sequence, :func:`~lit_gmc.objectives.mismatch_statistics`) is logged every
update, and a warning goes to the log, once per run and kind, when the mean ESS / G falls below ``warn_ess_fraction``,
the k3 KL exceeds ``warn_kl`` or the per-token ``chi^2`` exceeds ``warn_chi2``. Scalars
go to every logger under ``{prefix}/...`` at ``global_step - 1`` (``pl_module.log`` would re-log a one-off value);
histograms and the entropy's centred rolling mean go to TensorBoard only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lit_gmc.objectives import mismatch_statistics, tied_groups

ROW_KEYS = ("log_rho", "rewards", "response_lengths", "delays")
GROUP_KEYS = ("log_rho_bar", "removed_mass", "ess")
TOKEN_KEYS = ("entropy", "token_log_ratio")
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
    for key, want in (*((key, 1) for key in TOKEN_KEYS), ("schedule/draining", 0)):
        if key in stats and (not isinstance(stats[key], Tensor) or stats[key].dim() != want):
            raise ValueError(f"diagnostics key {key!r} must be a {want}-D tensor, got {stats[key]!r:.80}")
    rows = next(iter(sizes["rows"].values()), None)
    groups = next(iter(sizes["groups"].values()), None)
    if rows is not None and groups is not None and (groups == 0 or rows % groups):
        raise ValueError(f"diagnostics rows ({rows}, from {list(sizes['rows'])}) are not a multiple of groups "
                         f"({groups}, from {list(sizes['groups'])})")  # fmt: skip
    return rows, groups


def pearson(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Pearson correlation of two ``(N,)`` tensors over the pairs where both are finite, and whether it is defined.

    Undefined (``False``, 0-D bool) when fewer than two pairs remain or either side is constant over them;
    computed masked in float64 (``torch.corrcoef`` takes non-finite pairs in; indexing waits for the device).
    """
    if x.shape != y.shape or x.dim() != 1:
        raise ValueError(f"pearson: x {tuple(x.shape)} and y {tuple(y.shape)} must be the same (N,)")
    if x.numel() == 0:
        return torch.tensor(math.nan, dtype=torch.float64, device=x.device), torch.tensor(False, device=x.device)
    x, y = x.double(), y.to(device=x.device, dtype=torch.float64)  # (N,) each
    kept = x.isfinite() & y.isfinite()  # (N,)
    count = kept.sum()

    def centred(v: Tensor) -> Tensor:  # (N,), 0 where not kept
        return torch.where(kept, v - torch.where(kept, v, 0.0).sum() / count, 0.0)

    def constant(v: Tensor) -> Tensor:  # over the kept pairs
        return torch.where(kept, v, math.inf).amin() == torch.where(kept, v, -math.inf).amax()

    dx, dy = centred(x), centred(y)
    denominator = ((dx * dx).sum() * (dy * dy).sum()).sqrt()
    defined = (count >= 2) & ~constant(x) & ~constant(y) & (denominator > 0)
    return (dx * dy).sum() / denominator, defined


def centred_rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Centred rolling mean of a whole series (for the plots): :class:`CentredRollingMean` run over it."""
    rolling = CentredRollingMean(window)
    means = [mean for index, value in enumerate(values) for _, mean in rolling.push(index, value)]
    return means + [mean for _, mean in rolling.flush()]


class CentredRollingMean:
    """Online centred rolling mean, pandas' ``rolling(window, center=True, min_periods=1).mean()`` as values come.

    A centre's window spans ``window // 2`` values before it and ``window - 1 - window // 2`` after, cut at the
    series' ends. Push ``(step, value)`` in order; a centre's mean is emitted once its window is complete, the last
    ones on :meth:`flush`; checkpointable. (The libraries' centred windows need the whole series.)
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
            start, stop = max(0, self.emitted - self.window // 2), min(self.count, self.emitted + self.after + 1)
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


def step_scalars(stats: Mapping[str, Tensor], gmc_cap: float = 0.28, tic_cap: float = 0.28) -> dict[str, float]:
    """Every per-update scalar the stats support (tags without the prefix), as Python floats.

    The :func:`step_tensors`, stacked and copied to the host at once; a correlation that is undefined is left out.
    """
    out, defined = step_tensors(stats, gmc_cap, tic_cap)
    if not out:
        return {}
    device = next(iter(out.values())).device
    parts = [t.to(device=device, dtype=torch.float64) for t in (*out.values(), *defined.values())]
    host = torch.stack(parts).tolist()  # the update's one transfer to the host
    scalars = dict(zip(out, host, strict=False))
    for tag, is_defined in zip(defined, host[len(out) :], strict=True):
        if not is_defined:
            del scalars[tag]
    return scalars


def step_tensors(
    stats: Mapping[str, Tensor], gmc_cap: float = 0.28, tic_cap: float = 0.28
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Every per-update scalar the ``stats`` support, as 0-D tensors on their device (float64 reductions).

    Returns ``tag -> value``, and ``tag -> defined`` for the correlations (:func:`pearson`) and the gap.
    """
    rows, groups = check_stats(stats)
    values = {key: stats[key].detach().double() for key in (*ROW_KEYS, *GROUP_KEYS, *TOKEN_KEYS)
              if key in stats and stats[key].numel()}  # fmt: skip
    out: dict[str, Tensor] = {}
    if "log_rho" in values:
        lr = values["log_rho"]  # (N,)
        mean = lr.mean()
        std = (lr - mean).square().mean().sqrt()  # the population std, as the paper's spread; inf mean: NaN std
        out.update({"log_rho/mean": mean, "log_rho/std": std, "log_rho/min": lr.amin(), "log_rho/max": lr.amax(),
                    "log_rho/abs_mean": lr.abs().mean()})  # fmt: skip
    if "log_rho_bar" in values:
        lb = values["log_rho_bar"]  # (B,)
        median, q90 = torch.quantile(lb, lb.new_tensor([0.5, 0.9]))  # linear interpolation, numpy's default
        out.update({"rho_bar/log_mean": lb.mean(), "rho_bar/log_median": median, "rho_bar/log_q90": q90,
                    "rho_bar/log_max": lb.amax()})  # fmt: skip
    for key, tag, cap in (
        ("log_rho_bar", "gmc/rescaled_fraction", gmc_cap),
        ("log_rho", "tic/dropped_fraction", tic_cap),
    ):
        if key in values:
            out[tag] = (values[key] > math.log1p(cap)).double().mean()
    if "removed_mass" in values:
        out.update(
            {"removed_mass/mean": values["removed_mass"].mean(), "removed_mass/max": values["removed_mass"].amax()}
        )
    if "ess" in values:
        out.update({"ess/mean": values["ess"].mean(), "ess/min": values["ess"].amin()})
        if rows is not None:
            out["ess/mean_fraction_of_G"] = out["ess/mean"] / (rows // groups)
    if "response_lengths" in values:
        lengths = values["response_lengths"]  # (N,)
        out.update({"response_length/mean": lengths.mean(), "response_length/max": lengths.amax()})
    if "rewards" in stats and groups is not None:
        rewards = stats["rewards"].detach()  # (N,)
        # the rules' own test of a tie: rewards exactly equal (NaN never ties); NaN for a batch without rows
        tied = tied_groups(rewards.reshape(-1, rows // groups)) if rows else rewards.new_tensor([[math.nan]])  # (B, 1)
        out["reward/zero_variance_fraction"] = tied.float().mean()
    if "entropy" in values:
        out["entropy/mean"] = values["entropy"].mean()
    if "token_log_ratio" in values and "log_rho" in values:
        divergence = mismatch_statistics(values["token_log_ratio"], values["log_rho"])
        out.update({f"divergence/{key}": value for key, value in divergence.items()})
    defined: dict[str, Tensor] = {}
    if "response_lengths" in stats:
        for key, tag in (("log_rho", "corr/log_rho_vs_length"), ("delays", "corr/delay_vs_length")):
            if key in stats:
                out[tag], defined[tag] = pearson(stats[key].detach(), stats["response_lengths"].detach())
    if "schedule/draining" in stats:
        out["drain/active"] = stats["schedule/draining"].detach()
    if "log_rho" in values and "delays" in values:
        gap, gap_defined = on_policy_gap(stats, values, rows // groups if groups else None, gmc_cap, tic_cap)
        out.update(gap)
        defined.update(gap_defined)
    return out, defined


def on_policy_gap(
    stats: Mapping[str, Tensor], values: Mapping[str, Tensor], group_size: int | None, gmc_cap: float, tic_cap: float
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The engine/learner gap on the rows generated by the current weights (delay 0), ``gap/...`` tags.

    There ``log rho`` is numerics alone. Per sequence, mean and max ``|log rho|``; per token, the learner's
    ``mismatch/...`` when given; and over all-delay-0 groups, the shares GMC would rescale and TIC drop from, i.e.
    corrections made for numerical reasons alone. A tag is defined only when some row (or group) is on-policy.
    """
    on = values["delays"] == 0  # (N,)
    size = values["log_rho"].abs()  # (N,)
    count = on.sum()
    out = {"gap/seq_abs_mean": torch.where(on, size, 0.0).sum() / count.clamp(min=1),
           "gap/seq_abs_max": torch.where(on, size, -math.inf).amax(),
           "gap/on_policy_rows": count.double()}  # fmt: skip
    defined = {"gap/seq_abs_mean": count > 0, "gap/seq_abs_max": count > 0}
    for key, tag in (("mismatch/abs_mean", "gap/token_abs_mean"), ("mismatch/abs_max", "gap/token_abs_max")):
        if key in stats:
            out[tag] = stats[key].detach().double()
    if group_size and "log_rho_bar" in values:
        on_groups = on.reshape(-1, group_size).all(-1)  # (B,)
        dropped = (values["log_rho"] > math.log1p(tic_cap)).reshape(-1, group_size).any(-1)  # (B,)
        rescaled = values["log_rho_bar"] > math.log1p(gmc_cap)  # (B,)
        groups = on_groups.sum()
        for tag, hit in (("gap/gmc_rescaled_group_fraction", rescaled), ("gap/tic_dropped_group_fraction", dropped)):
            out[tag] = (on_groups & hit).sum().double() / groups.clamp(min=1)
            defined[tag] = groups > 0
    return out, defined


def merged(outputs: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
    """The stats of an update's accumulated batches as one dict.

    Row, group and token keys concatenated (only those every batch has), ``schedule/draining`` from the last batch.
    """
    keys = set.intersection(*(set(o) for o in outputs))
    out = {key: torch.cat([o[key].detach() for o in outputs]) for key in (*ROW_KEYS, *GROUP_KEYS, *TOKEN_KEYS)
           if key in keys}  # fmt: skip
    if "schedule/draining" in keys:
        out["schedule/draining"] = outputs[-1]["schedule/draining"].detach()
    return out


class Diagnostics(pl.Callback):
    """Logs the diagnostics of every update from ``training_step``'s returned dict (see the module docstring).

    Args:
        entropy_window: Width of the centred rolling mean of the entropy (the paper's Figure 4 uses 25).
        histogram_every_n_steps: Period of the histograms (each costs a binning pass; scalars are every step).
        prefix: Tag prefix.
        gmc_cap: ``gmc/rescaled_fraction`` is the share of groups with ``rho_bar > 1 + gmc_cap``, whatever rule is
            trained, so that runs of every rule are read at one value (the paper's 0.28).
        tic_cap: ``tic/dropped_fraction`` is the share of trajectories with ``rho > 1 + tic_cap``, likewise.
        warn_ess_fraction: Warn (once) when an update's mean group ESS / G is below this (verl's suggested 0.3).
        warn_kl: Warn (once) when an update's k3 estimate of ``KL(pi_b || pi_theta)`` per token exceeds this (verl's
            suggested bound on its KL, 0.1).
        warn_chi2: Warn (once) when an update's per-token ``chi^2`` exceeds this (verl's suggested 1.0).
    """

    def __init__(
        self,
        entropy_window: int = 25,
        histogram_every_n_steps: int = 10,
        prefix: str = "diag",
        gmc_cap: float = 0.28,
        tic_cap: float = 0.28,
        warn_ess_fraction: float = 0.3,
        warn_kl: float = 0.1,
        warn_chi2: float = 1.0,
    ) -> None:
        if histogram_every_n_steps < 1:
            raise ValueError(f"histogram_every_n_steps must be >= 1, got {histogram_every_n_steps}")
        for name, cap in (("gmc_cap", gmc_cap), ("tic_cap", tic_cap), ("warn_ess_fraction", warn_ess_fraction),
                          ("warn_kl", warn_kl), ("warn_chi2", warn_chi2)):  # fmt: skip
            if not (cap > 0 and math.isfinite(cap)):
                raise ValueError(f"Diagnostics: {name} must be finite and > 0, got {cap}")
        self.gmc_cap, self.tic_cap = gmc_cap, tic_cap
        # tag -> (bound, whether values above it warn, the option that sets it)
        self.warnings = {"ess/mean_fraction_of_G": (warn_ess_fraction, False, "warn_ess_fraction"),
                         "divergence/k3": (warn_kl, True, "warn_kl"),
                         "divergence/chi2_token": (warn_chi2, True, "warn_chi2")}  # fmt: skip
        self.warned: set[str] = set()
        self.entropy_window = entropy_window
        self.histogram_every_n_steps = histogram_every_n_steps
        self.prefix = prefix
        self.rolling = CentredRollingMean(entropy_window)
        self.drain_step: int | None = None
        self._warned_no_tensorboard = False
        self._step_at_batch_start: int | None = None
        # An update's earlier batches under gradient accumulation; not checkpointed, since Lightning checkpoints
        # after an optimizer step, when none is pending.
        self._accumulated: list[Mapping[str, Any]] = []

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
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        known = (*ROW_KEYS, *GROUP_KEYS, *TOKEN_KEYS, "schedule/draining")
        if not isinstance(outputs, Mapping) or not any(key in outputs for key in known):
            got = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
            raise TypeError("Diagnostics needs training_step to return a dict with some of the keys "
                            f"{', '.join(known)} (see lit_gmc.callbacks.diagnostics); got {got}")  # fmt: skip
        if trainer.global_step == self._step_at_batch_start:  # gradient accumulation: the update is not taken yet
            self._accumulated.append({key: outputs[key] for key in known if key in outputs})
            return
        stats = merged([*self._accumulated, outputs]) if self._accumulated else outputs
        self._accumulated = []
        step = trainer.global_step - 1  # the update just taken, as the learner and DelayAccounting log it
        scalars = step_scalars(stats, self.gmc_cap, self.tic_cap)
        if "drain/active" in scalars and scalars["drain/active"] > 0.5 and self.drain_step is None:
            self.drain_step = step
            scalars["drain/step"] = float(step)  # a single point: the update at which the queue started draining
        self.warn_once(step, scalars)
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
                value = stats.get(key)
                if not isinstance(value, Tensor):
                    continue
                flat = value.detach().float().flatten()
                finite = flat[torch.isfinite(flat)].cpu()  # a diverged ratio must not break the binning
                if finite.numel():
                    writer.add_histogram(f"{self.prefix}/{tag}", finite, step)

    def warn_once(self, step: int, scalars: Mapping[str, float]) -> None:
        """One warning per kind and run when the policies have drifted past a documented bound (docs/callbacks.md)."""
        for tag, (bound, above, option) in self.warnings.items():
            value = scalars.get(tag)
            if tag in self.warned or value is None or not (value > bound if above else value < bound):
                continue
            self.warned.add(tag)
            side = "above" if above else "below"
            rank_zero_warn(f"Diagnostics: at update {step} {self.prefix}/{tag} = {value:.4g} is {side} {bound} "
                           f"(--trainer.callbacks Diagnostics' {option}): the current policy is far from the one that "
                           "sampled these rollouts, so importance weights rest on few samples "
                           "(warned once per run)")  # fmt: skip

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

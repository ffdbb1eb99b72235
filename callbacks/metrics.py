"""Evaluation metrics as torchmetrics ``Metric``s: greedy accuracy, avg@n, unbiased pass@k, macro average.

Every state is a sum across processes, so a benchmark split over ranks gives one process's numbers. Inputs are
0/1 correctness, ``(P,)`` greedy or ``(P, n)`` sampled. :func:`pass_at_k` lives here rather than in
``lit_gmc.objectives`` because callbacks never import the learner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import MeanMetric, Metric

PAPER_KS: tuple[int, ...] = (1, 2, 4, 8, 16)


def pass_at_k(num_correct: Tensor, n: int, k: int) -> Tensor:
    """Unbiased pass@k of Chen et al. (2021, "Evaluating Large Language Models Trained on Code", eq. 1).

    pass@k = 1 - C(n - c, k) / C(n, k), in the paper's stable product form 1 - prod_{i = n-c+1}^{n} (1 - k / i),
    summed in log space, and exactly 1 when ``n - c < k``. ``num_correct``: the ``(P,)`` counts ``c`` in ``[0, n]``
    of ``n`` samples per problem; ``1 <= k <= n``. Returns ``(P,)`` float64 estimates in ``[0, 1]``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    c = torch.as_tensor(num_correct).to(torch.long)  # (P,)
    if c.dim() != 1 or ((c < 0) | (c > n)).any():
        raise ValueError(f"num_correct must be a 1-D tensor of counts in [0, {n}], got {num_correct}")
    i = torch.arange(1, n + 1, dtype=torch.float64)  # (n,)
    # log(1 - k/i) is only needed for i > k (every factor of the product has i > n - c >= k).
    terms = torch.where(i > k, torch.log1p(-k / i.clamp(min=k + 1)), torch.zeros_like(i))  # (n,)
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), terms.cumsum(0)])  # (n + 1,): prefix[j] = sum_{i<=j}
    log_miss = prefix[n] - prefix[n - c]  # (P,): log prod_{i=n-c+1}^{n} (1 - k/i)
    return torch.where(n - c < k, torch.ones_like(log_miss), -torch.expm1(log_miss))


def _check_correctness(correct: Tensor, dims: int, n: int | None = None) -> Tensor:
    correct = torch.as_tensor(correct)
    if correct.dim() != dims or (n is not None and correct.shape[-1] != n):
        expected = "(P,)" if dims == 1 else f"(P, {n})"
        raise ValueError(f"correctness must have shape {expected}, got {tuple(correct.shape)}")
    values = correct.to(torch.float64)
    if not ((values == 0) | (values == 1)).all():
        raise ValueError("correctness values must be 0 or 1")
    return values


class AvgAtN(MeanMetric):
    """avg@n: mean correctness of ``n`` samples per problem, averaged over problems. ``update(correct (P, n))``.

    Args:
        n: Samples per problem.
    """

    higher_is_better = True

    def __init__(self, n: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.set_dtype(torch.float64)

    def update(self, correct: Tensor) -> None:
        """Add ``(P, n)`` sample correctness."""
        super().update(_check_correctness(correct, dims=2, n=self.n).mean(dim=1))


class GreedyAccuracy(AvgAtN):
    """Fraction of problems whose greedy (T = 0) answer is correct, avg@1. ``update(correct (P,))``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(1, **kwargs)

    def update(self, correct: Tensor) -> None:
        """Add ``(P,)`` greedy correctness."""
        super().update(_check_correctness(correct, dims=1)[:, None])


class PassAtK(Metric):
    """Unbiased pass@k (:func:`pass_at_k`) averaged over problems: ``update(correct (P, n))``, ``{"pass@k": value}``.

    Args:
        n: Samples per problem.
        ks: Draw sizes, each at most ``n`` (the paper reports 1, 2, 4, 8, 16).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, n: int, ks: Sequence[int] = PAPER_KS, **kwargs) -> None:
        super().__init__(**kwargs)
        bad = [k for k in ks if not 1 <= k <= n]
        if bad or not ks:
            raise ValueError(f"pass@k needs 1 <= k <= n={n} for every k, got ks={list(ks)}")
        self.n = n
        self.ks = tuple(ks)
        self.add_state("totals", torch.zeros(len(self.ks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("problems", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, correct: Tensor) -> None:
        """Add ``(P, n)`` sample correctness."""
        values = _check_correctness(correct, dims=2, n=self.n)  # (P, n)
        counts = values.sum(dim=1).round().long()  # (P,)
        self.totals += torch.stack([pass_at_k(counts, self.n, k).sum() for k in self.ks])
        self.problems += values.shape[0]

    def compute(self) -> dict[str, Tensor]:
        """``{"pass@k": mean over problems}`` for each ``k``."""
        return {f"pass@{k}": total / self.problems for k, total in zip(self.ks, self.totals, strict=True)}


class MacroAverage(Metric):
    """Unweighted mean over benchmarks of each benchmark's mean per-problem score.

    ``update(name, scores (P,))`` with one benchmark's per-problem scores; benchmarks never updated are left out.

    Args:
        names: The benchmarks, in a fixed order.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, names: Sequence[str], **kwargs) -> None:
        super().__init__(**kwargs)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"names must be non-empty and distinct, got {list(names)}")
        self.names = list(names)
        self.add_state("totals", torch.zeros(len(self.names), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("problems", torch.zeros(len(self.names), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, name: str, scores: Tensor) -> None:
        """Add ``(P,)`` per-problem scores of benchmark ``name``."""
        if name not in self.names:
            raise ValueError(f"unknown benchmark {name!r}; known: {self.names}")
        scores = torch.as_tensor(scores, dtype=torch.float64)
        if scores.dim() != 1 or ((scores < 0) | (scores > 1)).any():
            raise ValueError(f"scores must be a 1-D tensor in [0, 1], got shape {tuple(scores.shape)}")
        index = self.names.index(name)
        self.totals[index] += scores.sum()
        self.problems[index] += scores.numel()

    def compute(self) -> Tensor:
        """Mean of the per-benchmark means."""
        seen = self.problems > 0
        return (self.totals[seen] / self.problems[seen]).mean()

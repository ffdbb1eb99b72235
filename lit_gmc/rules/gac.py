"""GAC (Xu et al. 2026) on vanilla GRPO: the PPO-clip loss, and a projection of each update's gradient."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.distributed import full_tensor, like, local_part, rank_and_world, sum_across
from lit_gmc.rules.grpo import GRPO


class GAC(GRPO):
    """GAC: GRPO's loss, and the full gradient projected against the previous update's before clipping and the step.

    RECONSTRUCTION (DESIGN.md §8; :func:`~lit_gmc.objectives.gac_shift`): with ``c = cos(g, g_prev)``, unchanged
    for ``c <= cosine_low``; the component along ``g_prev`` shrunk until the cosine is ``cosine_low`` for
    ``cosine_low < c <= cosine_high``; removed above. ``g_prev`` is the previous step's raw gradient (so the
    monitored cosine never depends on the previous projection), kept whole in checkpoints so that a resumed run
    projects as an uninterrupted one; under FSDP2 the cosine is summed over ranks.

    Args:
        clip: Two-sided PPO clip of the token ratio (0.2).
        cosine_low: Cosine up to which the gradient is left alone (0.05).
        cosine_high: Cosine above which the component along ``g_prev`` is removed (0.30).
        aggregation: Loss aggregation; ``null``: GRPO's ``seq_mean_token_mean``.
    """

    def __init__(
        self,
        clip: float = 0.2,
        cosine_low: float = 0.05,
        cosine_high: float = 0.30,
        aggregation: O.Aggregation | None = None,
    ) -> None:
        super().__init__(clip, aggregation, cosine_low=cosine_low, cosine_high=cosine_high)
        self.previous: list[Tensor | None] | None = None

    @classmethod
    def option_problems(  # type: ignore[override]
        cls, clip: float, cosine_low: float, cosine_high: float, aggregation: str | None
    ) -> list[str]:
        """Every problem with GAC's options, one line each."""
        problems = super().option_problems(aggregation, clip=clip)
        if not -1.0 < cosine_low < cosine_high < 1.0:
            problems.append(f"cosine_low={cosine_low}, cosine_high={cosine_high} must satisfy -1 < cosine_low < "
                            "cosine_high < 1")  # fmt: skip
        return problems

    @override
    def before_step(
        self, parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, stats: dict[str, Tensor]
    ) -> dict[str, float]:
        """Project the gradients in place; returns the cosine before and after and the shift."""
        del optimizer, stats
        grads = [p.grad for p in parameters]
        raw = [None if g is None else g.detach().clone() for g in grads]
        previous, self.previous = self.previous, raw
        if previous is None:
            return {}
        if len(previous) != len(grads):
            raise ValueError(f"GAC kept {len(previous)} gradient tensors but the model has {len(grads)} parameters")
        # Parameters without a gradient now cannot be moved and take no part; a missing g_prev counts as zero.
        pairs = [(g, None if prev is None else like(g, prev)) for g, prev in zip(grads, previous, strict=True)]
        pairs = [(g, prev) for g, prev in pairs if g is not None]
        # Sums over this rank's part of each gradient (g . g_prev, ||g||^2, ||g_prev||^2), then over ranks if sharded.
        parts = [O.gradient_dot_and_norms(local_part(g), None if p is None else local_part(p)) for g, p in pairs]
        sums = torch.stack([p.to(parts[0].device) for p in parts]).sum(0) if parts else torch.zeros(3)  # (3,)
        if any(isinstance(g, DTensor) for g, _ in pairs):
            sums = sum_across(sums)
        dot, norm_sq, prev_sq = sums.tolist()
        cosine, shift = O.gac_shift(dot, norm_sq, prev_sq, self.cosine_low, self.cosine_high)
        if shift != 0.0:
            for g, prev in pairs:
                if prev is not None:
                    g.sub_(prev, alpha=shift)
        new_sq = norm_sq - 2.0 * shift * dot + shift * shift * prev_sq
        projected = (dot - shift * prev_sq) / math.sqrt(new_sq * prev_sq) if new_sq > 0 and prev_sq > 0 else 0.0
        return {"gac/cosine": cosine, "gac/projected_cosine": projected, "gac/shift": shift}

    @override
    def state_dict(self) -> dict[str, Any]:
        """The previous raw gradient (a list aligned with the parameters, or None before the first step).

        Sharded gradients are gathered one at a time (every rank must call this) and kept on CPU by rank 0 only.
        """
        previous = self.previous
        if previous is not None and any(isinstance(t, DTensor) for t in previous):
            keep = rank_and_world()[0] == 0
            gathered: list[Tensor | None] = []
            for t in previous:
                whole = None if t is None else full_tensor(t)
                gathered.append(whole.cpu() if keep and whole is not None else None)
            previous = gathered
        return {"previous": previous}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; tensors move to the gradients' device when next used."""
        self.previous = state["previous"]

"""``BehaviorRecompute``: behaviour log-probs rescored by the learner's own code, to measure the engine's gap."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

import torch
from torch import Tensor

from lit_gmc.batch import RolloutGroup, collate_groups
from lit_gmc.data.engines import RolloutEngine, SamplingParams
from lit_gmc.logprobs import response_logprobs


class BehaviorRecompute:
    """An engine whose behaviour log-probs are rescored by the learner's own code on a copy of the same weights.

    The wrapped engine samples; :func:`~lit_gmc.logprobs.response_logprobs` on an HF copy, kept at the engine's
    version (and moved to the published tensors' device and dtype), scores the sampled tokens at the sampling
    temperature and replaces the engine's log-probs, so the importance ratio carries no engine/trainer numerical
    gap. The gap it removed is measured: :meth:`take_gap` gives mean and max ``|l_engine - l_trainer|`` over the
    tokens generated since the previous call. The learner applies no top-p, so with ``top_p < 1`` the rescored
    log-probs are those of the tempered, untruncated distribution, as the learner's are. At scale the copy is a
    second full model on the learner's device: a diagnostic, not the paper's setting.
    """

    def __init__(self, engine: RolloutEngine, model: torch.nn.Module, pad_id: int) -> None:
        self.engine, self.model, self.pad_id = engine, model.eval().requires_grad_(False), pad_id
        self._lock = threading.Lock()  # the copy's weights and version change together, never mid-rescoring
        self._gap_sum, self._gap_count, self._gap_max = 0.0, 0, 0.0

    @property
    def tokenizer(self):
        """The wrapped engine's tokenizer."""
        return self.engine.tokenizer

    @property
    def version(self) -> int:
        """The wrapped engine's version (the copy always holds the same weights)."""
        return self.engine.version

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load the weights into the copy and the engine, under one lock."""
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        with self._lock, torch.no_grad():
            if named:
                self.model.to(device=named[0][1].device, dtype=named[0][1].dtype)  # the learner's numerics
            params = dict(self.model.named_parameters())
            for name, tensor in named:
                if name not in params:
                    raise KeyError(f"recompute_behavior_logprobs: unknown parameter {name!r}")
                params[name].copy_(tensor)
            self.engine.load_weights(named, version)

    def generate(self, prompts, n: int, sampling: SamplingParams) -> list[RolloutGroup]:
        """The engine's groups, with behaviour log-probs rescored by the learner's code."""
        with self._lock:
            return [self._rescored(g, sampling.temperature or 1.0) for g in self.engine.generate(prompts, n, sampling)]

    def _rescored(self, group: RolloutGroup, temperature: float) -> RolloutGroup:
        batch = collate_groups([group], pad_id=self.pad_id)
        device = next(self.model.parameters()).device
        with torch.no_grad():
            logprobs, _ = response_logprobs(self.model, batch.input_ids.to(device), batch.attention_mask.to(device),
                                            batch.prompt_width, temperature=temperature)  # fmt: skip
        logprobs = logprobs.float().cpu().masked_fill(~group.response_mask, 0.0)  # (G, L)
        gap = (logprobs - group.behavior_logprobs.float())[group.response_mask].abs()  # (tokens,)
        self._gap_sum, self._gap_count = self._gap_sum + float(gap.sum()), self._gap_count + gap.numel()
        self._gap_max = max(self._gap_max, float(gap.max())) if gap.numel() else self._gap_max
        return dataclasses.replace(group, behavior_logprobs=logprobs)

    def take_gap(self) -> dict[str, float]:
        """``engine_gap_abs_mean`` and ``engine_gap_abs_max`` since the last call (empty if nothing was generated)."""
        with self._lock:
            out = {} if not self._gap_count else {
                "engine_gap_abs_mean": self._gap_sum / self._gap_count, "engine_gap_abs_max": self._gap_max,
            }  # fmt: skip
            self._gap_sum, self._gap_count, self._gap_max = 0.0, 0, 0.0
        return out

    def close(self) -> None:
        """Close the engine and drop the copy."""
        self.engine.close()
        self.model = None

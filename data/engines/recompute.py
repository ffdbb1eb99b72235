"""``BehaviorRecompute``: behaviour log-probs rescored with the learner's own numerics instead of the engine's."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from lit_gmc.batch import RolloutGroup, collate_groups
from lit_gmc.data.engines.base import RolloutEngine, SamplingParams
from lit_gmc.data.engines.hf import copy_weights
from lit_gmc.logprobs import response_logprobs


class BehaviorRecompute:
    """An engine whose behaviour log-probs are rescored with the learner's numerics on a copy of the same weights.

    ``engine`` samples; ``model``, a copy kept at the engine's version, rescores the tokens
    (:func:`~lit_gmc.logprobs.response_logprobs`, padding ``pad_id``) as ``trainer``'s learner will: its precision's
    forward context, its device, its module's ``dtype``, ``logit_chunk_tokens`` and ``micro_batch_groups`` (``None``:
    a call's groups in one pass), at the sampling temperature without top-p; no trainer: the model as it is, in one
    pass. So a batch the learner sees whole with the same weights has a ratio of exactly 1. :meth:`take_gap` gives
    mean and max ``|l_engine - l_trainer|`` since its last call. The copy is a second model on the learner's device
    (``scripts/memory_estimate.py --recompute-behavior-logprobs``).
    """

    def __init__(self, engine: RolloutEngine, model: torch.nn.Module, pad_id: int, trainer: Any = None) -> None:
        module = trainer.lightning_module if trainer is not None else None
        hparams = getattr(module, "hparams", {}) if module is not None else {}
        dtype = getattr(torch, hparams["dtype"]) if isinstance(hparams.get("dtype"), str) else None
        # Parameters keep requires_grad=True, as the learner's (scoring runs under no_grad): ATen's matmul folds a
        # 3-D input differently when the weight requires grad, and the last bits would differ from the learner's.
        self.engine, self.model, self.pad_id = engine, model.eval(), pad_id
        self.model.to(device=trainer.strategy.root_device if trainer is not None else None, dtype=dtype)
        self.forward_context: Callable[[], AbstractContextManager] = (
            trainer.precision_plugin.train_step_context if trainer is not None else contextlib.nullcontext
        )
        self.chunk_tokens = hparams.get("logit_chunk_tokens", 512)
        self.micro_batch_groups = hparams.get("micro_batch_groups")
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
        with self._lock:
            if named:  # the learner's own tensors, unless WeightSync casts them (its dtype option): then not exact
                self.model.to(device=named[0][1].device, dtype=named[0][1].dtype)
            copy_weights(dict(self.model.named_parameters()), named)
            self.engine.load_weights(named, version)

    def generate(self, prompts, n: int, sampling: SamplingParams) -> list[RolloutGroup]:
        """The engine's groups, with behaviour log-probs rescored by the learner's code."""
        with self._lock:
            groups = self.engine.generate(prompts, n, sampling)
            return self._rescored(groups, sampling.temperature or 1.0) if groups else groups

    def _rescored(self, groups: list[RolloutGroup], temperature: float) -> list[RolloutGroup]:
        batch = collate_groups(groups, pad_id=self.pad_id)  # the learner's layout of a batch of these groups
        device = next(self.model.parameters()).device
        per_pass = self.micro_batch_groups or len(groups)
        scored = []
        for start in range(0, len(groups), per_pass):
            part = batch.groups_slice(start, min(start + per_pass, len(groups)))
            with torch.no_grad(), self.forward_context():
                logprobs, _ = response_logprobs(self.model, part.input_ids.to(device), part.attention_mask.to(device),
                                                part.prompt_width, temperature=temperature,
                                                chunk_tokens=self.chunk_tokens)  # fmt: skip
            scored.append(logprobs.float().cpu())  # (n_part, L)
        logprobs = torch.cat(scored).masked_fill(~batch.response_mask, 0.0)  # (N, L)
        gap = (logprobs - batch.behavior_logprobs)[batch.response_mask].abs()  # (tokens,)
        self._gap_sum, self._gap_count = self._gap_sum + float(gap.sum()), self._gap_count + gap.numel()
        self._gap_max = max(self._gap_max, float(gap.max())) if gap.numel() else self._gap_max
        rows = [g.group_size for g in groups]
        out = []
        for group, part in zip(groups, logprobs.split(rows), strict=True):
            out.append(dataclasses.replace(group, behavior_logprobs=part[:, : group.response_ids.shape[1]].clone()))
        return out

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

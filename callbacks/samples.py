"""Samples to look at: a few prompts, completions, rewards and delays as TensorBoard text, every few updates.

A reward of 0.000 cannot be debugged from scalars alone; the text of what the policy wrote usually shows why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override


@runtime_checkable
class Decoder(Protocol):
    """A tokenizer's ``batch_decode`` (transformers' signature)."""

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = ...) -> list[str]:
        """Token ids -> texts."""


@runtime_checkable
class SampledBatch(Protocol):
    """What the callback reads from a training batch (``lit_gmc.batch.RolloutBatch`` has it)."""

    input_ids: Tensor  # (N, P + L): left-padded prompt, then right-padded response
    attention_mask: Tensor  # (N, P + L)
    response_mask: Tensor  # (N, L)
    rewards: Tensor  # (N,)
    versions: Tensor  # (B,): behaviour policy version of each group
    prompt_width: int  # P
    group_size: int  # G


def escape(text: str) -> str:
    """``text`` safe inside one cell of a markdown table (TensorBoard renders text as markdown)."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>") or " "


def sample_rows(batch: SampledBatch, rows: int) -> list[int]:
    """Up to ``rows`` row indices, one per group first (the first response of each), so prompts differ."""
    return sorted(range(batch.rewards.numel()), key=lambda row: row % batch.group_size != 0)[:rows]  # a stable sort


def samples_table(
    prompts: Sequence[str], completions: Sequence[str], rewards: Sequence[float], delays: Sequence[int]
) -> str:
    """A markdown table, one row per sample: prompt, completion, reward, delay."""
    lines = ["| prompt | completion | reward | delay |", "|---|---|---|---|"]
    for prompt, completion, reward, delay in zip(prompts, completions, rewards, delays, strict=True):
        lines.append(f"| {escape(prompt)} | {escape(completion)} | {reward:.3f} | {delay} |")
    return "\n".join(lines)


class Samples(Callback):
    """Logs ``rows`` samples of an update as text (tag ``samples``) at the first update and every ``every_n_steps``.

    Needs a batch with the :class:`SampledBatch` fields and a tokenizer with ``batch_decode``. Writes to every
    logger with ``experiment.add_text``, on global rank 0, at ``n = global_step - 1``; prompts keep their special
    tokens (as the model sees them), completions do not.

    Args:
        every_n_steps: Updates between two logged tables (the first update is always logged).
        rows: Samples per table (one per prompt first, then further responses).
        tokenizer: The tokenizer to decode with; ``None``: ``trainer.datamodule.tokenizer``.
    """

    def __init__(self, every_n_steps: int = 100, rows: int = 4, tokenizer: Decoder | None = None) -> None:
        super().__init__()
        if every_n_steps < 1 or rows < 1:
            raise ValueError(f"Samples: every_n_steps={every_n_steps} and rows={rows} must both be >= 1")
        self.every_n_steps = every_n_steps
        self.rows = rows
        self.tokenizer = tokenizer
        self._logged_first = False

    def _decoder(self, trainer: pl.Trainer) -> Decoder:
        tokenizer = self.tokenizer or getattr(trainer.datamodule, "tokenizer", None)
        if not isinstance(tokenizer, Decoder):
            raise TypeError(
                f"Samples needs a tokenizer with batch_decode, passed as tokenizer= or found as "
                f"trainer.datamodule.tokenizer; found {type(tokenizer).__name__}"
            )
        return tokenizer

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Only global rank 0 writes tables, and only it has the tokenizer: under DDP the other ranks start no engine.
        if trainer.is_global_zero:
            self._decoder(trainer)  # fail before the first update, not after it
        self._logged_first = False

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step - 1  # the update just taken
        if not trainer.is_global_zero or (self._logged_first and step % self.every_n_steps):
            return
        writers = [logger.experiment for logger in trainer.loggers if hasattr(logger.experiment, "add_text")]
        if not writers:
            return
        if not isinstance(batch, SampledBatch):
            raise TypeError(f"Samples needs a batch with the SampledBatch fields; got {type(batch).__name__}")
        self._logged_first = True
        text = self.table(batch, step, self._decoder(trainer))
        for writer in writers:
            writer.add_text("samples", text, global_step=step)

    def table(self, batch: SampledBatch, step: int, tokenizer: Decoder) -> str:
        """The markdown table of :meth:`on_train_batch_end` for ``batch`` taken at update ``step``."""
        rows = sample_rows(batch, self.rows)
        width = batch.prompt_width
        prompts = [batch.input_ids[r, :width][batch.attention_mask[r, :width].bool()].tolist() for r in rows]
        responses = [batch.input_ids[r, width:][batch.response_mask[r].bool()].tolist() for r in rows]
        delays = [step - int(batch.versions[r // batch.group_size]) for r in rows]
        rewards = [float(batch.rewards[r]) for r in rows]
        return samples_table(
            # the prompt as the model sees it: a chat template's markers are special tokens, and prompts carry no
            # padding here (the attention mask drops it)
            tokenizer.batch_decode(prompts, skip_special_tokens=False),
            tokenizer.batch_decode(responses, skip_special_tokens=True),
            rewards,
            delays,
        )

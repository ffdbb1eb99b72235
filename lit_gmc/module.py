"""``GMCModule``: the learner. Log-probs of a batch -> a registered correction -> one optimizer step.

The module never talks to a rollout engine: batches arrive from the DataModule with their behaviour
log-probs and versions, and new weights leave through the ``WeightSync`` callback.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.actor import load_actor
from lit_gmc.batch import RolloutBatch
from lit_gmc.corrections import CORRECTIONS, CorrectionOutput, PolicyTerms
from lit_gmc.logprobs import response_logprobs

AGGREGATIONS = ("seq_sum_over_T", "token_mean", "seq_mean_token_mean")
OPTIMIZERS = ("adamw", "adamw8bit")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def validate_model_args(
    *, correction: str, eps: float | None, aggregation: str | None, lr: float, warmup_fraction: float,
    optimizer: str, max_grad_norm: float | None, micro_batch_groups: int, logit_chunk_tokens: int, dtype: str,
) -> list[str]:
    """Every problem with the model options, one line each, named by their CLI flags."""
    problems = []
    if correction not in CORRECTIONS:
        problems.append(f"--model.correction={correction!r} is not one of {', '.join(CORRECTIONS)}")
    if eps is not None and not eps > 0:
        problems.append(f"--model.eps={eps} must be > 0")
    if aggregation is not None and aggregation not in AGGREGATIONS:
        problems.append(f"--model.aggregation={aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    if not lr > 0:
        problems.append(f"--model.lr={lr} must be > 0")
    if not 0 <= warmup_fraction < 1:
        problems.append(f"--model.warmup_fraction={warmup_fraction} must be in [0, 1)")
    if optimizer not in OPTIMIZERS:
        problems.append(f"--model.optimizer={optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        problems.append(f"--model.max_grad_norm={max_grad_norm} must be > 0 (or null for no clipping)")
    if micro_batch_groups < 1:
        problems.append(f"--model.micro_batch_groups={micro_batch_groups} must be >= 1")
    if logit_chunk_tokens < 1:
        problems.append(f"--model.logit_chunk_tokens={logit_chunk_tokens} must be >= 1")
    if dtype not in DTYPES:
        problems.append(f"--model.dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    return problems


def cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class GMCModule(pl.LightningModule):
    """Off-policy policy-gradient learner for group rollouts (GMC-GRPO and baselines).

    Args:
        actor: ``"tiny"`` (built in code), a transformers hub name, or a local path.
        correction: Off-policy rule from the registry: ``gmc``, ``tic``, ``grpo``, ``is`` (and any registered).
        eps: Threshold: the ``1 + eps`` cap for GMC/TIC, the PPO clip for GRPO; ``null`` takes the rule's
            default (0.28 for GMC/TIC, 0.2 for GRPO).
        aggregation: ``seq_sum_over_T`` (the paper's 1/(T B G)), ``token_mean`` or ``seq_mean_token_mean``;
            ``null`` takes the rule's default.
        max_response_length: ``T``, the loss normaliser (linked to ``--data.max_new_tokens``).
        temperature: Temperature of the behaviour policy (linked to ``--data.temperature``).
        lr: Peak learning rate.
        betas: AdamW betas.
        weight_decay: AdamW weight decay.
        warmup_fraction: Fraction of ``max_steps`` of linear warm-up before the cosine decay.
        optimizer: ``adamw`` (torch) or ``adamw8bit`` (bitsandbytes, CUDA).
        max_grad_norm: Global gradient-norm clip; ``null`` disables it.
        micro_batch_groups: Groups per forward/backward pass (whole groups, so group statistics are exact).
        logit_chunk_tokens: Response positions per LM-head chunk (bounds logits memory).
        gradient_checkpointing: Recompute backbone activations in backward.
        dtype: Actor parameter dtype: ``float32``, ``bfloat16`` or ``float64``.
    """

    def __init__(
        self,
        actor: str = "tiny",
        correction: str = "gmc",
        eps: float | None = None,
        aggregation: str | None = None,
        max_response_length: int = 6,
        temperature: float = 1.0,
        lr: float = 2e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        warmup_fraction: float = 0.0,
        optimizer: str = "adamw",
        max_grad_norm: float | None = 1.0,
        micro_batch_groups: int = 8,
        logit_chunk_tokens: int = 512,
        gradient_checkpointing: bool = False,
        dtype: str = "float32",
    ) -> None:
        super().__init__()
        problems = validate_model_args(
            correction=correction, eps=eps, aggregation=aggregation, lr=lr, warmup_fraction=warmup_fraction,
            optimizer=optimizer, max_grad_norm=max_grad_norm, micro_batch_groups=micro_batch_groups,
            logit_chunk_tokens=logit_chunk_tokens, dtype=dtype,
        )
        if problems:
            raise ValueError("invalid model options:\n  " + "\n  ".join(problems))
        self.save_hyperparameters()
        self.automatic_optimization = False  # micro-batched backward, and room for per-step rules
        self.rule = CORRECTIONS[correction]
        self.eps = eps if eps is not None else self.rule.default_eps
        self.aggregation = aggregation or self.rule.aggregation
        self.step_rule = self.rule.step_rule() if self.rule.step_rule is not None else None
        self.actor, _ = load_actor(actor, DTYPES[dtype])
        self.actor.train()  # from_pretrained returns eval mode; Lightning expects train mode in fit
        if gradient_checkpointing:
            self.actor.gradient_checkpointing_enable()

    def policy_terms(self, batch: RolloutBatch, logprobs: Tensor) -> PolicyTerms:
        return PolicyTerms(
            token_logprobs=logprobs,
            behavior_logprobs=batch.behavior_logprobs.to(logprobs.dtype),
            mask=batch.response_mask,
            rewards=batch.rewards.to(logprobs.dtype),
            delays=batch.delays(self.global_step),
            group_size=batch.group_size,
        )

    def micro_batch_loss(self, batch: RolloutBatch, part: RolloutBatch) -> tuple[Tensor, CorrectionOutput, Tensor, Tensor]:
        """Loss share of the groups in ``part`` (normalised for the whole ``batch``), the rule's outputs, and the
        detached token entropies and log-probs ``(n, L)`` of the current policy."""
        logprobs, entropy = response_logprobs(
            self.actor, part.input_ids, part.attention_mask, part.prompt_width,
            temperature=self.hparams.temperature, chunk_tokens=self.hparams.logit_chunk_tokens,
        )  # (n, L), (n, L)
        out = self.rule.fn(self.policy_terms(part, logprobs), self.eps)
        loss = O.aggregate_loss(
            out.token_loss, part.response_mask, self.aggregation, max_length=self.hparams.max_response_length,
            total_sequences=batch.rewards.numel(), total_tokens=int(batch.response_mask.sum()),
        )
        return loss, out, entropy, logprobs.detach()

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> dict[str, Tensor]:
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        step = self.hparams.micro_batch_groups
        losses, outputs, entropies, logprobs = [], [], [], []
        for start in range(0, batch.num_groups, step):
            part = batch.groups_slice(start, min(start + step, batch.num_groups))
            loss, out, entropy, current = self.micro_batch_loss(batch, part)
            self.manual_backward(loss)
            losses.append(loss.detach())
            outputs.append(out)
            entropies.append(entropy.masked_select(part.response_mask))
            logprobs.append(current)
        stats = self.collect_stats(batch, outputs, torch.cat(entropies), torch.cat(logprobs))
        logged = self.step_rule.before_step(list(self.actor.parameters()), optimizer, stats) if self.step_rule else {}
        grad_norm = self.clip_and_measure()
        optimizer.step()
        if self.step_rule:
            self.step_rule.after_step(optimizer)
        self.lr_schedulers().step()
        loss = torch.stack(losses).sum()
        self.log_step(batch, loss, grad_norm, stats, logged)
        return {"loss": loss, **stats}

    def clip_and_measure(self) -> Tensor:
        params = [p for p in self.actor.parameters() if p.grad is not None]
        max_norm = self.hparams.max_grad_norm if self.hparams.max_grad_norm is not None else float("inf")
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def collect_stats(
        self, batch: RolloutBatch, outputs: list[CorrectionOutput], entropy: Tensor, logprobs: Tensor
    ) -> dict[str, Tensor]:
        """Detached per-row/per-group tensors of this step (the Diagnostics callback's input)."""
        log_rho = torch.cat([o.log_rho for o in outputs])  # (N,)
        coefficients = torch.cat([o.coefficients for o in outputs])  # (N,)
        g = batch.group_size
        log_rho_bar = O.group_log_mean_ratio(log_rho, g)  # (B,)
        stats = {
            "log_rho": log_rho,
            "coefficients": coefficients,
            "advantages": torch.cat([o.advantages for o in outputs]),
            "log_rho_bar": log_rho_bar,
            "gmc_rescaled": log_rho_bar > math.log1p(self.eps),  # (B,)
            "tic_dropped": log_rho > math.log1p(self.eps),  # (N,)
            "removed_mass": O.removed_mass(log_rho, coefficients, g),  # (B,)
            "ess": O.group_ess(log_rho, g),  # (B,)
            "rewards": batch.rewards,
            "response_lengths": batch.response_mask.sum(-1),
            "delays": batch.delays(self.global_step),
            "entropy": entropy.detach(),  # (tokens,)
        }
        on_policy = batch.delays(self.global_step) == 0  # (N,): the learner's weights are the behaviour version
        if on_policy.any():
            # Engine/trainer mismatch |l - log pi_theta_s|, measurable where the behaviour version is the current one.
            gap = (batch.behavior_logprobs - logprobs)[on_policy].masked_select(batch.response_mask[on_policy]).abs()
            stats["mismatch/abs_mean"], stats["mismatch/abs_max"] = gap.mean(), gap.max()
        for o in outputs:
            for key, value in o.extra.items():
                stats.setdefault(key, []).append(value.detach())
        return {k: (torch.stack(v).mean() if isinstance(v, list) else v) for k, v in stats.items()}

    def log_step(self, batch: RolloutBatch, loss: Tensor, grad_norm: Tensor, stats: dict[str, Tensor], extra: dict[str, float]) -> None:
        rewards = stats["rewards"]
        zero_var = rewards.view(-1, batch.group_size).std(-1, unbiased=False) == 0
        delays = stats["delays"].float()
        scalars = {
            "train/reward": rewards.mean(),
            "train/loss": loss,
            "train/lr": torch.tensor(self.optimizers().param_groups[0]["lr"]),
            "train/grad_norm": grad_norm,
            "delay/mean": delays.mean(),
            "delay/max": delays.max(),
            "ratio/log_rho_mean": stats["log_rho"].mean(),
            "ratio/log_rho_max": stats["log_rho"].max(),
            "ratio/log_rho_min": stats["log_rho"].min(),
            "ratio/ess_mean": stats["ess"].mean(),
            "gmc/rescaled_fraction": stats["gmc_rescaled"].float().mean(),
            "tic/dropped_fraction": stats["tic_dropped"].float().mean(),
            "correction/removed_mass": stats["removed_mass"].mean(),
            "train/response_length": stats["response_lengths"].float().mean(),
            "train/entropy": stats["entropy"].mean() if stats["entropy"].numel() else torch.tensor(0.0),
            "train/zero_variance_groups": zero_var.float().mean(),
        }
        scalars.update({k: v for k, v in stats.items() if v.dim() == 0 and "/" in k})
        scalars.update({f"schedule/{k}": torch.tensor(v) for k, v in batch.info.items()})
        scalars.update({k: torch.tensor(v) for k, v in extra.items()})
        self.log_dict({k: v.float() for k, v in scalars.items()}, on_step=True, on_epoch=False, prog_bar=False)
        self.log("reward", rewards.mean(), prog_bar=True, on_step=True, logger=False)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        params = [p for p in self.actor.parameters() if p.requires_grad]
        if hp.optimizer == "adamw8bit":
            try:
                import bitsandbytes as bnb
            except ImportError as err:
                raise ImportError("--model.optimizer=adamw8bit needs bitsandbytes: pip install -e '.[vllm]'") from err
            optimizer = bnb.optim.AdamW8bit(params, lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        else:
            optimizer = torch.optim.AdamW(params, lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        total = max(1, self.trainer.max_steps if self.trainer.max_steps > 0 else 1)
        warmup = int(hp.warmup_fraction * total)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(s, total, warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.step_rule is not None:
            checkpoint["step_rule"] = self.step_rule.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.step_rule is not None and "step_rule" in checkpoint:
            self.step_rule.load_state_dict(checkpoint["step_rule"])

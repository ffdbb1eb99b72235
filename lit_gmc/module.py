"""``GMCModule``: the learner. Log-probs of a batch -> a registered correction -> one optimizer step.

The module never talks to a rollout engine: batches arrive from the DataModule with their behaviour
log-probs and versions, and new weights leave through the ``WeightSync`` callback.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.actor import load_actor
from lit_gmc.batch import RolloutBatch
from lit_gmc.corrections import Correction, CorrectionOutput, PolicyTerms
from lit_gmc.distributed import gather_groups, gather_ragged, gather_rows, local_part, rank_and_world, sum_across
from lit_gmc.logprobs import response_logprobs
from lit_gmc.optim import CosineWithWarmup, OptimizerSpec, SchedulerSpec, build_optimizer, build_scheduler
from lit_gmc.options import check_options
from lit_gmc.resume import plain
from lit_gmc.rules.gmc import GMC
from lit_gmc.strategies import FSDP2Strategy  # noqa: F401  (registers --trainer.strategy fsdp2)

DType = Literal["float32", "bfloat16", "float64"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def default_optimizer(parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The configs' optimizer: torch's AdamW with lr 2e-4, betas (0.9, 0.999) and no weight decay."""
    return torch.optim.AdamW(parameters, lr=2e-4, betas=(0.9, 0.999), weight_decay=0.0)


class GMCModule(pl.LightningModule):
    """Off-policy policy-gradient learner for group rollouts (GMC-GRPO and baselines).

    Args:
        actor: ``"tiny"`` (built in code), a transformers hub name, or a local path.
        correction: The off-policy rule: a class of :mod:`lit_gmc.rules` by name (listed below as the known
            subclasses), or a user's :class:`~lit_gmc.corrections.Correction` by import path, with its own options
            (``--model.correction.help GMC``). ``null``: ``GMC`` with the paper's options.
        optimizer: Set with ``--optimizer``; ``null``: torch's AdamW, lr 2e-4, betas (0.9, 0.999), no weight decay.
        lr_scheduler: Set with ``--lr_scheduler``; ``null``: ``CosineWithWarmup`` without warm-up, decaying to 0 at
            ``--trainer.max_steps``.
        max_response_length: ``T``, the loss normaliser (linked to ``--data.max_new_tokens``).
        temperature: Temperature of the behaviour policy (linked to ``--data.sampling.temperature``).
        max_grad_norm: Global gradient-norm clip; ``null`` disables it.
        micro_batch_groups: Groups per forward/backward pass (whole groups, so group statistics are exact).
        logit_chunk_tokens: Response positions per LM-head chunk (bounds logits memory).
        gradient_checkpointing: Recompute backbone activations in backward.
        dtype: Actor parameter dtype: ``float32``, ``bfloat16`` or ``float64``.
    """

    # Options a resume may change (lit_gmc.resume asks the class): memory knobs: the same update up to floating-point
    # summation order.
    may_change_on_resume: ClassVar[frozenset[str]] = frozenset(
        {"micro_batch_groups", "logit_chunk_tokens", "gradient_checkpointing"}
    )

    def __init__(
        self,
        actor: str = "tiny",
        correction: Correction | None = None,
        optimizer: OptimizerSpec | None = None,
        lr_scheduler: SchedulerSpec | None = None,
        max_response_length: int = 6,
        temperature: float = 1.0,
        max_grad_norm: float | None = 1.0,
        micro_batch_groups: int = 8,
        logit_chunk_tokens: int = 512,
        gradient_checkpointing: bool = False,
        dtype: DType = "float32",
    ) -> None:
        super().__init__()
        check_options("model", self.option_problems(max_grad_norm, micro_batch_groups, logit_chunk_tokens, dtype))
        self.save_hyperparameters()
        for key in ("correction", "optimizer", "lr_scheduler"):  # built objects (not through the CLI): their names
            if not isinstance(self.hparams[key], (dict, type(None))):
                self.hparams[key] = plain(self.hparams[key])
        self.automatic_optimization = False  # micro-batched backward, and room for per-step rules
        self.correction = correction if correction is not None else GMC()
        self.optimizer_spec = optimizer if optimizer is not None else default_optimizer
        self.scheduler_spec = lr_scheduler
        self.actor, _ = load_actor(actor, DTYPES[dtype])
        self.actor.train()  # from_pretrained returns eval mode; Lightning expects train mode in fit
        if gradient_checkpointing:
            self.actor.gradient_checkpointing_enable()

    @staticmethod
    def option_problems(
        max_grad_norm: float | None, micro_batch_groups: int, logit_chunk_tokens: int, dtype: str
    ) -> list[str]:
        """Every problem with the module's own options, named by their init args (the rule checks its own)."""
        problems = []
        if max_grad_norm is not None and not max_grad_norm > 0:
            problems.append(f"max_grad_norm={max_grad_norm} must be > 0 (or null for no clipping)")
        if micro_batch_groups < 1:
            problems.append(f"micro_batch_groups={micro_batch_groups} must be >= 1")
        if logit_chunk_tokens < 1:
            problems.append(f"logit_chunk_tokens={logit_chunk_tokens} must be >= 1")
        if dtype not in DTYPES:
            problems.append(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        return problems

    @override
    def configure_model(self) -> None:
        """Under FSDP2 (:class:`~lit_gmc.strategies.FSDP2Strategy`), shard the actor over the data-parallel mesh.

        Each decoder layer (``_no_split_modules``) is one ``fully_shard`` unit, the rest the root unit.
        """
        mesh = self.device_mesh
        if mesh is None or any(isinstance(p, DTensor) for p in self.actor.parameters()):
            return  # not FSDP2, or already sharded (Lightning calls this hook once per fit)
        names = mesh.mesh_dim_names or ()
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                "the learner shards its weights over data-parallel ranks only (FSDP2); tensor parallelism of the "
                "learner is not implemented: use lit_gmc.strategies.FSDP2Strategy (tensor_parallel_size 1)"
            )
        if self.correction.needs_grad_norms:
            raise ValueError(
                f"--model.correction={type(self.correction).__name__} needs the exact gradient norm of every "
                "trajectory, which FSDP2's sharded parameters do not give per row: use --trainer.strategy ddp"
            )
        from torch.distributed.fsdp import fully_shard

        data_parallel = mesh["data_parallel"] if "data_parallel" in names else mesh
        layer_classes = set(getattr(self.actor, "_no_split_modules", None) or ())
        for module in self.actor.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=data_parallel)
        # The root unit is this module, not the actor: log-probs run through `forward` below, which calls the
        # actor's backbone and head separately (never the actor's own forward, which would build full logits).
        fully_shard(self, mesh=data_parallel)

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> tuple[Tensor, Tensor]:
        """Current-policy log-probs and entropies ``(n, L)`` of the response tokens (:func:`response_logprobs`)."""
        return response_logprobs(
            self.actor, input_ids, attention_mask, prompt_width,
            temperature=self.hparams.temperature, chunk_tokens=self.hparams.logit_chunk_tokens,
        )  # fmt: skip

    def trajectory_grad_norms_sq(self, part: RolloutBatch) -> Tensor:
        """Exact ``||grad_theta log pi_theta(y_i | x_i)||^2`` of every row of ``part``: one backward per trajectory.

        Each row, cut to its real tokens, runs alone through ``torch.autograd.grad`` (the step's ``.grad`` is left
        alone; "ghost" norms would need hooks for every layer type). Under FSDP the squared norms would need a sum
        over the shard group. Returns ``(n,)`` detached, in float32 or a wider actor dtype.
        """
        params = [p for p in self.actor.parameters() if p.requires_grad]
        acc = torch.promote_types(params[0].dtype, torch.float32)  # bf16 gradients are squared and summed in fp32
        norms = []
        for row in range(part.rewards.numel()):
            tokens = part.response_mask[row].nonzero()
            if tokens.numel() == 0:  # an empty response has log pi = 0 and no gradient
                norms.append(torch.zeros((), dtype=acc, device=params[0].device))
                continue
            first = int(part.attention_mask[row].nonzero()[0])  # skip the prompt's left padding
            stop = part.prompt_width + int(tokens.max()) + 1  # and the response's right padding
            ids = part.input_ids[row : row + 1, first:stop]  # (1, width)
            attention = part.attention_mask[row : row + 1, first:stop]  # (1, width)
            logprobs, _ = self(ids, attention, part.prompt_width - first)  # (1, length)
            mask = part.response_mask[row : row + 1, : stop - part.prompt_width]  # (1, length)
            grads = torch.autograd.grad(O.sequence_logprob(logprobs, mask).sum(), params, allow_unused=True)
            norms.append(sum(g.to(acc).square().sum() for g in grads if g is not None))
        return torch.stack(norms).detach()  # (n,)

    def micro_batch_loss(
        self, batch: RolloutBatch, part: RolloutBatch, delays: Tensor | None = None
    ) -> tuple[Tensor, CorrectionOutput, Tensor, Tensor]:
        """Loss share of the groups in ``part``, with what the step logs about them (``delays``: ``part``'s, if known).

        Returns the loss share (normalised for the whole ``batch``), the rule's outputs, and the detached
        token entropies and log-probs ``(n, L)`` of the current policy.
        """
        # Before the forward, so that the per-row passes never coexist with this micro-batch's graph.
        norms = self.trajectory_grad_norms_sq(part) if self.correction.needs_grad_norms else None  # (n,) or None
        logprobs, entropy = self(part.input_ids, part.attention_mask, part.prompt_width)  # (n, L), (n, L)
        terms = PolicyTerms(
            token_logprobs=logprobs,
            behavior_logprobs=part.behavior_logprobs.to(logprobs.dtype),
            mask=part.response_mask,
            rewards=part.rewards.to(logprobs.dtype),
            delays=part.delays(self.global_step) if delays is None else delays,
            group_size=part.group_size,
            grad_norms_sq=norms,
        )
        out = self.correction(terms)
        loss = O.aggregate_loss(
            out.token_loss,
            part.response_mask,
            self.correction.aggregation,
            max_length=self.hparams.max_response_length,
            total_sequences=batch.total_rows,
            total_tokens=batch.total_tokens,
        )
        return loss, out, entropy, logprobs.detach()

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> dict[str, Tensor]:
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        delays = batch.delays(self.global_step)  # (n,)
        self.correction.begin_update(delays, self.trainer.max_steps)
        per_pass = self.hparams.micro_batch_groups
        # DDP and FSDP2 average gradients over ranks; each rank's loss is its share of the whole update's loss
        # (global normalisers), so scaling by the world size makes the averaged gradient the whole batch's.
        _, world = rank_and_world()
        # DDP: gradients are all-reduced once, with the last micro-batch; Lightning's block_backward_sync (DDP's
        # no_sync) holds back the others. FSDP2 reduce-scatters each one, which keeps its gradients sharded.
        hold_sync = getattr(self.trainer.strategy, "block_backward_sync", None)
        losses, outputs, entropies, logprobs = [], [], [], []
        starts = range(0, batch.num_groups, per_pass)
        for start in starts:
            stop = min(start + per_pass, batch.num_groups)
            part = batch.groups_slice(start, stop)  # views
            part_delays = delays[start * batch.group_size : stop * batch.group_size]  # (n_part,), a view
            loss, out, entropy, current = self.micro_batch_loss(batch, part, part_delays)
            with hold_sync() if hold_sync is not None and start != starts[-1] else contextlib.nullcontext():
                self.manual_backward(loss * world if world > 1 else loss)
            losses.append(loss.detach())
            outputs.append(out)
            entropies.append(entropy.masked_select(part.response_mask))
            logprobs.append(current)
        stats = self.collect_stats(batch, delays, outputs, torch.cat(entropies), torch.cat(logprobs))
        step, lr = self.global_step, optimizer.param_groups[0]["lr"]
        loss = sum_across(torch.stack(losses).sum())
        # Checked as Python floats, cheaper than a 0-dim torch.isfinite (docs/performance.md); the same sync on a GPU.
        if not math.isfinite(float(loss)):
            raise FloatingPointError(f"update {step}: the loss is {float(loss)}; the weights were not changed")
        logged = self.correction.before_step(list(self.actor.parameters()), optimizer, stats)
        grad_norm = self.clip_and_measure()
        if not math.isfinite(float(grad_norm)):  # the same total on every rank, so every rank stops here
            raise FloatingPointError(
                f"update {step}: the gradient norm is {float(grad_norm)}{self._first_non_finite_grad()}; "
                "the weights were not changed"
            )
        optimizer.step()
        self.correction.after_step(optimizer)
        self.lr_schedulers().step()  # configure_optimizers always gives one (CosineWithWarmup by default)
        self.log_step(step, lr, batch, loss, grad_norm, stats, logged)
        return {"loss": loss, **stats}

    def _first_non_finite_grad(self) -> str:
        """``" (first non-finite in <name>)"`` for the first parameter whose local gradient is not finite, or ``""``."""
        for name, p in self.named_parameters():
            if p.grad is not None and not torch.isfinite(local_part(p.grad)).all():
                return f" (first non-finite in {name})"
        return ""

    def clip_and_measure(self) -> Tensor:
        """Clip the actor's gradients to ``max_grad_norm`` (if set); returns their total norm before clipping."""
        params = [p for p in self.actor.parameters() if p.grad is not None]
        max_norm = self.hparams.max_grad_norm if self.hparams.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP2: the norm of the full gradient

    def collect_stats(
        self, batch: RolloutBatch, delays: Tensor, outputs: list[CorrectionOutput], entropy: Tensor, logprobs: Tensor
    ) -> dict[str, Tensor]:
        """Detached per-row/per-group tensors of this step's whole update (the Diagnostics callback's input).

        ``batch`` is this rank's share (``delays`` its ``(n,)``); values are gathered from every rank in group order.
        """
        rows = {
            "log_rho": torch.cat([o.log_rho for o in outputs]),
            "coefficients": torch.cat([o.coefficients for o in outputs]),
            "advantages": torch.cat([o.advantages for o in outputs]),
            "rewards": batch.rewards,
            "response_lengths": batch.response_mask.sum(-1),
            "delays": delays,
        }  # (n,) each
        rows = {key: value.detach() for key, value in rows.items()}
        stats = gather_groups(rows, batch.update_positions, batch.group_size)  # (N,) each, in the update's order
        log_rho, coefficients, g = stats["log_rho"], stats["coefficients"], batch.group_size
        stats.update(
            {
                "log_rho_bar": O.group_log_mean_ratio(log_rho, g),  # (B,)
                "removed_mass": O.removed_mass(log_rho, coefficients, g),  # (B,)
                "ess": O.group_ess(log_rho, g),  # (B,)
                "entropy": gather_ragged(entropy.detach()),  # (tokens,)
                # log pi_theta - l of every real token: the per-token KL and chi^2 of the Diagnostics callback
                "token_log_ratio": gather_ragged(
                    (logprobs - batch.behavior_logprobs).masked_select(batch.response_mask)
                ),
            }
        )
        # The rule's threshold and the schedule's bookkeeping (queue depth, drain flag), so callbacks need only this
        # dict: 0-dim tensors, made by one call.
        threshold = self.correction.threshold
        scalars = {} if threshold is None else {"correction/eps": float(threshold)}
        scalars.update({f"schedule/{k}": float(v) for k, v in batch.info.items()})
        stats.update(zip(scalars, log_rho.new_tensor(list(scalars.values())).unbind(), strict=True))
        # Engine/trainer mismatch |l - log pi_theta_s|, measurable where the behaviour version is the current one.
        on_policy = delays == 0  # (n,)
        gap = (batch.behavior_logprobs - logprobs)[on_policy]  # (n_on, L)
        gap = gather_ragged(gap.masked_select(batch.response_mask[on_policy]).abs())
        if gap.numel():
            stats["mismatch/abs_mean"], stats["mismatch/abs_max"] = gap.mean(), gap.max()
        extras: dict[str, list[Tensor]] = {}
        for o in outputs:
            for key, value in o.extra.items():
                extras.setdefault(key, []).append(value.detach())
        # One value per micro-batch and rank (every rank runs as many micro-batches), averaged.
        stats.update({key: gather_rows(torch.stack(values)).mean() for key, values in extras.items()})
        return stats

    def log_step(
        self,
        step: int,
        lr: float,
        batch: RolloutBatch,
        loss: Tensor,
        grad_norm: Tensor,
        stats: dict[str, Tensor],
        extra: dict[str, float],
    ) -> None:
        """Per-step scalars of update ``step`` (``lr`` is the scheduled rate it used, before any step rule)."""
        rewards = stats["rewards"]
        delays = stats["delays"].float()
        scalars = {
            "train/reward": rewards.mean(),
            "train/loss": loss,
            "train/grad_norm": grad_norm,
            "delay/mean": delays.mean(),
            "delay/max": delays.max(),
        }  # distributions of ratios, lengths, entropy and the corrections' effect: the Diagnostics callback
        scalars.update({k: v for k, v in stats.items() if v.dim() == 0 and "/" in k})
        # Python numbers go to the loggers as they are (no tensor round trip): they store them as float32.
        values = {k: float(v) for k, v in scalars.items()}
        values.update({"train/lr": float(lr), **{f"schedule/{k}": float(v) for k, v in batch.info.items()}})
        values.update({k: float(v) for k, v in extra.items()})
        # Straight to the loggers rather than self.log: Lightning re-logs the last value of a key on steps that
        # do not log it, which would invent mismatch readings for steps without delay-0 rows (or a first GAC
        # cosine). The step is the one Lightning uses for this batch, the update's index n.
        for logger in self.loggers:
            logger.log_metrics(values, step=step)
        shown = {"reward": values["train/reward"], "delay": values["delay/mean"]}
        if "queue_depth" in batch.info:
            shown["queue"] = float(batch.info["queue_depth"])
        self.log_dict(shown, prog_bar=True, logger=False, batch_size=batch.num_groups)  # the bar's figures only

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """The ``--optimizer`` over the actor's trainable parameters, and the ``--lr_scheduler`` (stepped per update).

        After :meth:`configure_model`, so that under FSDP2 the optimizer holds the sharded parameters.
        """
        params = [p for p in self.actor.parameters() if p.requires_grad]
        optimizer = build_optimizer(self.optimizer_spec, params)
        if self.scheduler_spec is None:
            scheduler = CosineWithWarmup(optimizer, total_steps=max(1, self.trainer.max_steps))
        else:
            scheduler = build_scheduler(self.scheduler_spec, optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["correction"] = self.correction.state_dict()  # GAC's previous gradient, corollary1's moments

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "correction" in checkpoint:
            self.correction.load_state_dict(checkpoint["correction"])

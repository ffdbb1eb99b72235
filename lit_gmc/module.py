"""``GMCModule``: the learner. Log-probs of a batch -> a registered correction -> one optimizer step.

The module never talks to a rollout engine: batches arrive from the DataModule with their behaviour
log-probs and versions, and new weights leave through the ``WeightSync`` callback.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.actor import load_actor
from lit_gmc.batch import RolloutBatch
from lit_gmc.corrections import CORRECTIONS, CorrectionOutput, PolicyTerms
from lit_gmc.distributed import gather_ragged, gather_rows, local_part, rank_and_world, sum_across
from lit_gmc.eps_schedules import build_eps_schedule, validate_eps_schedule_args
from lit_gmc.logprobs import response_logprobs
from lit_gmc.strategies import FSDP2Strategy  # noqa: F401  (registers --trainer.strategy fsdp2)

# Rules whose eps Corollary 1's rate is derived for: GMC's group-mass cap. TIC also has a 1 + eps cap, but it removes
# the mass of trajectories with rho > 1 + eps, a different bias term with no derived rate (see lit_gmc.eps_schedules).
CAPPED_RULES = ("gmc",)
Aggregation = Literal["seq_sum_over_T", "token_mean", "seq_mean_token_mean"]
Optimizer = Literal["adamw", "adamw8bit"]
DType = Literal["float32", "bfloat16", "float64"]
EpsSchedule = Literal["constant", "corollary1"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def validate_model_args(
    *,
    correction: str,
    eps: float | None,
    aggregation: str | None,
    lr: float,
    warmup_fraction: float,
    optimizer: str,
    max_grad_norm: float | None,
    micro_batch_groups: int,
    logit_chunk_tokens: int,
    dtype: str,
    eps_schedule: str = "constant",
) -> list[str]:
    """Every problem with the model options, one line each, named by their CLI flags."""
    problems = []
    if correction not in CORRECTIONS:
        problems.append(f"--model.correction={correction!r} is not one of {', '.join(CORRECTIONS)}")
    elif eps_schedule == "corollary1" and correction not in CAPPED_RULES:
        why = (
            "TIC removes the mass of trajectories with rho > 1 + eps, a different bias term with no derived rate"
            if correction == "tic"
            else "its eps is not that cap (it means something else)"
        )
        problems.append(
            f"--model.eps_schedule=corollary1 is Corollary 1's rate, derived for GMC's group-mass cap, and cannot set "
            f"the eps of --model.correction={correction!r}: {why}; use it with --model.correction="
            f"{' or '.join(CAPPED_RULES)}, or keep --model.eps_schedule=constant"
        )
    if eps is not None and not (eps > 0 and math.isfinite(eps)):
        problems.append(f"--model.eps={eps} must be finite and > 0 (an infinite cap turns GMC or TIC into plain IS)")
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


def joined(parts: list[Tensor]) -> Tensor:
    """``torch.cat(parts)``; the one part itself when there is one (one micro-batch), rather than a copy of it."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
        correction: Off-policy rule from the registry: ``gmc``, ``tic``, ``grpo``, ``is``, ``vcpo``, ``gac``,
            ``a3po``, ``a3po_capped``, ``cispo``, ``tis`` (and any registered). ``a3po`` is A-3PO as the seed
            paper states it (outer factor ``pi_prox / pi_b`` unclipped); ``a3po_capped`` adds AReaL's masking of
            tokens with ``pi_prox / pi_b > 5``.
        eps: Threshold: the ``1 + eps`` cap for GMC/TIC, the PPO clip for GRPO/GAC/A-3PO (both entries), the
            truncation ``c`` for VCPO, ``eps_high`` (cap ``1 + eps``) for CISPO, the cap ``C`` for TIS; ``null``
            takes the rule's default (0.28 for GMC/TIC/CISPO, 0.2 for GRPO/GAC/A-3PO, 8 for VCPO, 2 for TIS).
        aggregation: ``seq_sum_over_T`` (the paper's 1/(T B G)), ``token_mean`` or ``seq_mean_token_mean``;
            ``null`` takes the rule's default.
        eps_schedule: ``constant`` (``eps`` at every update) or ``corollary1``: ``eps_n = clip(eps_scale *
            tau_bar_4^(1/7) * N^(-3/14), eps_min, eps_max)`` from the running fourth delay moment and
            ``N = --trainer.max_steps`` (Corollary 1; ``eps`` is then unused). Logged as ``correction/eps``.
            The rate is derived for GMC's group-mass cap, so ``corollary1`` needs ``--model.correction=gmc``.
        eps_scale: ``c`` of ``corollary1``; 0.375 gives the paper's 0.28 at the tiny default (delay 8, 1,000 updates).
        eps_min: Lower clip of ``corollary1`` (on-policy data would otherwise get ``eps = 0``).
        eps_max: Upper clip of ``corollary1``.
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
        aggregation: Aggregation | None = None,
        eps_schedule: EpsSchedule = "constant",
        eps_scale: float = 0.375,
        eps_min: float = 0.05,
        eps_max: float = 2.0,
        max_response_length: int = 6,
        temperature: float = 1.0,
        lr: float = 2e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        warmup_fraction: float = 0.0,
        optimizer: Optimizer = "adamw",
        max_grad_norm: float | None = 1.0,
        micro_batch_groups: int = 8,
        logit_chunk_tokens: int = 512,
        gradient_checkpointing: bool = False,
        dtype: DType = "float32",
    ) -> None:
        super().__init__()
        problems = validate_model_args(
            correction=correction,
            eps=eps,
            aggregation=aggregation,
            lr=lr,
            warmup_fraction=warmup_fraction,
            optimizer=optimizer,
            max_grad_norm=max_grad_norm,
            micro_batch_groups=micro_batch_groups,
            logit_chunk_tokens=logit_chunk_tokens,
            dtype=dtype,
            eps_schedule=eps_schedule,
        )
        problems += validate_eps_schedule_args(
            eps_schedule=eps_schedule, eps_scale=eps_scale, eps_min=eps_min, eps_max=eps_max
        )
        if problems:
            raise ValueError("invalid model options:\n  " + "\n  ".join(problems))
        self.save_hyperparameters()
        self.automatic_optimization = False  # micro-batched backward, and room for per-step rules
        self.rule = CORRECTIONS[correction]
        self.eps = eps if eps is not None else self.rule.default_eps
        self.eps_schedule = build_eps_schedule(
            eps_schedule, eps=self.eps, eps_scale=eps_scale, eps_min=eps_min, eps_max=eps_max
        )
        self.aggregation = aggregation or self.rule.aggregation
        self.step_rule = self.rule.step_rule() if self.rule.step_rule is not None else None
        self.actor, _ = load_actor(actor, DTYPES[dtype])
        self.actor.train()  # from_pretrained returns eval mode; Lightning expects train mode in fit
        if gradient_checkpointing:
            self.actor.gradient_checkpointing_enable()

    @override
    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets `_current_fx_name` before and after every hook it calls, ~30 times an update. nn.Module's
        # __setattr__ first checks each value against parameters, buffers and submodules (two metaclass isinstance
        # checks, ~2 us); a hook's name is none of them, so it is stored directly, where nn.Module would store it.
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @override
    def configure_model(self) -> None:
        """Under FSDP2 (:class:`~lit_gmc.strategies.FSDP2Strategy`), shard the actor over the data-parallel mesh.

        Each decoder layer is one ``fully_shard`` unit; the embeddings, final norm and head (tied or not) form the
        root unit, gathered for the whole of :meth:`forward`. Under any other strategy the actor stays whole.
        The layers to shard are the classes the transformers model lists in ``_no_split_modules`` (the decoder
        layer for every causal LM in the library), so any hub actor shards the same way.
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
        if self.rule.needs_grad_norms:
            raise ValueError(
                f"--model.correction={self.hparams.correction} needs the exact gradient norm of every trajectory, "
                "which FSDP2's sharded parameters do not give per row: use --trainer.strategy ddp"
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

    def policy_terms(
        self, batch: RolloutBatch, logprobs: Tensor, grad_norms_sq: Tensor | None = None, delays: Tensor | None = None
    ) -> PolicyTerms:
        """The correction rule's inputs: ``logprobs`` of the current policy with the batch's behaviour data.

        ``delays``: the batch's ``(n,)`` delays at this step, when the caller has them already.
        """
        return PolicyTerms(
            token_logprobs=logprobs,
            behavior_logprobs=batch.behavior_logprobs.to(logprobs.dtype),
            mask=batch.response_mask,
            rewards=batch.rewards.to(logprobs.dtype),
            delays=batch.delays(self.global_step) if delays is None else delays,
            group_size=batch.group_size,
            grad_norms_sq=grad_norms_sq,
        )

    def trajectory_grad_norms_sq(self, part: RolloutBatch) -> Tensor:
        """Exact ``||grad_theta log pi_theta(y_i | x_i)||^2`` of every row of ``part``: one backward per trajectory.

        Each row is cut to its real tokens and run alone, so the extra cost is about one forward and backward of
        the micro-batch at batch size 1. ``torch.autograd.grad`` returns the gradients without touching
        ``.grad``, so the step's accumulated gradient is unaffected. Cheaper exact schemes (per-layer "ghost"
        norms from activations and output gradients) need hooks for every layer type, which an arbitrary
        transformers model does not guarantee. Under FSDP the per-row backward is collective and each rank
        holds gradient shards: the squared norms would need an all-reduce (SUM) over the shard group.
        Returns ``(n,)`` detached, in float32 or the actor's dtype if wider.
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
            logprobs, _ = response_logprobs(
                self.actor,
                ids,
                part.attention_mask[row : row + 1, first:stop],
                part.prompt_width - first,
                temperature=self.hparams.temperature,
                chunk_tokens=self.hparams.logit_chunk_tokens,
            )  # (1, length)
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
        norms = self.trajectory_grad_norms_sq(part) if self.rule.needs_grad_norms else None  # (n,) or None
        logprobs, entropy = self(part.input_ids, part.attention_mask, part.prompt_width)  # (n, L), (n, L)
        out = self.rule.fn(self.policy_terms(part, logprobs, norms, delays), self.eps)
        loss = O.aggregate_loss(
            out.token_loss,
            part.response_mask,
            self.aggregation,
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
        self.eps = self.eps_schedule.next_eps(delays, self.trainer.max_steps)
        per_pass = self.hparams.micro_batch_groups
        # DDP and FSDP2 average gradients over ranks; each rank's loss is its share of the whole update's loss
        # (global normalisers), so scaling by the world size makes the averaged gradient the whole batch's.
        _, world = rank_and_world()
        losses, outputs, entropies, logprobs = [], [], [], []
        starts = range(0, batch.num_groups, per_pass)
        for start in starts:
            stop = min(start + per_pass, batch.num_groups)
            # One pass (the tiny default): the batch itself rather than a copy of it sliced tensor by tensor.
            part = batch.groups_slice(start, stop) if len(starts) > 1 else batch
            part_delays = delays[start * batch.group_size : stop * batch.group_size]  # (n_part,), a view
            loss, out, entropy, current = self.micro_batch_loss(batch, part, part_delays)
            # DDP: gradients are all-reduced once, with the last micro-batch (FSDP2 reduce-scatters each one, which
            # keeps its gradients sharded between micro-batches).
            last = start == starts[-1]
            with contextlib.nullcontext() if last else self._without_gradient_sync():
                self.manual_backward(loss * world if world > 1 else loss)
            losses.append(loss.detach())
            outputs.append(out)
            entropies.append(entropy.masked_select(part.response_mask))
            logprobs.append(current)
        stats = self.collect_stats(batch, delays, outputs, joined(entropies), joined(logprobs))
        step, lr = self.global_step, optimizer.param_groups[0]["lr"]
        loss = sum_across(losses[0] if len(losses) == 1 else torch.stack(losses).sum())  # one pass: its loss as is
        # Checked as Python floats: a 0-dim torch.isfinite costs ~10 us, float() ~0.3 (the same sync on a GPU).
        if not math.isfinite(float(loss)):
            raise FloatingPointError(f"update {step}: the loss is {float(loss)}; the weights were not changed")
        logged = self.step_rule.before_step(list(self.actor.parameters()), optimizer, stats) if self.step_rule else {}
        grad_norm = self.clip_and_measure()
        if not math.isfinite(float(grad_norm)):  # the same total on every rank, so every rank stops here
            raise FloatingPointError(
                f"update {step}: the gradient norm is {float(grad_norm)}{self._first_non_finite_grad()}; "
                "the weights were not changed"
            )
        optimizer.step()
        if self.step_rule:
            self.step_rule.after_step(optimizer)
        self.lr_schedulers().step()
        self.log_step(step, lr, batch, loss, grad_norm, stats, logged)
        return {"loss": loss, **stats}

    def _without_gradient_sync(self) -> contextlib.AbstractContextManager:
        """Lightning's DDP gradient-sync block (``DistributedDataParallel.no_sync``); a no-op elsewhere."""
        trainer = self._trainer
        block = getattr(trainer.strategy, "block_backward_sync", None) if trainer is not None else None
        return block() if block is not None else contextlib.nullcontext()

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

        ``batch`` is this rank's share; per-row and per-token values are gathered from every rank in group order,
        so the statistics are those of the whole batch, as in a single-process run. ``delays`` is ``(n,)``.
        """
        rows = {
            "log_rho": joined([o.log_rho for o in outputs]),
            "coefficients": joined([o.coefficients for o in outputs]),
            "advantages": joined([o.advantages for o in outputs]),
            "rewards": batch.rewards,
            "response_lengths": batch.response_mask.sum(-1),
            "delays": delays,
        }  # (n,) each
        stats = {key: gather_rows(value.detach()) for key, value in rows.items()}  # (N,) each
        log_rho, coefficients, g = stats["log_rho"], stats["coefficients"], batch.group_size
        stats.update(
            {
                "log_rho_bar": O.group_log_mean_ratio(log_rho, g),  # (B,)
                "removed_mass": O.removed_mass(log_rho, coefficients, g),  # (B,)
                "ess": O.group_ess(log_rho, g),  # (B,)
                "entropy": gather_ragged(entropy.detach()),  # (tokens,)
            }
        )
        # The rule's eps and the schedule's bookkeeping (queue depth, drain flag), so callbacks need only this dict:
        # 0-dim tensors, made by one call.
        scalars = {"correction/eps": float(self.eps), **{f"schedule/{k}": float(v) for k, v in batch.info.items()}}
        stats.update(zip(scalars, log_rho.new_tensor(list(scalars.values())).unbind(), strict=True))
        # Engine/trainer mismatch |l - log pi_theta_s|, measurable where the behaviour version is the current one.
        on_policy = delays == 0  # (n,)
        gap, mask = batch.behavior_logprobs - logprobs, batch.response_mask  # (n, L) each
        if not on_policy.all():  # all rows fresh (Sync) needs no row copies
            gap, mask = gap[on_policy], mask[on_policy]
        gap = gather_ragged(gap.masked_select(mask).abs())
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
        self.show_on_progress_bar(values, batch.info)

    def show_on_progress_bar(self, values: dict[str, float], info: dict[str, Any]) -> None:
        """Reward, mean delay and queue depth, shown by whichever progress bar the trainer has.

        Written into ``trainer.progress_bar_metrics`` (the dict every Lightning bar reads) rather than through
        ``self.log(..., prog_bar=True)``: three such calls cost ~2 ms an update in Lightning's result collection,
        a few percent of a tiny update, for values that only feed the bar and are already logged above.
        """
        shown = {"reward": values["train/reward"], "delay": values["delay/mean"]}
        if "queue_depth" in info:
            shown["queue"] = float(info["queue_depth"])
        if self._trainer is not None:
            self._trainer.progress_bar_metrics.update(shown)

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
        checkpoint["eps_schedule"] = self.eps_schedule.state_dict()  # corollary1's running delay moments

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.step_rule is not None and "step_rule" in checkpoint:
            self.step_rule.load_state_dict(checkpoint["step_rule"])
        if "eps_schedule" in checkpoint:
            self.eps_schedule.load_state_dict(checkpoint["eps_schedule"])

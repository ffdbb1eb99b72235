"""Publish the policy's weights and version to a rollout engine after optimizer steps.

Reusable in any Lightning project: it needs only a :class:`WeightSink`, passed in or the DataModule's
``weight_sink``, and the name under which the module holds its policy (``prefix``); see ``docs/callbacks.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lit_gmc.distributed import any_rank, full_tensor, wait_for_rank0


@runtime_checkable
class WeightSink(Protocol):
    """Anything that can take new weights, e.g. a rollout engine."""

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> bool | None:
        """Replace the weights in place; ``version`` is the number of optimizer updates they include.

        ``True`` asks for the same weights again (a receiver lost mid-stream, the others waiting for a whole update).
        """


class WeightSync(pl.Callback):
    """After every ``every_n_steps`` optimizer steps, stream ``named_parameters()`` to the sink.

    The version published is ``trainer.global_step``, so delays ``tau = n - s`` mean the same on every rank. The
    weights are also published when training starts, so a resumed run samples from the restored policy.

    Under several processes the sink lives on global rank 0: DDP replicas are identical, so rank 0 sends its own;
    FSDP2 parameters are gathered one at a time (a collective every rank joins) and streamed, so no rank holds a
    second full copy. A sink that returns ``True`` (receivers lost mid-stream) is streamed the same weights again.

    Args:
        sink: Where to send weights; ``None`` takes ``trainer.datamodule.weight_sink`` at setup.
        every_n_steps: Publish period in optimizer steps.
        prefix: Which parameters are the policy: those whose name in ``pl_module.named_parameters()`` starts
            with it, sent with the prefix removed, so the sink sees the names of the wrapped model. The default
            fits a module holding its policy as ``self.actor`` (lit_gmc's ``GMCModule``); a module holding it as
            ``self.policy`` takes ``"policy."``, and ``""`` sends every parameter under its own name. A prefix
            that selects no parameter is an error when training starts (the sink would silently keep its
            initial weights).
        dtype: Cast each tensor to this dtype as it is sent, one at a time; ``None`` sends the parameters as
            they are. The engines cast what they receive to their own dtype anyway, so set to the engine's dtype
            this changes none of the weights the engine ends up with. It matters where the sink keeps copies:
            with fp32 master weights (``bf16-mixed``) the ``live`` schedule stages a full copy of what it is
            sent on the learner's device, 4 bytes per parameter, or 2 with ``bfloat16``.
    """

    def __init__(
        self,
        sink: WeightSink | None = None,
        every_n_steps: int = 1,
        prefix: str = "actor.",
        dtype: Literal["bfloat16", "float16", "float32"] | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16, float32 or None, got {dtype!r}")
        self.sink = sink
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.dtype: torch.dtype | None = getattr(torch, dtype) if dtype is not None else None
        self.last_synced_step = -1

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.sink is None:
            self.sink = getattr(trainer.datamodule, "weight_sink", None)
        if not isinstance(self.sink, WeightSink):
            raise TypeError(
                "WeightSync needs a sink with load_weights(named_tensors, version): pass one, or give the "
                f"DataModule a `weight_sink` attribute (got {type(self.sink).__name__})"
            )
        # Parameters may only exist after configure_model (FSDP2), which runs after this hook: the prefix is
        # checked when training starts, before the first publish.

    def selected_parameters(self, pl_module: pl.LightningModule) -> list[tuple[str, Tensor]]:
        """``(name without prefix, parameter)`` of every parameter under ``prefix``; references, no copies.

        Raises:
            UserError: (a ``ValueError``) If no parameter's name starts with ``prefix``, naming a few of the module's
                parameters.
        """
        cut = len(self.prefix)
        selected = [(name[cut:], p) for name, p in pl_module.named_parameters() if name.startswith(self.prefix)]
        if not selected:
            from lit_gmc.errors import UserError  # an option the user set: lit_gmc's CLI prints it as one line

            names = [name for name, _ in pl_module.named_parameters()]
            shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
            raise UserError(
                f"WeightSync(prefix={self.prefix!r}) would send nothing: no parameter of "
                f"{type(pl_module).__name__} has a name starting with {self.prefix!r} (its parameters: "
                f"{shown or 'none'}). Set prefix to the attribute holding the policy followed by a dot (e.g. "
                "'policy.'), or '' to send every parameter."
            )
        return selected

    def publish(self, pl_module: pl.LightningModule, version: int) -> None:
        """Send the parameters under ``prefix`` (prefix stripped) to the sink, stamped with ``version``."""
        selected = self.selected_parameters(pl_module)

        # A generator, so a gathered or cast copy exists for one tensor at a time, never for the whole model.
        def named_tensors():
            # Rank 0's sink may first wait for a generation in flight; the other ranks wait for it here, on the
            # long-timeout rank-0 channel, rather than in the first gather (a default-group collective under FSDP2).
            wait_for_rank0()
            for name, p in selected:
                yield name, full_tensor(p.detach()) if self.dtype is None else full_tensor(p.detach()).to(self.dtype)

        again = True
        while again:
            named, again = named_tensors(), False
            try:
                if pl_module.global_rank == 0:
                    again = bool(self.sink.load_weights(named, version))
            finally:  # the other ranks (and a sink that stopped early, or failed) still join every gather
                for _ in named:
                    pass
            again = any_rank(again)  # every rank streams again, or none does
        self.last_synced_step = version

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.publish(pl_module, trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step != self.last_synced_step and step % self.every_n_steps == 0:
            self.publish(pl_module, step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_synced_step": self.last_synced_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_synced_step = state_dict["last_synced_step"]

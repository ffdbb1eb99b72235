"""The lab's two policies: read from a run's checkpoints, or trained here from the behaviour policy on its own rollouts.

Trained: ``lit-gmc fit`` on the given config with ``FixedDelay(D)`` for ``D`` updates, ``D`` the largest delay asked
for, so that every update learns from ``theta_b``'s rollouts (the queue is filled from ``theta_0 = theta_b``), at a
constant learning rate (the config's, held: a cosine decay over ``D`` updates would end at 0); its checkpoints at the
asked delays are ``theta_tau``. The run's folder is reused when it was made by the same command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lit_gmc.errors import UserError


@dataclass
class Policy:
    """A loaded policy: its model (eval mode), tokenizer, the update it was saved at (if known) and where from."""

    model: nn.Module
    tokenizer: object
    step: int | None
    source: str


def is_checkpoint(path: str) -> bool:
    """A lit_gmc training checkpoint: a ``.ckpt`` file, or a folder of FSDP2 shards."""
    candidate = Path(path)
    return (candidate.is_file() and candidate.suffix == ".ckpt") or (candidate / ".metadata").is_file()


def load_policy(spec: str, option: str) -> Policy:
    """``spec`` (a checkpoint, a transformers folder, a hub name or ``tiny``), named ``option`` in messages."""
    if is_checkpoint(spec):
        from lit_gmc.export import load_checkpoint_actor
        from lit_gmc.resume import read_checkpoint

        model, tokenizer, _ = load_checkpoint_actor(spec, option=f"{option} {spec}:")
        step = read_checkpoint(Path(spec)).get("global_step") if Path(spec).is_file() else None
    else:
        from lit_gmc.actor import load_actor

        model, tokenizer = load_actor(spec, torch.float32, option=option)
        step = None
    return Policy(model.eval(), tokenizer, step, spec)


def model_problems(behavior: Policy, current: Policy) -> list[str]:
    """Why two policies are not two states of one model (architecture, parameter names and shapes, vocabulary)."""
    problems = []
    a, b = behavior.model.config, current.model.config
    if type(behavior.model) is not type(current.model):
        problems.append(f"{type(behavior.model).__name__} and {type(current.model).__name__}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if getattr(a, key, None) != getattr(b, key, None):
            problems.append(f"{key} {getattr(a, key, None)} and {getattr(b, key, None)}")
    shapes = [{name: tuple(p.shape) for name, p in policy.model.named_parameters()} for policy in (behavior, current)]
    if not problems and shapes[0] != shapes[1]:
        problems.append("different parameters")
    if behavior.tokenizer.get_vocab() != current.tokenizer.get_vocab():
        problems.append("different tokenizers")
    return problems


def check_pair(behavior: Policy, current: Policy, delay: int | None) -> int:
    """The delay ``tau`` between the two (given, or the difference of their checkpoints' updates), checked.

    One :class:`UserError` for two different models, a ``tau`` that cannot be known, is negative, or disagrees with
    the checkpoints' own updates.
    """
    problems = model_problems(behavior, current)
    if problems:
        raise UserError(f"--behavior {behavior.source} and --current {current.source} are not the same model: "
                        f"{'; '.join(problems)}")  # fmt: skip
    steps = (behavior.step, current.step)
    known = None if None in steps else steps[1] - steps[0]
    if delay is None and known is None:
        raise UserError(f"--delay: the delay between --behavior {behavior.source} and --current {current.source} "
                        "is not known from them (not both lit_gmc checkpoints with their update); give it")  # fmt: skip
    tau = known if delay is None else delay
    if tau < 0:
        where = f" (--current is update {steps[1]}, --behavior update {steps[0]})" if known is not None else ""
        raise UserError(f"--delay {tau} < 0: the current policy must come after the behaviour one{where}")
    if known is not None and delay is not None and delay != known:
        raise UserError(f"--delay {delay} disagrees with the checkpoints, updates {steps[0]} and {steps[1]} "
                        f"({known} apart)")  # fmt: skip
    return tau


def fit_command(config: list[str], delays: list[int], folder: Path) -> list[str]:
    """The ``lit-gmc fit`` that trains ``theta_tau`` for every delay, checkpoints ``folder/update-<tau>.ckpt``."""
    steps = max(delays)
    return [sys.executable, "-m", "lit_gmc", "fit", *(arg for path in config for arg in ("--config", path)),
            "--data.schedule", "lit_gmc.data.schedules.base.FixedDelay", "--data.schedule.delay", str(steps),
            "--trainer.max_steps", str(steps), "--trainer.enable_progress_bar", "false",
            "--lr_scheduler", "torch.optim.lr_scheduler.ConstantLR", "--lr_scheduler.factor", "1.0",
            "--lr_scheduler.total_iters", "0",
            "--trainer.logger.init_args.save_dir", str(folder), "--trainer.logger.init_args.name", "fit",
            "--checkpoint.dirpath", str(folder / "checkpoints"), "--checkpoint.filename", "update-{step}",
            "--checkpoint.auto_insert_metric_name", "false", "--checkpoint.every_n_train_steps", "0",
            "--checkpoint.save_last", "false",
            "--checkpoint.at_steps", json.dumps([d for d in delays if d > 0])]  # fmt: skip


def trained_policies(config: list[str], delays: list[int], folder: Path) -> dict[int, Path]:
    """``tau -> checkpoint`` of ``theta_tau`` (none for 0), training them unless ``folder`` holds this command's."""
    command = fit_command(config, delays, folder)
    wanted = {d: folder / "checkpoints" / f"update-{d}.ckpt" for d in delays if d > 0}
    recipe = folder / "fit_command.json"
    if recipe.is_file() and json.loads(recipe.read_text()) == command[1:] and all(p.is_file() for p in wanted.values()):
        return wanted
    if max(delays) == 0:
        return {}
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*wanted.values(), recipe]:
        stale.unlink(missing_ok=True)
    log = folder / "fit.log"
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0 or not all(p.is_file() for p in wanted.values()):
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise UserError(f"training the current policies failed (exit {done.returncode}; {log}):\n{tail}")
    recipe.write_text(json.dumps(command[1:]))
    return wanted

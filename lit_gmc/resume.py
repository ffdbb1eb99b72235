"""Resuming checks its checkpoint: a file that is no lit_gmc checkpoint, or one saved under other settings, is refused.

Every checkpoint records the options of the run that wrote it (:class:`RunSettings`, under
:data:`SETTINGS_KEY`): ``--model.*``, ``--data.*``, ``--optimizer`` and ``--lr_scheduler``, with each
component's class and options (``--model.correction``, ``--model.correction.cap``, ``--data.schedule.delay``,
``--optimizer.lr``, ...) and ``--trainer.precision``. A resume (``fit --ckpt_path``)
compares them with its own and refuses every difference, listed by flag with both values, except these,
which may change because they set how long, how fast, where or how visibly a run goes, not what it computes:

- ``--trainer.max_steps`` (and ``--data.total_updates`` and ``--lr_scheduler.total_steps``, linked to it): a
  finished run may go on;
- everything outside ``model``/``data``/``optimizer``/``lr_scheduler``/``--trainer.precision``: logging,
  callbacks, ``--checkpoint.*``, ``--torch_num_threads``, devices and strategy, ``--seed_everything`` (sampling
  seeds derive from ``--data.seed``, which is compared);
- memory and speed knobs that leave the updates as they are (up to floating-point summation order):
  ``--model.micro_batch_groups``, ``--model.logit_chunk_tokens``, ``--model.gradient_checkpointing``,
  and the component options in :data:`COMPONENT_MAY_CHANGE` (``VirtualClock``'s ``overlap`` and
  ``max_launches``, ``Live``'s ``join_timeout_s``, ``VLLMEngine``'s layout and memory options, ``Math``'s
  ``test_path`` and ``verifier_workers``).

``HFEngine.batch_rows`` is compared: it sets which rows share a sampling seed, so it changes the samples.
Checkpoints written before the settings were recorded are compared on what they hold (the model's and the
DataModule's saved hyperparameters), which leaves out the components.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from jsonargparse import Namespace
from typing_extensions import override

from lit_gmc.errors import UserError, UserFileNotFoundError

SETTINGS_KEY = "lit_gmc_settings"
COMPONENTS = ("task", "engine", "schedule")
# Options built from class_path + init_args: compared class first, then option by option.
COMPONENT_FLAGS = ("--model.correction", "--optimizer", "--lr_scheduler", *(f"--data.{key}" for key in COMPONENTS))
# Options outside the comparison: linked from another option (compared there) or allowed to change.
MAY_CHANGE = frozenset({
    "--data.total_updates",  # linked from --trainer.max_steps: a resumed run may plan more updates
    "--data.refill_on_extend",  # how such a resume continues a drained schedule
    "--lr_scheduler.total_steps",  # likewise (CosineWithWarmup's, filled in from --trainer.max_steps)
    "--data.actor", "--model.max_response_length", "--model.temperature",  # linked: --model.actor, --data.*
    "--model.optimizer", "--model.lr_scheduler",  # linked from --optimizer and --lr_scheduler, compared there
    "--model.micro_batch_groups", "--model.logit_chunk_tokens", "--model.gradient_checkpointing",
})  # fmt: skip
COMPONENT_MAY_CHANGE = {
    "lit_gmc.data.schedules.virtual_clock.VirtualClock": {"overlap", "max_launches"},
    "lit_gmc.data.schedules.live.Live": {"join_timeout_s"},
    "lit_gmc.data.engines.vllm.VLLMEngine": {
        "sleep_between_rollouts", "gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager",
        "enable_prefix_caching",
    },
    "lit_gmc.data.engines.vllm_serve.VLLMServers": {
        "urls", "launch", "devices", "backend", "bucket_bytes", "served_model", "transfer_address", "startup_timeout_s",
        "request_timeout_s", "kv_cache_memory_bytes", "gpu_memory_utilization", "server_args",
    },  # where the servers run and how weights reach them, not what they sample
    "lit_gmc.data.tasks.math.Math": {"test_path", "verifier_workers"},
}  # fmt: skip
# What makes a dict a lit_gmc training checkpoint (a Lightning checkpoint with our DataModule's state).
CHECKPOINT_KEYS = ("pytorch-lightning_version", "state_dict", "hyper_parameters", "RolloutDataModule")
SHARDED_METADATA = "meta.pt"  # what Lightning's distributed checkpoint holds besides the shards


def plain(value: Any) -> Any:
    """``value`` as plain containers, strings and numbers (what ``torch.load(weights_only=True)`` reads back)."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value) and hasattr(value, "__qualname__"):  # an imported function or class: its import path
        return f"{value.__module__}.{value.__qualname__}"
    return str(value)


def run_settings(config: Namespace) -> dict[str, Any]:
    """``flag -> value`` of a parsed ``fit`` config: every model and data option, and the trainer's precision."""
    settings: dict[str, Any] = {}
    for group in ("model", "data"):
        for key, value in vars(config[group]).items():
            settings.update(component_settings(f"--{group}.{key}", value))
    for key in ("optimizer", "lr_scheduler"):
        settings.update(component_settings(f"--{key}", config.get(key)))
    settings["--trainer.precision"] = plain(config.trainer.get("precision"))
    return settings


def component_settings(flag: str, value: Any) -> dict[str, Any]:
    """``{flag: value}``; for a component (``class_path`` + ``init_args``), its class and then each option's flag."""
    value = plain(value)
    if flag not in COMPONENT_FLAGS or not (isinstance(value, dict) and value.get("class_path")):
        return {flag: value}
    options = value.get("init_args") or {}
    return {flag: value["class_path"], **{f"{flag}.{arg}": item for arg, item in options.items()}}


class RunSettings(pl.Callback):
    """Writes the run's :func:`run_settings` into every checkpoint (added by the CLI), for :func:`changed_settings`.

    Args:
        settings: ``flag -> value`` of this run.
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint[SETTINGS_KEY] = self.settings


def saved_settings(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a checkpoint records; for one written before they were, its saved hyperparameters."""
    if SETTINGS_KEY in checkpoint:
        return dict(checkpoint[SETTINGS_KEY])
    saved = {}
    for group, key in (("model", "hyper_parameters"), ("data", "datamodule_hyper_parameters")):
        hparams = checkpoint.get(key) or {}
        saved.update({f"--{group}.{name}": plain(value) for name, value in hparams.items() if not name.startswith("_")})
    return saved


def may_change(flag: str, settings: Mapping[str, Any]) -> bool:
    """Whether ``flag`` may differ on resume (:data:`MAY_CHANGE`, :data:`COMPONENT_MAY_CHANGE`)."""
    if flag in MAY_CHANGE:
        return True
    component, _, option = flag.rpartition(".")
    return option in COMPONENT_MAY_CHANGE.get(settings.get(component), ())


def changed_settings(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``flag: old in the checkpoint, new now`` for every option both record that differs and may not change.

    A component whose class differs is one line; the options of its two classes are not compared.
    """
    swapped = {flag for flag in COMPONENT_FLAGS if saved.get(flag) != now.get(flag)}
    lines = []
    for flag, value in now.items():
        if flag not in saved or saved[flag] == value or may_change(flag, now):
            continue
        if flag.rpartition(".")[0] in swapped:
            continue  # an option of a component whose class changed: the class line says it
        lines.append(f"{flag}: {saved[flag]!r} in the checkpoint, {value!r} now")
    return lines


def checkpoint_file(ckpt_path: str, dirpath: str | None) -> Path | None:
    """The local file ``--ckpt_path`` names, or None where Lightning resolves it (or finds none).

    ``last`` is the newest ``last*.ckpt`` in the checkpoint folder, as Lightning picks it, and None before the
    first checkpoint (the run then starts fresh). A folder is a sharded FSDP2 checkpoint
    (``save_distributed_checkpoint``). Other keywords (``best``, ``hpc``) and URLs are left to Lightning.
    """
    path = Path(ckpt_path)
    if ckpt_path == "last":
        if dirpath is None or not Path(dirpath).is_dir():
            return None
        candidates = [p for p in Path(dirpath).iterdir() if p.suffix == ".ckpt" and re.match(r"last(-\d+)?", p.stem)]
        if not candidates:
            return None
        path = max(candidates, key=lambda p: p.stat().st_mtime)
    elif ckpt_path in ("best", "hpc") or "://" in ckpt_path:
        return None
    return path


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path``, its tensors memory-mapped (not read); a :class:`UserError` when it is none.

    Of a sharded checkpoint (a folder), the ``meta.pt`` that rank 0 writes beside the shards: everything but the
    weights and optimizer states, which are checked by Lightning's loader.
    """
    if not path.exists():
        raise UserFileNotFoundError(f"--ckpt_path {path}: no such file")
    required = CHECKPOINT_KEYS
    if path.is_dir():
        if not (path / SHARDED_METADATA).is_file():
            raise UserError(f"--ckpt_path {path} is not a lit_gmc checkpoint (a folder without {SHARDED_METADATA})")
        path, required = path / SHARDED_METADATA, tuple(key for key in CHECKPOINT_KEYS if key != "state_dict")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch's message would suggest loading the file unsafely: say what it is instead
        raise UserError(f"--ckpt_path {path} is not a lit_gmc checkpoint (torch.load cannot read it as one)") from err
    if not isinstance(checkpoint, dict):
        raise UserError(f"--ckpt_path {path} is not a lit_gmc checkpoint (it holds a {type(checkpoint).__name__})")
    missing = [key for key in required if key not in checkpoint]
    if missing:
        raise UserError(f"--ckpt_path {path} is not a lit_gmc checkpoint (it has no {', '.join(missing)})")
    return checkpoint


def check_resume(ckpt_path: str | None, dirpath: str | None, settings: Mapping[str, Any] | None) -> None:
    """Raise a :class:`UserError` when ``--ckpt_path`` is no lit_gmc checkpoint, or was saved with other settings.

    ``settings`` (this run's :func:`run_settings`; ``None`` skips the comparison) must agree with the
    checkpoint's in every option both record, except those that may change (module docstring).
    """
    path = checkpoint_file(ckpt_path, dirpath) if ckpt_path else None
    if path is None:
        return
    checkpoint = read_checkpoint(path)
    changes = changed_settings(saved_settings(checkpoint), settings) if settings is not None else []
    if changes:
        raise UserError(
            f"--ckpt_path {path} was saved with other settings, and resuming would change the run:\n  "
            + "\n  ".join(changes)
            + "\nResume with the checkpoint's values, or start a new run in another folder (--trainer.logger's name"
            " or --checkpoint.dirpath). The options a resume may change are listed in the README (Resuming)."
        )

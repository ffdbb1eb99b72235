"""Resuming checks its checkpoint: a file that is no lit_gmc checkpoint, or one saved under other settings, is refused.

Every checkpoint records its run's ``--model.*``, ``--data.*``, ``--optimizer``, ``--lr_scheduler`` (class and
options) and ``--trainer.precision`` (:class:`~lit_gmc.run_folder.RunFolder`). A resume refuses every difference, by
flag with both values, except options linked to another (:data:`LINKED`) and those the owning class lists in its
``may_change_on_resume``. Older checkpoints are compared on their saved hyperparameters.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from pkgutil import resolve_name
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_gmc.errors import UserError, UserFileNotFoundError
from lit_gmc.run_folder import SETTINGS_KEY
from lit_gmc.strategies import SHARDED_METADATA, STAGING, beside, restore_set_aside

DATA_COMPONENTS = ("schedule", "engine", "task")  # the DataModule's components, in the order errors name them
# Options built from class_path + init_args: compared class first, then option by option.
COMPONENT_FLAGS = ("--model.correction", "--optimizer", "--lr_scheduler", *(f"--data.{key}" for key in DATA_COMPONENTS))
# Options linked from another option by the CLI (compared there), or set from --trainer.max_steps (which may change).
LINKED = frozenset({
    "--lr_scheduler.total_steps",  # CosineWithWarmup's, filled in from --trainer.max_steps
    "--data.actor", "--model.max_response_length", "--model.temperature",  # linked: --model.actor, --data.*
    "--model.optimizer", "--model.lr_scheduler",  # linked from --optimizer and --lr_scheduler, compared there
})  # fmt: skip
# Options that moved (issue 51): a checkpoint that records one under its old flag is compared under the new one.
RENAMED = {
    "--data.temperature": "--data.sampling.temperature", "--data.top_p": "--data.sampling.top_p",
    "--data.recompute_behavior_logprobs": "--data.engine.recompute_behavior_logprobs",
    "--data.refill_on_extend": "--data.schedule.refill_on_extend",
}  # fmt: skip
# What makes a dict a lit_gmc training checkpoint (a Lightning checkpoint with our DataModule's state).
CHECKPOINT_KEYS = ("pytorch-lightning_version", "state_dict", "hyper_parameters", "RolloutDataModule")


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
    """``{flag: value}``; for a component (``class_path`` + ``init_args``), its class and then each option's flag.

    A group of options (``--data.sampling``) gives each option's flag.
    """
    value = plain(value)
    if isinstance(value, dict) and flag.startswith("--data.") and not value.get("class_path"):
        return {f"{flag}.{key}": item for key, item in value.items()}
    if flag not in COMPONENT_FLAGS or not (isinstance(value, dict) and value.get("class_path")):
        return {flag: value}
    options = value.get("init_args") or {}
    return {flag: value["class_path"], **{f"{flag}.{arg}": item for arg, item in options.items()}}


def saved_settings(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a checkpoint records, under today's flags (:data:`RENAMED`).

    A checkpoint written before settings were recorded gives its saved hyperparameters.
    """
    if SETTINGS_KEY in checkpoint:
        saved = dict(checkpoint[SETTINGS_KEY])
    else:
        saved = {}
        for group, key in (("model", "hyper_parameters"), ("data", "datamodule_hyper_parameters")):
            hparams = checkpoint.get(key) or {}
            saved.update({f"--{group}.{name}": plain(value) for name, value in hparams.items()
                          if not name.startswith("_")})  # fmt: skip
    return {RENAMED.get(flag, flag): value for flag, value in saved.items()}


def may_change(flag: str, settings: Mapping[str, Any], owners: Mapping[str, type]) -> bool:
    """Whether ``flag`` may differ on resume: linked (:data:`LINKED`), or its owner's ``may_change_on_resume``.

    The owner of ``--model.X``/``--data.X`` is ``owners["--model"]``/``owners["--data"]`` (the CLI's module and
    DataModule classes); of a component's option (``--data.schedule.overlap``), the class ``settings`` names.
    """
    if flag in LINKED:
        return True
    owner_flag, _, option = flag.rpartition(".")
    owner = owners.get(owner_flag) or settings.get(owner_flag)
    if isinstance(owner, str):  # a component's class, by the import path the run recorded
        with contextlib.suppress(ImportError, AttributeError, ValueError):
            owner = resolve_name(owner)
    return option in getattr(owner, "may_change_on_resume", ())


def changed_settings(saved: Mapping[str, Any], now: Mapping[str, Any], owners: Mapping[str, type]) -> list[str]:
    """``flag: old in the checkpoint, new now`` for every option both record that differs and may not change.

    A component whose class differs is one line; the options of its two classes are not compared.
    """
    swapped = {flag for flag in COMPONENT_FLAGS if saved.get(flag) != now.get(flag)}
    lines = []
    for flag, value in now.items():
        if flag not in saved or saved[flag] == value or may_change(flag, now, owners):
            continue
        if flag.rpartition(".")[0] in swapped:
            continue  # an option of a component whose class changed: the class line says it
        lines.append(f"{flag}: {saved[flag]!r} in the checkpoint, {value!r} now")
    return lines


def checkpoint_file(ckpt_path: str, dirpath: str | None) -> Path | None:
    """The local file ``--ckpt_path`` names, or None where Lightning resolves it (or finds none).

    ``last`` is the newest ``last*.ckpt`` in the checkpoint folder, as Lightning picks it (None before the first:
    the run starts fresh). A sharded checkpoint that a save killed mid-swap left aside is put back first
    (:func:`~lit_gmc.strategies.restore_set_aside`). Other keywords (``best``, ``hpc``) and URLs are Lightning's.
    """
    if ckpt_path in ("best", "hpc") or "://" in ckpt_path:
        return None
    if ckpt_path == "last" and (dirpath is None or not Path(dirpath).is_dir()):
        return None
    folder = Path(dirpath) if ckpt_path == "last" else Path(ckpt_path).parent
    for line in restore_set_aside(folder) if folder.is_dir() else ():
        warnings.warn(line, stacklevel=2)  # from whichever process put it back, rank 0 or not: one of them does
    if ckpt_path != "last":
        return Path(ckpt_path)
    candidates = [p for p in folder.iterdir() if p.suffix == ".ckpt" and re.match(r"last(-\d+)?", p.stem)]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


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


def check_resume(ckpt_path: str, dirpath: str | None, settings: Mapping[str, Any], owners: Mapping[str, type]) -> None:
    """Raise a :class:`UserError` when ``--ckpt_path`` is no lit_gmc checkpoint, or was saved with other settings.

    ``settings`` (this run's :func:`run_settings`) must agree with the checkpoint's in every option both record,
    except those that may change (:func:`may_change`; ``owners``: the classes of ``--model`` and ``--data``). Warns
    when a later save over the checkpoint was killed before it was put in place.
    """
    path = checkpoint_file(ckpt_path, dirpath)
    if path is None:
        return
    checkpoint = read_checkpoint(path)
    if beside(path, STAGING).exists():
        rank_zero_warn(
            f"--ckpt_path {path}: resuming from its step {checkpoint.get('global_step')}; a later save of it was "
            f"killed before it was put in place ({beside(path, STAGING).name}, removed at the next save)"
        )
    changes = changed_settings(saved_settings(checkpoint), settings, owners)
    if changes:
        raise UserError(
            f"--ckpt_path {path} was saved with other settings, and resuming would change the run:\n  "
            + "\n  ".join(changes)
            + "\nResume with the checkpoint's values, or start a new run in another folder (--trainer.logger's name"
            " or --checkpoint.dirpath). The options a resume may change are listed in docs/usage.md (Extending and"
            " resuming a run)."
        )

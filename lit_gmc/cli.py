"""The LightningCLI of lit_gmc: GMCModule + RolloutDataModule, linked options, one validation pass."""

from __future__ import annotations

import importlib
import inspect
import os
from importlib.resources import files

import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

from lit_gmc.checkpoint import RunCheckpoint
from lit_gmc.data import live, math_task, virtual_clock, vllm_engine  # noqa: F401  (short names: VirtualClock, ...)
from lit_gmc.data.components import component_problems
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.eps_schedules import validate_eps_schedule_args
from lit_gmc.module import GMCModule, validate_model_args

MODEL_VALIDATORS = (validate_model_args, validate_eps_schedule_args)
DATA_COMPONENTS = ("schedule", "engine", "task")


def import_class(class_path: str) -> type:
    """The class named by a dotted ``class_path``."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def collect_problems(config: Namespace) -> list[str]:
    """Every invalid option of a parsed ``fit``/``validate``/... config, one line each, named by its flag."""
    problems = []
    for validate in MODEL_VALIDATORS:  # keyword parameters named like the model's init args
        problems += validate(**{name: config.model[name] for name in inspect.signature(validate).parameters})
    data = {key: value for key, value in vars(config.data).items() if key not in DATA_COMPONENTS}
    problems += component_problems(RolloutDataModule, data, "--data")
    for key in DATA_COMPONENTS:
        spec = config.data[key]
        if isinstance(spec, Namespace) and spec.get("class_path"):
            init_args = spec.get("init_args")
            init_args = init_args.as_dict() if isinstance(init_args, Namespace) else {}
            problems += component_problems(import_class(spec.class_path), init_args, f"--data.{key}")
    return problems


def checkpoint_dir(logger: object) -> str | None:
    """``<save_dir>/<name>/checkpoints`` of a parsed logger config; None when it names no ``save_dir``.

    Fixed for a logger (not per version), so ``--ckpt_path last`` finds the checkpoint from a new version.
    """
    init_args = logger.get("init_args") if isinstance(logger, Namespace) else None
    save_dir = init_args.get("save_dir") if isinstance(init_args, Namespace) else None
    if save_dir is None:
        return None
    return os.path.join(str(save_dir), str(init_args.get("name") or ""), "checkpoints")


def embedded_default() -> str:
    """Path of ``configs/tiny.yaml`` as installed (``lit_gmc.configs``), the defaults every run starts from."""
    return str(files("lit_gmc.configs") / "tiny.yaml")


class GMCCLI(LightningCLI):
    """Links the options that must agree and reports every invalid option in one message.

    Checkpoints come from the ``checkpoint`` group (:class:`~lit_gmc.checkpoint.RunCheckpoint`), whose folder,
    unless ``--checkpoint.dirpath`` is given, follows the logger (``<save_dir>/<name>/checkpoints``), so a config
    fragment that renames the logger moves the checkpoints with it and never has to repeat the callback list.
    """

    def __init__(self, *args, **kwargs) -> None:
        defaults = {"default_config_files": [embedded_default()]}
        kwargs.setdefault("parser_kwargs", {cmd: defaults for cmd in ("fit", "validate", "test", "predict")})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(GMCModule, RolloutDataModule, *args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        parser.link_arguments("model.actor", "data.actor")
        parser.link_arguments("data.max_new_tokens", "model.max_response_length")
        parser.link_arguments("data.temperature", "model.temperature")
        parser.link_arguments("trainer.max_steps", "data.total_updates")
        parser.add_argument(
            "--torch_num_threads",
            type=int | None,
            default=None,
            help="torch intra-op threads for this process (null: torch's default). Tiny models run fastest on 1: "
            "with more, threads spin-wait on each small kernel and a busy machine slows them many times over.",
        )

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.torch_num_threads is not None:
            torch.set_num_threads(config.torch_num_threads)
        if config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = checkpoint_dir(config.trainer.logger)
        problems = collect_problems(config)
        if problems:
            self.parser.error("invalid options:\n  " + "\n  ".join(problems))

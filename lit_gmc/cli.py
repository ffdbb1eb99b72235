"""The LightningCLI of lit_gmc: GMCModule + RolloutDataModule, linked options, one validation pass."""

from __future__ import annotations

import inspect
from importlib.resources import files

import torch
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

from lit_gmc.data.datamodule import RolloutDataModule, validate_data_args
from lit_gmc.eps_schedules import validate_eps_schedule_args
from lit_gmc.module import GMCModule, validate_model_args

# Each validator names the options it checks by its keyword parameters, which are the init args' names.
VALIDATORS = (("model", validate_model_args), ("model", validate_eps_schedule_args), ("data", validate_data_args))


def collect_problems(config) -> list[str]:
    """Every invalid option of a parsed ``fit``/``validate``/... config, one line each."""
    problems = []
    for group, validate in VALIDATORS:
        names = inspect.signature(validate).parameters
        problems += validate(**{name: config[group][name] for name in names})
    return problems


def embedded_default() -> str:
    """Path of ``configs/tiny.yaml`` as installed (``lit_gmc.configs``), the defaults every run starts from."""
    return str(files("lit_gmc.configs") / "tiny.yaml")


class GMCCLI(LightningCLI):
    """Links the options that must agree and reports every invalid option in one message."""

    def __init__(self, *args, **kwargs) -> None:
        defaults = {"default_config_files": [embedded_default()]}
        kwargs.setdefault("parser_kwargs", {cmd: defaults for cmd in ("fit", "validate", "test", "predict")})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(GMCModule, RolloutDataModule, *args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser) -> None:
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
        problems = collect_problems(config)
        if problems:
            self.parser.error("invalid options:\n  " + "\n  ".join(problems))

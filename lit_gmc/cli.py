"""The LightningCLI of lit_gmc: GMCModule + RolloutDataModule, linked options, one validation pass."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import sys
import time
from argparse import ArgumentError
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.profilers import PassThroughProfiler
from typing_extensions import override

from lit_gmc.checkpoint import RunCheckpoint
from lit_gmc.data import live, math_task, virtual_clock, vllm_engine  # noqa: F401  (short names: VirtualClock, ...)
from lit_gmc.data.components import component_problems
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.eps_schedules import validate_eps_schedule_args
from lit_gmc.errors import UserError
from lit_gmc.module import GMCModule, validate_model_args
from lit_gmc.resume import RunSettings, check_resume, run_settings

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


def bad_value(message: str) -> tuple[str, str] | None:
    """``(flag, problem)`` of a parser message about one value of the wrong type, else None.

    ``Parser key "data.schedule": ... Parser key "delay": Expected a <class 'int'>. Got value: abc`` gives
    ``("--data.schedule.delay", "--data.schedule.delay=abc: expected int")``; a union lists each type it tried.
    """
    keys = re.findall(r'Parser key "([^"]+)"', message)
    value = re.search(r"(?:Got|Given) value: (.*)$", message, re.M)
    expected = re.findall(r"Expected a (.+?)(?:\. Got value:|$)", message, re.M)
    if not keys or value is None or not expected:
        return None
    names = [re.sub(r"<class '(?:\w+\.)*(\w+)'>", r"\1", kind).replace("typing.", "") for kind in expected]
    names = [name.replace("NoneType", "null") for name in dict.fromkeys(names)]
    flag = "--" + ".".join(keys)
    return flag, f"{flag}={value[1].strip()}: expected {' or '.join(names)}"


def without_option(argv: list[str], flag: str) -> list[str] | None:
    """``argv`` less the first ``flag VALUE`` or ``flag=VALUE``; None when the command line does not give ``flag``."""
    for index, arg in enumerate(argv):
        if arg == flag:
            return argv[:index] + argv[index + 2 :]
        if arg.startswith(flag + "="):
            return argv[:index] + argv[index + 1 :]
    return None


def config_files(argv: list[str]) -> list[Path]:
    """The ``--config`` files of a command line that exist, in order (later ones override earlier ones)."""
    paths = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]
    paths += [arg.removeprefix("--config=") for arg in argv if arg.startswith("--config=")]
    return [Path(path) for path in paths if Path(path).is_file()]


def yaml_problem(argv: list[str]) -> str | None:
    """``--config FILE: not valid YAML (line, column): problem`` for the first ``--config`` file YAML cannot read."""
    for path in config_files(argv):
        try:
            yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            return f"--config {path}: not valid YAML{where}: {getattr(err, 'problem', None) or err}"
    return None


def setting_file(argv: list[str], flag: str) -> Path | None:
    """The last ``--config`` file that sets ``flag`` (``--data.schedule.delay`` may sit under ``init_args``)."""
    found = None
    for path in config_files(argv):
        with contextlib.suppress(yaml.YAMLError, OSError):
            node = yaml.safe_load(path.read_text(encoding="utf-8"))
            for key in flag.removeprefix("--").split("."):
                if isinstance(node, dict) and key not in node:
                    node = node.get("init_args")
                if not (isinstance(node, dict) and key in node):
                    break
                node = node[key]
            else:
                found = path
    return found


def parse_error_message(message: str, argv: list[str], noted: list[str]) -> str:
    """One message for a parse error, after the ``noted`` bad values; a YAML syntax error names its file."""
    bad = bad_value(message)
    if bad is not None:  # a bad value in a config file, which cannot be dropped like one on the command line
        where = setting_file(argv, bad[0])
        message = bad[1] + (f" (set in {where})" if where else "")
    elif message.startswith("Problems parsing config"):
        message = yaml_problem(argv) or message
    return "\n  ".join(["invalid options:", *noted, message]) if noted else message


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
        # exit_on_error=False: a parse error raises, so that it can be told apart (parse_arguments) and printed as
        # one line by __main__ rather than after the whole usage text.
        defaults = {"default_config_files": [embedded_default()], "exit_on_error": False}
        commands = {cmd: defaults for cmd in ("fit", "validate", "test", "predict")}
        kwargs.setdefault("parser_kwargs", {"exit_on_error": False, **commands})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(GMCModule, RolloutDataModule, *args, **kwargs)

    def subcommand_config(self) -> Namespace:
        """The parsed config of the subcommand (``fit``, ...), or the whole config without one (``run=False``)."""
        return self.config[self.subcommand] if self.subcommand else self.config

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
    def parse_arguments(self, parser, args) -> None:
        """Parse as LightningCLI does, then :meth:`check_config`, before the seed is set or anything is built.

        jsonargparse stops at the first value of the wrong type: each one given on the command line is noted and
        dropped and the rest parsed again, so that all of them are reported with the range problems in one message.
        Any other parse error is one :class:`UserError` (a YAML syntax error names its ``--config`` file).
        """
        argv = None if isinstance(args, (dict, Namespace)) else list(sys.argv[1:] if args is None else args)
        noted: list[str] = []
        while True:
            try:
                self.config = parser.parse_object(args) if argv is None else parser.parse_args(argv)
                break
            except ArgumentError as err:
                bad = bad_value(str(err)) if argv is not None else None
                rest = without_option(argv, bad[0]) if bad else None
                if rest is None:
                    raise UserError(parse_error_message(str(err), argv or [], noted)) from None
                noted.append(bad[1])
                argv = rest
        self.check_config(noted)

    def check_config(self, noted: list[str]) -> None:
        """Raise one :class:`UserError` naming every invalid option (``noted`` first), or the ``--ckpt_path`` problem.

        Also places the checkpoints beside the logger when ``--checkpoint.dirpath`` is not given.
        """
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        if config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = checkpoint_dir(config.trainer.logger)
        problems = noted + collect_problems(config)
        if problems:
            raise UserError("invalid options:\n  " + "\n  ".join(problems))
        if config.get("ckpt_path"):
            settings = run_settings(config) if subcommand == "fit" else None
            check_resume(config.ckpt_path, config.checkpoint.dirpath, settings)

    @override
    def _parse_ckpt_path(self) -> None:
        """Nothing: :func:`~lit_gmc.resume.check_resume` has checked the checkpoint (:meth:`check_config`).

        Lightning's own reads the checkpoint's model options over the command line's (for a file path, not for
        ``last``), so a resume with changed settings would silently run with the old ones, and it fails with a
        bare ``KeyError`` or ``AttributeError`` on a file that is not a checkpoint.
        """

    @override
    def before_instantiate_classes(self) -> None:
        config = self.subcommand_config()
        if config.torch_num_threads is not None:
            torch.set_num_threads(config.torch_num_threads)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        configured = list(configured) if isinstance(configured, list) else [configured]  # the trainer extends it
        trainer = super().instantiate_trainer(**kwargs)
        trainer.callbacks.append(RunSettings(run_settings(self.subcommand_config())))  # read back on resume
        bar = trainer.progress_bar_callback
        if type(bar) is RichProgressBar and not any(c is bar for c in configured):  # Lightning's default bar
            trainer.callbacks[trainer.callbacks.index(bar)] = UpdateProgressBar()
        if type(trainer.profiler) is PassThroughProfiler:  # no --trainer.profiler given
            trainer.profiler = NoProfiler()
        return trainer


class UpdateProgressBar(RichProgressBar):
    """Lightning's rich progress bar, its training bar titled ``updates`` rather than by epoch, redrawn twice a second.

    Its count and metrics are updated at most ``refresh_rate`` times a second too, and always at an epoch's first
    batch and at the epoch's or the run's last one.

    A run is one epoch of rollout batches that ends at ``max_steps``; Lightning then counts ``max_epochs`` as -1
    and the stock bar reads ``Epoch 0/-2``. The bar the trainer makes by default is replaced by this one; a
    progress bar given in ``trainer.callbacks`` is kept as it is.

    Lightning's default ``refresh_rate`` of 100 has a thread build the whole bar after every update of a tiny run
    (~13 a second), drawn or not: ~1.2 ms of CPU an update when the output goes to a file, ~3.4 ms in a terminal,
    against ~0.1 and ~0.5 ms at 2 (``scripts/bench_threads.py``; ``docs/performance.md``, fourth round). Twice a
    second is also the rate at which Lightning's bar redraws its elapsed-time column.
    """

    clock = time.monotonic  # a builtin: not bound as a method

    def __init__(self, refresh_rate: int = 2, **kwargs: Any) -> None:
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self._next_update = 0.0  # the clock's time after which the next batch updates the bar

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._next_update = 0.0  # an epoch's first batch updates the bar
        super().on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Lightning's bar updates its count and metrics after every batch, though they are drawn only refresh_rate
        # times a second: here at most that often, and always at the epoch's or the run's last batch (~0.13 ms an
        # update otherwise, docs/performance.md, fifth round).
        now = self.clock()
        last = batch_idx + 1 >= trainer.num_training_batches or 0 < trainer.max_steps <= trainer.global_step
        if self.is_enabled and self.train_progress_bar_id is not None and now < self._next_update and not last:
            return
        self._next_update = now + 1 / self.refresh_rate if self.is_enabled else 0.0
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return "updates"


class NoProfiler(PassThroughProfiler):
    """Lightning's default profiler (none), whose ``profile`` context costs nothing; the CLI's default.

    Lightning enters ``trainer.profiler.profile(name)`` around every hook of every callback and around each of its
    own steps, ~95 times an update of the tiny job with the default callbacks. The stock profiler's context is a
    generator (``contextlib.contextmanager``), ~2 us to enter and leave for nothing; this one hands back one shared
    ``nullcontext`` (~0.5 us). A profiler given with ``--trainer.profiler`` is kept as it is.
    """

    _NOTHING = contextlib.nullcontext()

    @override
    def profile(self, action_name: str) -> contextlib.nullcontext:
        return self._NOTHING

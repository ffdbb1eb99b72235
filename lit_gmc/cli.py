"""The LightningCLI of lit_gmc: GMCModule + RolloutDataModule, linked options, one validation pass."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
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
from typing_extensions import override

import lit_gmc.rules
from lit_gmc.checkpoint import RunCheckpoint
from lit_gmc.data import live, math_task, virtual_clock, vllm_engine  # noqa: F401  (short names: VirtualClock, ...)
from lit_gmc.data.components import component_problems
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.errors import UserError
from lit_gmc.module import GMCModule, validate_model_args
from lit_gmc.optim import CosineWithWarmup, OptimizerSpec, SchedulerSpec, monitored_schedule_problem
from lit_gmc.resume import RunSettings, check_resume, run_settings

DATA_COMPONENTS = ("schedule", "engine", "task")


def import_class(class_path: str) -> type:
    """The class named by a dotted ``class_path``."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def collect_problems(config: Namespace) -> list[str]:
    """Every invalid option of a parsed ``fit``/``validate``/... config, one line each, named by its flag."""
    names = inspect.signature(validate_model_args).parameters  # keyword parameters named like the model's init args
    problems = validate_model_args(**{name: config.model[name] for name in names})
    problems += class_problems(config.model.correction, "--model.correction")
    data = {key: value for key, value in vars(config.data).items() if key not in DATA_COMPONENTS}
    problems += component_problems(RolloutDataModule, data, "--data")
    for key in DATA_COMPONENTS:
        problems += class_problems(config.data[key], f"--data.{key}")
    problems += unresolved_problems(config.get("optimizer"), "--optimizer")
    problems += unresolved_problems(config.get("lr_scheduler"), "--lr_scheduler")
    scheduler = config.get("lr_scheduler")
    if isinstance(scheduler, Namespace) and scheduler.get("class_path"):
        problems += monitored_schedule_problem(import_class(scheduler.class_path), scheduler.class_path)
    return problems


def unresolved_problems(spec: object, flag: str) -> list[str]:
    """A problem unless a ``--optimizer``/``--lr_scheduler`` kept as a plain dict is a class of a missing package.

    Such an option parses to a dict only when jsonargparse cannot resolve it: a package not installed here (the
    Qwen3 configs' bitsandbytes, refused with one message when the optimizer is built), or a bad class or value.
    """
    if not isinstance(spec, dict):
        return []
    class_path = str(spec.get("class_path") or "")
    package = class_path.partition(".")[0]
    if package and importlib.util.find_spec(package) is None:
        return []
    shown = " ".join(f"{flag}.{key}={value}" for key, value in (spec.get("init_args") or spec).items())
    return [f"{flag} {class_path or '(no class)'}: not a class with these options: {shown}"]


def as_dict(value: object) -> object:
    """A parsed ``Namespace`` as a plain dict (other values as they are)."""
    return value.as_dict() if isinstance(value, Namespace) else value


def class_problems(spec: object, flag: str) -> list[str]:
    """Problems of the options of a component (``class_path`` + ``init_args``) parsed for ``flag``."""
    if not (isinstance(spec, Namespace) and spec.get("class_path")):
        return []
    init_args = spec.get("init_args")
    init_args = init_args.as_dict() if isinstance(init_args, Namespace) else {}
    return component_problems(import_class(spec.class_path), init_args, flag)


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


GMC_ONLY = {"cap_schedule", "cap_scale", "cap_min", "cap_max"}


def foreign_option(message: str) -> tuple[str, str] | None:
    """``(flag, problem)`` of a parser message about an option the chosen component class does not take, else None.

    ``--model.correction GRPO --model.correction.cap 0.3`` gives ``("--model.correction.cap",
    "--model.correction.cap: GRPO has no option cap (its options: clip, aggregation)")``.
    """
    key = re.search(r'Parser key "([^"]+)"', message)
    class_path = re.search(r"class_path '([\w.]+)'", message)
    option = re.search(r"Option '(\w+)' is not accepted", message)
    if key is None or class_path is None or option is None:
        return None
    flag, name = f"--{key[1]}.{option[1]}", class_path[1].rpartition(".")[2]
    with contextlib.suppress(ImportError, AttributeError, ValueError):
        accepted = [p for p in inspect.signature(import_class(class_path[1])).parameters if p not in ("self", "args")]
        name += f" has no option {option[1]} (its options: {', '.join(accepted) or 'none'})"
    if not name.endswith(")"):
        name += f" has no option {option[1]}"
    if key[1] == "model.correction" and option[1] in GMC_ONLY:
        name += "; the Corollary-1 cap schedule is GMC's alone (its rate is derived for GMC's group-mass cap)"
    return flag, f"{flag}: {name}"


def unknown_rule(message: str) -> tuple[str, str] | None:
    """``("--model.correction", problem)`` when the parser could not resolve ``--model.correction`` to a class."""
    if not message.startswith('Parser key "model.correction"') or "NestedArg" in message:
        return None
    bad = bad_value(message)
    if bad is None or bad[0] != "--model.correction":
        return None
    value = bad[1].removeprefix("--model.correction=").split(":", 1)[0]
    rules = ", ".join(sorted(lit_gmc.rules.__all__))  # the built-in ones (a user's are named by import path)
    return bad[0], f"--model.correction={value} is not a rule: one of {rules}, or a Correction subclass's import path"


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
        # --optimizer and --lr_scheduler are the module's init args (add_arguments_to_parser), built by the module in
        # configure_optimizers: LightningCLI's automatic ones are built before FSDP2 shards the actor and replace the
        # module's configure_optimizers, which steps them once per update.
        kwargs.setdefault("auto_configure_optimizers", False)
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
            "--optimizer",
            type=OptimizerSpec | None,
            default=None,
            help="Optimizer class by import path, with its options (--optimizer.lr ...): any torch.optim.Optimizer, "
            "e.g. torch.optim.AdamW or bitsandbytes.optim.AdamW8bit; null: torch's AdamW, lr 2e-4.",
        )
        parser.add_argument(
            "--lr_scheduler",
            type=SchedulerSpec | None,
            default=None,
            help="Learning-rate schedule class, stepped once per update, e.g. lit_gmc.optim.CosineWithWarmup "
            "(--lr_scheduler.warmup_fraction 0.03); null: CosineWithWarmup without warm-up.",
        )
        # As plain dicts: linked as parsed, jsonargparse would merge a new class's options into the previous one's.
        parser.link_arguments("optimizer", "model.optimizer", compute_fn=as_dict)
        parser.link_arguments("lr_scheduler", "model.lr_scheduler", compute_fn=as_dict)
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
            except (AttributeError, ModuleNotFoundError) as err:
                # jsonargparse fails this way swapping a class it cannot import (kept as a plain dict) for another
                if not any(arg.startswith(("--optimizer", "--lr_scheduler")) for arg in argv or []):
                    raise
                raise UserError(
                    f"{err}: an --optimizer or --lr_scheduler class of a package that is not installed here cannot be "
                    "swapped for another directly; give the flag null first (--optimizer null --optimizer "
                    "torch.optim.AdamW ...) or install the package"
                ) from err
            except ArgumentError as err:
                bad = (foreign_option(str(err)) or unknown_rule(str(err)) or bad_value(str(err))) if argv else None
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
        plan_schedule(config)
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
        return trainer


class UpdateProgressBar(RichProgressBar):
    """Lightning's rich progress bar, its training bar titled ``updates`` rather than by epoch.

    A run is one epoch of rollout batches that ends at ``max_steps``; Lightning then counts ``max_epochs`` as -1
    and the stock bar reads ``Epoch 0/-2``. The bar the trainer makes by default is replaced by this one; a
    progress bar given in ``trainer.callbacks`` is kept as it is. ``refresh_rate``: redraw every that many updates.
    """

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return "updates"


def plan_schedule(config: Namespace) -> None:
    """Give ``CosineWithWarmup`` the run's length, ``--trainer.max_steps``, when ``total_steps`` is not set.

    A link by hand: jsonargparse cannot link into the options of a class chosen on the command line.
    """
    scheduler = config.get("lr_scheduler")
    if not (isinstance(scheduler, Namespace) and scheduler.get("class_path")):
        return
    if import_class(scheduler.class_path) is CosineWithWarmup and scheduler.init_args.get("total_steps") is None:
        scheduler.init_args.total_steps = config.trainer.max_steps
        config.model.lr_scheduler = scheduler.as_dict()  # the module's copy, linked before this

"""The LightningCLI of lit_gmc: GMCModule + RolloutDataModule, linked options, one validation pass."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Callable
from importlib.resources import files
from pkgutil import resolve_name
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI
from transformers.utils import logging as transformers_logging
from typing_extensions import override

import lit_gmc
from lit_gmc import preflight
from lit_gmc.actor import context_problem, tiny_alphabet_problem
from lit_gmc.callbacks.progress import ProgressLines
from lit_gmc.checkpoint import RunCheckpoint
from lit_gmc.data.datamodule import RolloutDataModule, TokenizerSetup
from lit_gmc.data.engines import vllm, vllm_serve  # noqa: F401  (the short names VLLMEngine, VLLMServers, ...)
from lit_gmc.data.engines.base import Sampling
from lit_gmc.data.schedules import live, virtual_clock  # noqa: F401
from lit_gmc.data.tasks import addition, math  # noqa: F401
from lit_gmc.data.tasks.base import prompt_problem
from lit_gmc.errors import UserError
from lit_gmc.module import GMCModule
from lit_gmc.optim import (
    CosineWithWarmup,
    OptimizerSpec,
    SchedulerSpec,
    monitored_schedule_problem,
    refused_options,
    unresolved_problems,
)
from lit_gmc.options import component_problems
from lit_gmc.parse_errors import PARSE_ERRORS, given_value, parse_error_message, without_option
from lit_gmc.resume import DATA_COMPONENTS, check_resume, checkpoint_file, read_checkpoint, run_settings
from lit_gmc.run_folder import VERSION_KEY, RunFolder, default_run_name, refuse_earlier_checkpoints

OPTION_OWNERS = {"--model": GMCModule, "--data": RolloutDataModule}  # whose may_change_on_resume a resume asks


def collect_problems(config: Namespace, given_class: Callable[[str], str | None] = lambda flag: None) -> list[str]:
    """Every invalid option of a parsed ``fit``/``validate``/... config, one line each, named by its flag.

    ``given_class(flag)``: the class the command line gives ``--optimizer`` or ``--lr_scheduler``, for messages.
    """
    problems = component_problems(GMCModule, vars(config.model), "--model")
    problems += class_problems(config.model.correction, "--model.correction")
    problems += component_problems(RolloutDataModule, vars(config.data), "--data")
    problems += component_problems(Sampling, vars(config.data.sampling), "--data.sampling")
    for key in DATA_COMPONENTS:
        problems += class_problems(config.data[key], f"--data.{key}")
    problems += unresolved_problems(config.get("optimizer"), "--optimizer", given_class)
    problems += unresolved_problems(config.get("lr_scheduler"), "--lr_scheduler", given_class)
    if (optimizer := component(config.get("optimizer"))) is not None:
        problems += refused_options(*optimizer, "--optimizer")
    every = config.get("progress_every")
    if every is not None and every < 1:
        problems.append(f"--progress_every={every} must be >= 1 (or null: about 1% of the run)")
    if (scheduler := component(config.get("lr_scheduler"))) is not None:
        problems += monitored_schedule_problem(scheduler[0], config.lr_scheduler.class_path)
    return problems


def as_dict(value: object) -> object:
    """A parsed ``Namespace`` as a plain dict (other values as they are)."""
    return value.as_dict() if isinstance(value, Namespace) else value


def component(spec: object) -> tuple[type, dict] | None:
    """``(class, init_args)`` of a parsed ``class_path`` + ``init_args`` option; None for any other value."""
    if not (isinstance(spec, Namespace) and spec.get("class_path")):
        return None
    return resolve_name(spec.class_path), as_dict(spec.get("init_args")) or {}


def class_problems(spec: object, flag: str) -> list[str]:
    """Problems of the options of a component (``class_path`` + ``init_args``) parsed for ``flag``."""
    built = component(spec)
    return [] if built is None else component_problems(*built, flag)


def logger_options(config: Namespace) -> Namespace | None:
    """The ``init_args`` of the parsed ``--trainer.logger``; None for no logger, or one given without options."""
    logger = config.trainer.logger
    init_args = logger.get("init_args") if isinstance(logger, Namespace) else None
    return init_args if isinstance(init_args, Namespace) else None


def embedded_default() -> str:
    """Path of ``configs/tiny.yaml`` as installed (``lit_gmc.configs``), the defaults every run starts from."""
    return str(files("lit_gmc.configs") / "tiny.yaml")


def quiet_startup() -> None:
    """Silence start-up noise that says nothing about the run (idempotent).

    Lightning's product tips, transformers' weight-loading bars (downloads keep huggingface_hub's), and the
    deprecation warning Lightning's own pytree helper raises under torch >= 2.10, which a user cannot act on.
    """
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        # Lightning's tips are about its cloud products (litlogger, litmodels), which lit_gmc never uses.
        logging.getLogger(name).addFilter(lambda record: not str(record.msg).startswith("💡 Tip:"))
    transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


class GMCCLI(LightningCLI):
    """Links the options that must agree and reports every invalid option in one message.

    Checkpoints come from the ``checkpoint`` group (:class:`~lit_gmc.checkpoint.RunCheckpoint`), whose folder follows
    the logger unless ``--checkpoint.dirpath`` is given, so a config that renames the logger moves them too.
    """

    def __init__(self, *args, **kwargs) -> None:
        # exit_on_error=False: a parse error raises, so that it can be told apart (parse_arguments) and printed as
        # one line by __main__ rather than after the whole usage text.
        defaults = {"default_config_files": [embedded_default()], "exit_on_error": False}
        commands = {cmd: defaults for cmd in self.subcommands()}
        # allow_abbrev=False: argparse would take --trainer.max_step 7 as --trainer.max_steps (jsonargparse passes the
        # main parser's setting to its subcommands).
        main_parser = {"exit_on_error": False, "allow_abbrev": False, "prog": "lit_gmc", "description": lit_gmc.__doc__}
        kwargs.setdefault("parser_kwargs", {**main_parser, **commands})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # --optimizer and --lr_scheduler are the module's init args (add_arguments_to_parser), built by the module in
        # configure_optimizers: LightningCLI's automatic ones are built before FSDP2 shards the actor and replace the
        # module's configure_optimizers, which steps them once per update.
        kwargs.setdefault("auto_configure_optimizers", False)
        quiet_startup()
        super().__init__(GMCModule, RolloutDataModule, *args, **kwargs)

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """``fit`` alone of Lightning's: a GMCModule has no validation, test or predict step to run."""
        return {"fit": LightningCLI.subcommands()["fit"]}

    def subcommand_config(self) -> Namespace:
        """The parsed config of the subcommand (``fit``, ...), or the whole config without one (``run=False``)."""
        subcommand = self.config.get("subcommand")  # read from the config: self.subcommand is set after parsing
        return self.config[subcommand] if subcommand else self.config

    @override
    def add_arguments_to_parser(self, parser) -> None:
        self.command_parser = parser  # the subcommand's (fit's) parser, whose option names typos are matched against
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        parser.link_arguments("model.actor", "data.actor")
        parser.link_arguments("data.max_new_tokens", "model.max_response_length")
        parser.link_arguments("data.sampling.temperature", "model.temperature")
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
            "--progress_every",
            type=int | None,
            default=None,
            help="Where stdout is not a terminal (a log file, a pipe, SLURM, CI), print one progress line every this "
            "many updates (update/total, reward and delay over the window, queue depth, updates/s, ETA); null: about "
            "1%% of --trainer.max_steps. In a terminal the live bar is drawn instead.",
        )
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

        jsonargparse stops at the first bad value: each on the command line is noted and dropped and the rest parsed
        again, so all are reported in one message. Any other parse error is one :class:`UserError`.
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
                bad = next(filter(None, (read(str(err)) for read in PARSE_ERRORS)), None) if argv else None
                rest = without_option(argv, bad[0]) if bad else None
                if rest is None:
                    raise UserError(parse_error_message(str(err), argv or [], noted, self.option_names)) from None
                noted.append(bad[1])
                argv = rest
        self.given_argv = argv or []
        self.check_config(noted)

    def option_names(self) -> list[str]:
        """Every option of the subcommand, as dotted keys (``model.correction``, ``data.schedule.delay``, ...)."""
        keys = self.command_parser.get_defaults().keys()
        return sorted({key.replace(".init_args.", ".").removesuffix(".class_path") for key in keys})

    def check_config(self, noted: list[str]) -> None:
        """Raise one :class:`UserError` naming every invalid option (``noted`` first), or the ``--ckpt_path`` problem.

        Also places the checkpoints beside the logger when ``--checkpoint.dirpath`` is not given.
        """
        config = self.subcommand_config()
        derive_options(config)
        problems = noted + collect_problems(config, lambda flag: given_value(self.given_argv, flag))
        if len(problems) == 1:
            raise UserError(problems[0])
        if problems:
            raise UserError("invalid options:\n  " + "\n  ".join(problems))
        if not config.get("ckpt_path"):
            refuse_earlier_checkpoints(config.checkpoint.dirpath)
        else:
            check_resume(config.ckpt_path, config.checkpoint.dirpath, run_settings(config), OPTION_OWNERS)
            continue_logger_version(config)

    @override
    def _parse_ckpt_path(self) -> None:
        """Nothing: :func:`~lit_gmc.resume.check_resume` has checked the checkpoint (:meth:`check_config`).

        Lightning's own puts the checkpoint's model options over the command line's (a changed resume would run
        silently with the old ones) and fails with a bare ``KeyError`` on a file that is not a checkpoint.
        """

    @override
    def instantiate_classes(self) -> None:
        """Build the model, data and trainer once :func:`preflight_problems` finds nothing missing on this machine.

        Then, before a long start, refuse training prompts (of a task that needs no tokenizer) that the tiny actor
        cannot encode or that leave no room for ``--data.max_new_tokens``; the DataModule checks them all again.
        """
        problems = preflight_problems(self.subcommand_config())
        if len(problems) == 1:
            raise UserError(problems[0])
        if problems:
            raise UserError("this machine cannot run this config:\n  " + "\n  ".join(problems))
        super().instantiate_classes()
        task, config = self.datamodule.task, self.subcommand_config()
        if isinstance(task, TokenizerSetup):  # its prompts exist once the engine's tokenizer has set it up
            return
        problem = prompt_problem(type(task).__name__, task.train_prompts())
        prompts = [(prompt.id, prompt.text) for prompt in task.train_prompts()]
        problem = problem or (tiny_alphabet_problem(prompts) if config.model.actor == "tiny" else None)
        if config.data.max_prompt_tokens is None:
            problem = problem or context_problem(config.model.actor, prompts, config.data.max_new_tokens)
        if problem:
            raise UserError(problem)

    @override
    def before_instantiate_classes(self) -> None:
        config = self.subcommand_config()
        if config.torch_num_threads is not None:
            torch.set_num_threads(config.torch_num_threads)

    def before_fit(self) -> None:
        """Take the run folder's lock before ``fit`` starts the logger, so that a refused run writes nothing."""
        for callback in self.trainer.callbacks:
            if isinstance(callback, RunFolder):
                callback.hold(self.trainer)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        configured = list(configured) if isinstance(configured, list) else [configured]  # the trainer extends it
        trainer = super().instantiate_trainer(**kwargs)
        # First, so that a run refused for a folder in use writes nothing there (SaveConfigCallback's config.yaml)
        config = self.subcommand_config()
        trainer.callbacks.insert(0, RunFolder(config.checkpoint.dirpath, run_settings(config)))
        bar = trainer.progress_bar_callback
        if type(bar) is RichProgressBar and not any(c is bar for c in configured):  # Lightning's default bar
            every = config.get("progress_every")
            trainer.callbacks[trainer.callbacks.index(bar)] = default_progress_bar(sys.stdout.isatty(), every)
        return trainer


class FitConfig(GMCCLI):
    """Parses a ``fit`` command line as ``fit`` does, with its derived options, and builds nothing: for ``export``."""

    def __init__(self, args: list[str]) -> None:
        parser = {"default_config_files": [embedded_default()], "exit_on_error": False, "allow_abbrev": False}
        # no seed set (nothing logged): only the config is wanted
        super().__init__(args=[*args, "--seed_everything=false"], run=False, parser_kwargs=parser)

    @override
    def check_config(self, noted: list[str]) -> None:
        derive_options(self.config)

    @override
    def before_instantiate_classes(self) -> None:
        pass

    @override
    def instantiate_classes(self) -> None:
        pass


def derive_options(config: Namespace) -> None:
    """Fill in, in place, what a run derives from its other options (fit's rules, which export follows too).

    A ``null`` logger name becomes ``<task>_<model>`` (:func:`~lit_gmc.run_folder.default_run_name`); without
    ``--checkpoint.dirpath`` the checkpoints go beside the logger; an unset ``CosineWithWarmup.total_steps`` gets
    ``--trainer.max_steps`` (jsonargparse cannot link into a class chosen on the command line).
    """
    logger, task, scheduler = logger_options(config), config.data.task, config.get("lr_scheduler")
    if logger is not None and "name" in logger and logger.name is None:
        task_path = task.class_path if isinstance(task, Namespace) else type(task).__name__
        logger.name = default_run_name(task_path, str(config.model.actor))
    if config.checkpoint.dirpath is None and logger is not None and logger.get("save_dir") is not None:
        # <save_dir>/<name>/checkpoints, not per version, so that --ckpt_path last finds the run's last checkpoint
        config.checkpoint.dirpath = os.path.join(str(logger.save_dir), str(logger.get("name") or ""), "checkpoints")
    schedule = component(scheduler)
    if schedule is not None and schedule[0] is CosineWithWarmup and schedule[1].get("total_steps") is None:
        scheduler.init_args.total_steps = config.trainer.max_steps
        config.model.lr_scheduler = scheduler.as_dict()  # the module's copy, linked before this


def default_progress_bar(terminal: bool, every_n_updates: int | None) -> ProgressBar:
    """The live bar in a terminal; elsewhere (a log file, a pipe) one plain line every ``every_n_updates``."""
    return UpdateProgressBar() if terminal else ProgressLines(every_n_updates)


class UpdateProgressBar(RichProgressBar):
    """Lightning's rich progress bar, its training bar titled ``updates`` rather than by epoch.

    A run is one epoch that ends at ``max_steps``, so the stock bar reads ``Epoch 0/-2``. A progress bar given in
    ``trainer.callbacks`` is kept instead. ``refresh_rate``: redraw every that many updates.
    """

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return "updates"

    @property
    @override
    def total_train_batches(self) -> int | float:
        """``max_steps``: after a resume Lightning counts only the updates left, while the bar counts all of them."""
        return self.trainer.max_steps if self.trainer.max_steps > 0 else super().total_train_batches

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, trainer.global_step - 1)  # updates, not batches

    @override
    def get_metrics(self, trainer: Trainer, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        if "v_num" in metrics:  # the bar formats every number as a float (``v_num: 0.000``)
            metrics["v_num"] = str(metrics["v_num"])
        return metrics


def preflight_problems(config: Namespace) -> list[str]:
    """What the parsed ``config`` needs from this machine and does not find (:mod:`lit_gmc.preflight`), one per line."""
    problems = preflight.accelerator_problems(config.trainer.accelerator, config.trainer.devices)
    if (engine := component(config.data.engine)) is not None:
        problems += preflight.engine_problems(*engine, config.model.actor)
    problems.append(preflight.actor_problem(config.model.actor))
    task = component(config.data.task)
    if task is not None and hasattr(task[0], "preflight_problems"):
        problems += task[0].preflight_problems(**task[1])
    init_args = logger_options(config)
    save_dir = init_args.get("save_dir") if init_args is not None else None
    unwritable = preflight.writable_problem(save_dir and str(save_dir), "--trainer.logger.init_args.save_dir")
    if unwritable is None and config.checkpoint.dirpath is not None:  # (one line when it lies in the logger's)
        unwritable = preflight.writable_problem(str(config.checkpoint.dirpath), "--checkpoint.dirpath")
    problems.append(unwritable)
    return [problem for problem in problems if problem]


def continue_logger_version(config: Namespace) -> None:
    """On resume, log into the checkpoint's logger version (one run in TensorBoard), unless a version is set."""
    path = checkpoint_file(config.ckpt_path, config.checkpoint.dirpath)
    init_args = logger_options(config)
    if path is None or init_args is None or "version" not in init_args:
        return
    version = read_checkpoint(path).get(VERSION_KEY)  # None for checkpoints from before it was recorded
    if init_args.version is None and version is not None:
        init_args.version = version

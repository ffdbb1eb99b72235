"""The optimizer and learning-rate schedule of a run, as LightningCLI components (``--optimizer``, ``--lr_scheduler``).

Any ``torch.optim.Optimizer`` and LR schedule class by import path; the module builds both in
``configure_optimizers`` (after FSDP2 has sharded the actor) and steps them once per update. An optimizer whose
package is not installed here still parses (kept as a dict), so that a Qwen3 config can be read on a machine without
bitsandbytes; building it then fails with one :class:`UserError`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterable, Mapping
from pkgutil import resolve_name
from typing import Any

import torch
from lightning.pytorch.cli import ReduceLROnPlateau
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from transformers import get_cosine_schedule_with_warmup

from lit_gmc.errors import UserError, first_line

OptimizerSpec = Callable[[Iterable], Optimizer] | dict
"""What ``--optimizer`` parses to: a callable of the parameters, or ``{class_path, init_args}`` of a class whose
package cannot be imported here (resolved, or refused with one message, by :func:`build_optimizer`)."""
SchedulerSpec = Callable[[Optimizer], LRScheduler | ReduceLROnPlateau] | dict
"""What ``--lr_scheduler`` parses to: a callable of the optimizer, or ``{class_path, init_args}``."""
EXAMPLE_CLASSES = {"--optimizer": "torch.optim.AdamW", "--lr_scheduler": "lit_gmc.optim.CosineWithWarmup"}


class CosineWithWarmup(LambdaLR):
    """transformers' cosine schedule with linear warm-up, the warm-up given as a fraction of the run.

    transformers gives it as a function returning a ``LambdaLR``, LightningCLI builds schedules from classes: this
    ``LambdaLR`` takes transformers' multiplier, except that warm-up update ``k`` (from 0) takes the one of ``k + 1``,
    so that the first update is not taken at a learning rate of 0. The decay ends at 0 at ``total_steps``.

    Args:
        optimizer: The optimizer whose learning rate is scheduled.
        warmup_fraction: Fraction of ``total_steps`` of linear warm-up (``int(warmup_fraction * total_steps)``
            updates; the Qwen3 configs' 0.03).
        total_steps: Planned number of updates; ``null`` takes ``--trainer.max_steps``.
        last_epoch: ``LambdaLR``'s index of the last step taken (-1: a new schedule).
    """

    def __init__(
        self, optimizer: Optimizer, warmup_fraction: float = 0.0, total_steps: int | None = None, last_epoch: int = -1
    ) -> None:
        if not 0 <= warmup_fraction < 1:
            raise UserError(f"--lr_scheduler.warmup_fraction={warmup_fraction} must be in [0, 1)")
        if total_steps is None or total_steps < 1:
            raise UserError(f"--lr_scheduler.total_steps={total_steps}: CosineWithWarmup needs the planned number of "
                            "updates (set --trainer.max_steps)")  # fmt: skip
        warmup = int(warmup_fraction * total_steps)
        stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # the run's is touched only once
        cosine = get_cosine_schedule_with_warmup(stand_in, warmup, total_steps).lr_lambdas[0]

        def multiplier(step: int) -> float:  # a plain function: LambdaLR leaves it out of its state_dict
            return cosine(step + 1 if step < warmup else step)

        super().__init__(optimizer, multiplier, last_epoch)


def import_class(class_path: str, flag: str) -> type:
    """The class named by ``class_path``; a :class:`UserError` naming ``flag`` and the missing package if none."""
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as err:
        hint = " (pip install bitsandbytes; it needs a CUDA GPU)" if module.startswith("bitsandbytes") else ""
        raise UserError(f"{flag} {class_path}: cannot import {err.name or module}{hint}") from err
    except AttributeError as err:
        raise UserError(f"{flag} {class_path}: {module} has no {name}") from err


def from_spec(spec: Callable | dict, first: Any, flag: str, base: type) -> Any:
    """``spec(first)``, or for a ``{class_path, init_args}`` dict, its class built on ``first`` and the options."""
    if not isinstance(spec, dict):
        return spec(first)
    cls = import_class(str(spec.get("class_path")), flag)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise UserError(f"{flag} {spec.get('class_path')} is not a {base.__module__}.{base.__qualname__}")
    init_args: dict[str, Any] = dict(spec.get("init_args") or {})
    return cls(first, **init_args)


def build_optimizer(spec: OptimizerSpec, parameters: list[torch.nn.Parameter]) -> Optimizer:
    """The optimizer of ``spec`` over ``parameters`` (see :data:`OptimizerSpec`)."""
    return from_spec(spec, parameters, "--optimizer", Optimizer)


def refused_options(cls: type, init_args: dict[str, Any], flag: str) -> list[str]:
    """The problem of options a ``torch.optim`` optimizer refuses (a negative or NaN lr), or none.

    Found by building it over one stand-in parameter while the options are checked, before anything else is built,
    rather than with torch's traceback once the model is loaded. Each option it refuses alone is named.
    """
    if not (isinstance(cls, type) and issubclass(cls, Optimizer) and cls.__module__.startswith("torch.optim")):
        return []  # another package's optimizer may need its device to be built at all (bitsandbytes)

    def refusal(options: dict[str, Any]) -> Exception | None:
        try:
            cls([torch.zeros(1, requires_grad=True)], **options)
        except Exception as err:  # torch raises ValueError for a value out of range, TypeError for a wrong type
            return err
        return None

    err = refusal(init_args)
    if err is None:
        return []
    named = [key for key, value in init_args.items() if refusal({key: value}) is not None] or list(init_args)
    shown = " ".join(f"{flag}.{key}={init_args[key]}" for key in named)
    return [f"{shown}: {cls.__name__} refuses {'it' if len(named) == 1 else 'them'} ({first_line(err)})"]


def unresolved_problems(spec: object, flag: str, given_class: Callable[[str], str | None]) -> list[str]:
    """A problem unless a ``--optimizer``/``--lr_scheduler`` kept as a plain dict is a class of a missing package.

    jsonargparse keeps such an option as a dict for a package not installed here, or for a bad option value
    (``--optimizer.lr nan``), where it drops the class: the command line's (``given_class``) is named then.
    """
    if not isinstance(spec, dict):
        return []
    class_path = str(spec.get("class_path") or given_class(flag) or "")
    package = class_path.partition(".")[0]
    if spec.get("class_path") and importlib.util.find_spec(package) is None:
        return []
    options = spec.get("init_args") or {key: value for key, value in spec.items() if key != "class_path"}
    if not class_path:
        shown = " ".join(f"{flag}.{key}={value}" for key, value in options.items())
        example = f"{flag} {EXAMPLE_CLASSES.get(flag, 'CLASS')} {shown.split()[0]}"
        return [f"{shown}: options without a class; give the class first ({example})"]
    name = class_path.rpartition(".")[2]
    with contextlib.suppress(ImportError, AttributeError, ValueError):
        accepted = inspect.signature(resolve_name(class_path)).parameters
        return [option_problem(flag, name, key, value, accepted) for key, value in options.items()]
    return [f"{flag} {class_path}: not a class ({flag}.{key}={value} given)" for key, value in options.items()]


def option_problem(flag: str, name: str, key: str, value: object, accepted: Mapping[str, inspect.Parameter]) -> str:
    """``--optimizer.lr=nan: not a valid lr of AdamW (float | Tensor)``, or that the class has no such option."""
    if key not in accepted:
        return f"{flag}.{key}: {name} has no option {key} (its options: {', '.join(list(accepted)[1:])})"
    kind = accepted[key].annotation
    kind = getattr(kind, "__name__", None) or str(kind).replace("typing.", "").replace("torch.", "")
    return f"{flag}.{key}={value}: not a valid {key} of {name} ({kind})"


def monitored_schedule_problem(cls: type, class_path: str) -> list[str]:
    """The problem of a schedule class that needs a monitored metric (``ReduceLROnPlateau``), or none.

    The module steps the schedule once per update without a metric, so such a schedule cannot be served.
    """
    if not issubclass(cls, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return []
    return [f"--lr_scheduler {class_path} needs a monitored metric, but lit_gmc steps the schedule once per update "
            "without one: use a step-based schedule (e.g. lit_gmc.optim.CosineWithWarmup)"]  # fmt: skip


def build_scheduler(spec: SchedulerSpec, optimizer: Optimizer) -> LRScheduler:
    """The schedule of ``spec`` on ``optimizer``; one that needs a monitored metric is refused, as the CLI does."""
    scheduler = from_spec(spec, optimizer, "--lr_scheduler", object)
    problems = monitored_schedule_problem(type(scheduler), type(scheduler).__name__)
    if problems:
        raise UserError(problems[0])
    return scheduler

"""What every data component (delay schedule, rollout engine, task) shares: one way to check its options.

A component checks its init args in a static ``option_problems`` named like them: its constructor raises through
:func:`check_options`, and the CLI calls :func:`component_problems` on the parsed config, so that one message
names every bad option of a run before anything is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any


def check_options(owner: str, problems: list[str]) -> None:
    """Raise one ``ValueError`` listing every problem with ``owner``'s options; return if there is none."""
    if problems:
        raise ValueError(f"invalid {owner} options: " + "; ".join(problems))


def component_problems(cls: type, init_args: Mapping[str, Any], flag: str) -> list[str]:
    """Problems of a component of class ``cls`` built with ``init_args``, each prefixed with its ``flag``.

    Init args not given take the constructor's defaults; a class without ``option_problems`` reports nothing here.
    """
    check = getattr(cls, "option_problems", None)
    if check is None:
        return []
    defaults = {name: p.default for name, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}
    values = {**defaults, **dict(init_args)}
    parameters = inspect.signature(check).parameters
    named = {name: p for name, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if any(p.default is p.empty and name not in values for name, p in named.items()):
        return []  # a subclass with other init args: it validates itself when built
    takes_all = len(named) < len(parameters)  # a check with **options (a rule's): every init arg
    problems = check(**(values if takes_all else {name: values[name] for name in named if name in values}))
    return [f"{flag}.{problem}" for problem in problems]

"""The off-policy rules, one class per file; a new rule is one new file here, and nothing else lists it.

Each :class:`~lit_gmc.corrections.Correction` subclass defined in a module here is a rule, reachable as
``lit_gmc.rules.<ClassName>`` and by its class name; :func:`registered` is what ``--help``, the README's table and
the sweep read. A user's own rule is a subclass in the user's module, named by its import path.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from lit_gmc.corrections import Correction


def registered() -> dict[str, type[Correction]]:
    """The rules defined in this package's files, by class name in name order (importing any not imported yet)."""
    rules: dict[str, type[Correction]] = {}
    for module_info in pkgutil.iter_modules(__path__):
        if module_info.name.startswith("_"):  # a shared parent (_token_level), not a rule
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, Correction) and value.__module__ == module.__name__:
                rules[name] = value
    globals().update(rules)  # lit_gmc.rules.GMC: the class path configs and saved runs name
    return dict(sorted(rules.items()))


__all__ = list(registered())

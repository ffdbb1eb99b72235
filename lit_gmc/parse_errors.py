"""Parse errors of the command line, each turned into one line that names its option (and file), for ``lit_gmc.cli``.

jsonargparse stops at the first bad option; these readers recognise its messages about one option (a wrong type, a
class that does not resolve, an option of another class, a reward that does not import), so that the CLI can note
it, drop it and parse the rest again. They read text because jsonargparse's errors carry neither flag nor value;
``pyproject.toml`` pins jsonargparse, and ``tests/test_cli.py`` checks each message shape read here.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import re
import typing
from collections.abc import Callable
from pathlib import Path
from pkgutil import resolve_name

import yaml

import lit_gmc.rules
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.resume import DATA_COMPONENTS, RENAMED


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


GMC_ONLY = {name for name in inspect.signature(lit_gmc.rules.GMC).parameters if name.startswith("cap_")}  # schedule


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
        parameters = inspect.signature(resolve_name(class_path[1])).parameters.values()
        accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        name += f" has no option {option[1]} (its options: {', '.join(accepted) or 'none'})"
    if not name.endswith(")"):
        name += f" has no option {option[1]}"
    if key[1] == "model.correction" and option[1] in GMC_ONLY:
        name += "; the Corollary-1 cap schedule is GMC's alone (its rate is derived for GMC's group-mass cap)"
    if key[1] == "data.task" and option[1] == "chat_template":
        name += "; every task's prompts are wrapped by the DataModule's switch, --data.chat_template true"
    return flag, f"{flag}: {name}"


def unknown_rule(message: str) -> tuple[str, str] | None:
    """``("--model.correction", problem)`` when the parser could not resolve ``--model.correction`` to a class."""
    if not message.startswith('Parser key "model.correction"') or "NestedArg" in message:
        return None
    bad = bad_value(message)
    if bad is None or bad[0] != "--model.correction":
        return None
    value = bad[1].removeprefix("--model.correction=").split(":", 1)[0]
    rules = ", ".join(lit_gmc.rules.registered())  # the built-in ones (a user's are named by import path)
    return bad[0], f"--model.correction={value} is not a rule: one of {rules}, or a Correction subclass's import path"


def unknown_component(message: str) -> tuple[str, str] | None:
    """``(flag, problem)`` when ``--data.schedule``/``engine``/``task`` names no class; it lists the known ones."""
    key = re.match(r'Parser key "data\.(\w+)"', message)
    value = re.search(r"Expected a dot import path string: (\S+)", message)
    if key is None or value is None or key[1] not in DATA_COMPONENTS:
        return None
    base = typing.get_type_hints(RolloutDataModule.__init__)[key[1]]
    known = ", ".join(sorted({cls.__name__ for cls in subclasses(base) if cls.__module__.startswith("lit_gmc.")}))
    return f"--data.{key[1]}", (
        f"--data.{key[1]}={value[1]} is not a class: one of {known}, or a class's import path "
        "(my_project.module.MyClass)"
    )


def subclasses(base: type) -> list[type]:
    """The concrete classes below ``base`` that are imported, at any depth (the CLI names lit_gmc's own)."""
    found = []
    for cls in base.__subclasses__():
        if not inspect.isabstract(cls) and not getattr(cls, "_is_protocol", False):
            found.append(cls)
        found += subclasses(cls)
    return found


def unimportable_function(message: str) -> tuple[str, str] | None:
    """``("--data.reward", "... cannot import X (why)")`` when the reward's import path does not resolve."""
    key = re.match(r'Parser key "(data\.reward)"', message)
    why = re.search(r"expects a function or a callable class: (.*)$", message, re.M)
    value = re.search(r"Given value: (.*)$", message, re.M)
    if key is None or why is None or value is None:
        return None
    path = value[1].strip()
    return "--data.reward", f"--data.reward={path}: cannot import {path} ({why[1].strip()})"


def without_option(argv: list[str], flag: str) -> list[str] | None:
    """``argv`` less the first ``flag VALUE`` or ``flag=VALUE``; None when the command line does not give ``flag``."""
    for index, arg in enumerate(argv):
        if arg == flag:
            return argv[:index] + argv[index + 2 :]
        if arg.startswith(flag + "="):
            return argv[:index] + argv[index + 1 :]
    return None


def given_value(argv: list[str], flag: str) -> str | None:
    """The last value the command line gives ``flag`` (``flag VALUE`` or ``flag=VALUE``), None for none or null."""
    found = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            found = argv[index + 1]
        elif arg.startswith(flag + "="):
            found = arg.removeprefix(flag + "=")
    return None if found in (None, "null", "None") else found


def config_files(argv: list[str]) -> list[Path]:
    """The ``--config`` files of a command line that exist, in order (later ones override earlier ones)."""
    paths = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]
    paths += [arg.removeprefix("--config=") for arg in argv if arg.startswith("--config=")]
    return [Path(path) for path in paths if Path(path).is_file()]


def yaml_problem(argv: list[str]) -> str | None:
    """``--config FILE: not valid YAML (line, column): problem`` for the first ``--config`` file YAML cannot read.

    A file that is valid YAML but no mapping (an empty file) is named too.
    """
    for path in config_files(argv):
        try:
            content = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            return f"--config {path}: not valid YAML{where}: {getattr(err, 'problem', None) or err}"
        if not isinstance(content, dict):
            found = "nothing (an empty file)" if content is None else f"a {type(content).__name__}"
            return f"--config {path}: holds {found}; a config is a mapping of options (trainer:, model:, data:, ...)"
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


# Parse errors about one option, which is noted and dropped so that the rest can be checked too (in this order).
PARSE_ERRORS = (foreign_option, unknown_rule, unknown_component, unimportable_function, bad_value)


def closest(name: str, names: list[str]) -> str:
    """`` (did you mean --a or --b?)`` for the option names closest to ``name`` (dotted keys), else ``""``.

    An option that moved (:data:`~lit_gmc.resume.RENAMED`) gets its new flag instead.
    """
    if (moved := RENAMED.get(f"--{name}")) is not None:
        return f" (it moved: {moved})"
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.75)
    return f" (did you mean {' or '.join('--' + match for match in close)}?)" if close else ""


def unknown_options(message: str, argv: list[str], names: Callable[[], list[str]]) -> str | None:
    """One line per option no class takes, each with the closest valid names; the config file that sets it.

    argparse's ``unrecognized arguments: --trainer.max_step 7`` (a command-line option) and jsonargparse's
    ``Subcommand 'fit' does not accept option 'data.group_sise'`` (a key of a config file).
    """
    if message.startswith("unrecognized arguments: "):
        given = [arg.split("=", 1)[0] for arg in message.removeprefix("unrecognized arguments: ").split()]
        flags = [arg for arg in given if arg.startswith("--")]
        if not flags:
            return None
        known = names()
        return "\n  ".join(f"{flag}: no such option{closest(flag[2:], known)}" for flag in flags)
    key = re.fullmatch(r"Subcommand '\w+' does not accept option '([\w.]+)'", message.strip())
    if key is None:
        return None
    where = setting_file(argv, "--" + key[1])
    return f"--{key[1]}: no such option{closest(key[1], names())}" + (f" (set in {where})" if where else "")


def parse_error_message(
    message: str, argv: list[str], noted: list[str], option_names: Callable[[], list[str]] = list
) -> str:
    """One message for a parse error, after the ``noted`` bad values; a YAML syntax error names its file.

    ``option_names`` gives the parser's options (dotted keys), for the closest names to an unknown option.
    """
    bad = next(filter(None, (read(message) for read in PARSE_ERRORS)), None)
    unknown = unknown_options(message, argv, option_names) if bad is None else None
    if bad is not None:  # a bad value in a config file, which cannot be dropped like one on the command line
        where = setting_file(argv, bad[0])
        message = bad[1] + (f" (set in {where})" if where else "")
    elif unknown is not None:
        message = unknown
    elif message.startswith(("Problems parsing config", "Unexpected config")):
        message = yaml_problem(argv) or message
    return "\n  ".join(["invalid options:", *noted, message]) if noted or "\n" in message else message

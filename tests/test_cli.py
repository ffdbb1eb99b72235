"""The command line: documented options, the overrides users type, one message for all bad options, configs."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docstring_parser import parse as parse_docstring

from lit_gmc.cli import GMCCLI
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.module import GMCModule

REPO = Path(__file__).resolve().parents[1]
LINKED = {("data", "actor"), ("data", "total_updates"), ("model", "max_response_length"), ("model", "temperature")}


class ParseOnlyCLI(GMCCLI):
    """Parses and validates exactly as ``python -m lit_gmc`` does, but builds nothing (no model download)."""

    def instantiate_classes(self) -> None:
        pass

    def _run_subcommand(self, subcommand: str) -> None:
        pass


def parse(*args: str):
    cli = ParseOnlyCLI(args=["fit", *args])
    return cli.config.fit


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("``", "")).strip()


@pytest.fixture(scope="module")
def help_text() -> str:
    out = subprocess.run([sys.executable, "-m", "lit_gmc", "fit", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return normalise(out.stdout)


@pytest.mark.parametrize(("group", "cls"), [("model", GMCModule), ("data", RolloutDataModule)])
def test_help_documents_every_option(help_text, group, cls):
    docs = {p.arg_name: normalise(p.description) for p in parse_docstring(cls.__doc__).params}
    for name in inspect.signature(cls.__init__).parameters:
        if name == "self" or (group, name) in LINKED:
            continue
        assert f"--{group}.{name}" in help_text, f"--{group}.{name} missing from --help"
        assert name in docs and docs[name], f"{cls.__name__} docstring does not document {name}"
        assert docs[name][:40] in help_text, f"--{group}.{name}: its documentation is not shown in --help"


def test_the_overrides_users_type_reach_the_config():
    config = parse("--model.correction", "tic", "--model.eps", "0.28", "--data.schedule", "sync", "--data.delay", "8",
                   "--data.group_size", "4", "--data.batch_prompts", "2", "--data.max_new_tokens", "5",
                   "--trainer.max_steps", "33")  # fmt: skip
    assert (config.model.correction, config.model.eps) == ("tic", 0.28)
    assert (
        config.data.schedule, config.data.delay, config.data.group_size, config.data.batch_prompts
    ) == ("sync", 8, 4, 2)
    # linked: the loss normaliser T is the completion budget, the planned updates are max_steps
    assert config.model.max_response_length == 5
    assert config.data.total_updates == 33


def test_every_bad_option_is_named_in_one_message():
    args = ["--model.correction", "nope", "--model.eps", "0", "--data.group_size", "1", "--data.delay", "-1",
            "--data.batch_prompts", "0", "--data.schedule", "later"]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "lit_gmc", "fit", *args], capture_output=True, text=True, cwd=REPO,
                         timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.count("invalid options") == 1
    for flag in ("--model.correction='nope'", "--model.eps=0", "--data.group_size=1", "--data.delay=-1",
                 "--data.batch_prompts=0", "--data.schedule='later'"):  # fmt: skip
        assert flag in out.stderr, flag


def test_the_embedded_default_applies_without_a_config():
    config = parse()
    assert (config.model.actor, config.model.correction, config.data.task) == ("tiny", "gmc", "addition")


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO) for p in (REPO / "configs").rglob("*.yaml")), ids=str)
def test_every_config_parses_and_validates(path):
    config = parse("--config", str(REPO / path))
    assert config.model.correction and config.data.group_size >= 2


def test_corollary1_threshold_is_refused_for_rules_without_a_cap():
    out = subprocess.run([sys.executable, "-m", "lit_gmc", "fit", "--model.correction", "vcpo", "--model.eps_schedule",
                          "corollary1"], capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "--model.eps_schedule=corollary1" in out.stderr and "'vcpo'" in out.stderr
    assert parse("--model.correction", "tic", "--model.eps_schedule", "corollary1").model.eps_schedule == "corollary1"

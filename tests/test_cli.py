"""The command line: documented options, the overrides users type, one message for all bad options, configs."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from docstring_parser import parse as parse_docstring
from run_helpers import fit, main_error_line, main_stderr

import lit_gmc.__main__ as entry
import lit_gmc.rules
from lit_gmc.cli import GMCCLI
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.data.tasks.math import Math
from lit_gmc.errors import UserError
from lit_gmc.module import GMCModule

REPO = Path(__file__).resolve().parents[1]
LINKED = {("data", "actor"), ("data", "total_updates"), ("model", "max_response_length"), ("model", "temperature"),
          ("model", "optimizer"), ("model", "lr_scheduler")}  # fmt: skip


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
    config = parse("--model.correction", "TIC", "--model.correction.cap", "0.3", "--data.schedule", "Sync",
                   "--data.schedule.inner_steps", "4", "--data.group_size", "4", "--data.batch_prompts", "2",
                   "--data.max_new_tokens", "5", "--trainer.max_steps", "33")  # fmt: skip
    assert config.model.correction.class_path == "lit_gmc.rules.TIC" and config.model.correction.init_args.cap == 0.3
    assert config.data.schedule.class_path == "lit_gmc.data.schedules.base.Sync"
    assert config.data.schedule.init_args.inner_steps == 4
    assert (config.data.group_size, config.data.batch_prompts) == (4, 2)
    # linked: the loss normaliser T is the completion budget, the planned updates are max_steps
    assert config.model.max_response_length == 5
    assert config.data.total_updates == 33


def test_options_of_the_data_components_are_theirs_and_the_old_flags_name_the_new_ones(monkeypatch):
    """Issue 51: the sampling distribution is one group, the behaviour recompute an engine's option, the refill on
    extension a schedule's; the learner's temperature follows the sampling one."""
    config = parse("--data.sampling.temperature", "0.7", "--data.sampling.top_p", "0.9",
                   "--data.engine.recompute_behavior_logprobs", "true",
                   "--data.schedule.refill_on_extend", "false")  # fmt: skip
    assert config.data.sampling.as_dict() == {"temperature": 0.7, "top_p": 0.9} and config.model.temperature == 0.7
    assert config.data.engine.init_args.recompute_behavior_logprobs is True
    assert config.data.schedule.init_args.refill_on_extend is False
    for old, new in (("--data.temperature", "--data.sampling.temperature"), ("--data.top_p", "--data.sampling.top_p"),
                     ("--data.recompute_behavior_logprobs", "--data.engine.recompute_behavior_logprobs"),
                     ("--data.refill_on_extend", "--data.schedule.refill_on_extend")):  # fmt: skip
        value = "0.5" if old in ("--data.temperature", "--data.top_p") else "true"
        line = main_error_line(monkeypatch, "fit", old, value)
        assert line == f"lit_gmc: error: {old}: no such option (it moved: {new})"
    stderr = main_stderr(monkeypatch, "fit", "--data.sampling.temperature", "0", "--data.sampling.top_p", "2")
    assert stderr.splitlines()[-2:] == ["  --data.sampling.temperature=0.0 must be > 0 for training rollouts",
                                        "  --data.sampling.top_p=2.0 must be in (0, 1]"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "class_path", "init_args"),
    [
        (["--data.schedule.delay", "32"], "lit_gmc.data.schedules.base.FixedDelay",
         {"delay": 32, "refill_on_extend": True}),
        (["--data.schedule", "VirtualClock", "--data.schedule.lam", "920"],
         "lit_gmc.data.schedules.virtual_clock.VirtualClock",
         {"c_gen": 85.0, "lam": 920.0, "c_update": 1.0, "max_launches": 400, "overlap": True,
          "refill_on_extend": True}),
        (["--data.schedule", "Live", "--data.schedule.chunk_prompts", "2"], "lit_gmc.data.schedules.live.Live",
         {"workers": 1, "chunk_prompts": 2, "max_staleness": None, "join_timeout_s": 60.0}),
    ],
)
def test_short_forms_pick_a_schedule_with_its_own_options(args, class_path, init_args):
    schedule = parse(*args).data.schedule
    assert schedule.class_path == class_path and schedule.init_args.as_dict() == init_args


def test_an_option_of_another_schedule_cannot_be_given(monkeypatch):
    stderr = main_stderr(monkeypatch, "fit", "--data.schedule", "VirtualClock", "--data.schedule.delay", "32")
    assert "--data.schedule.delay: VirtualClock has no option delay (its options: c_gen, lam," in stderr


def test_closed_choices_are_checked_by_the_parser():
    with pytest.raises(UserError, match=r"--data.engine.layout=sideways: expected Literal\['colocated', 'dedicated'\]"):
        parse("--data.engine", "HFEngine", "--data.engine.layout", "sideways")
    assert parse("--data.engine", "HFEngine", "--data.engine.layout", "dedicated").data.engine.init_args.layout == (
        "dedicated"
    )


def test_every_bad_option_is_named_in_one_message(monkeypatch):
    args = ["--model.correction.cap", "0", "--data.group_size", "1", "--data.schedule.delay", "-1",
            "--data.batch_prompts", "0", "--data.engine.batch_rows", "0", "--data.task.max_operand", "0"]  # fmt: skip
    stderr = main_stderr(monkeypatch, "fit", *args)
    assert stderr.count("invalid options") == 1
    for flag in ("--model.correction.cap=0.0", "--data.group_size=1", "--data.schedule.delay=-1",
                 "--data.batch_prompts=0", "--data.engine.batch_rows=0", "--data.task.max_operand=0"):  # fmt: skip
        assert flag in stderr, flag


def test_the_embedded_default_applies_without_a_config():
    config = parse()
    assert (config.model.actor, config.model.correction.class_path) == ("tiny", "lit_gmc.rules.GMC")
    assert config.optimizer is None  # GMCModule's default: torch's AdamW, lr 2e-4, betas (0.9, 0.999), no decay
    assert config.lr_scheduler.class_path == "lit_gmc.optim.CosineWithWarmup"
    assert config.lr_scheduler.init_args.warmup_fraction == 0.0 and config.lr_scheduler.init_args.total_steps == 2000
    assert config.data.task.class_path == "lit_gmc.data.tasks.addition.Addition"
    assert config.data.engine.class_path == "lit_gmc.data.engines.hf.HFEngine"
    assert (config.data.schedule.class_path, config.data.schedule.init_args.delay) == (
        "lit_gmc.data.schedules.base.FixedDelay", 8)


def test_help_lists_each_components_options(help_text):
    for flag in ("--data.schedule.help", "--data.engine.help", "--data.task.help", "--data.reward",
                 "--checkpoint.at_steps", "--model.correction.help", "--optimizer", "--lr_scheduler"):  # fmt: skip
        assert flag in help_text, flag
    for schedule, option in (("FixedDelay", "delay"), ("Sync", "inner_steps"), ("VirtualClock", "max_launches"),
                             ("Live", "max_staleness")):  # fmt: skip
        # In this process (the fit --help above already ran the entry point): the parser prints and exits 0.
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
            ParseOnlyCLI(args=["fit", "--data.schedule.help", schedule])
        assert exited.value.code == 0 and f"--data.schedule.{option}" in out.getvalue(), schedule


CONFIGS = sorted(p.relative_to(REPO) for p in (REPO / "configs").rglob("*.yaml"))
BASES = [Path("configs/tiny.yaml"), Path("configs/qwen3_4b.yaml")]


@pytest.mark.parametrize("path", CONFIGS, ids=str)
def test_every_config_parses_and_validates(path):
    """Complete configs alone; fragments (model/, experiment/) over each base they are written for."""
    bases = [] if path in BASES else [b for b in BASES if path.parts[1] != "model" or b.name == "qwen3_4b.yaml"]
    for base in bases or [None]:
        layered = ["--config", str(REPO / base)] if base else []
        config = parse(*layered, "--config", str(REPO / path))
        assert config.model.correction and config.data.group_size >= 2


def documented_commands() -> list[list[str]]:
    """Every ``python -m lit_gmc fit ...`` command of README.md, docs/usage.md, docs/reproduce.md and the configs'
    comments, as argument lists.

    Continued lines are joined, comments and ``[optional ...]`` tails dropped, a loop's ``$rule`` set to ``GMC``
    and ``${delay}`` to 128.
    """
    documents = ("README.md", "docs/usage.md", "docs/reproduce.md")
    texts = [(REPO / name).read_text() for name in documents]
    texts += [p.read_text() for p in (REPO / "configs").rglob("*.yaml")]
    commands = []
    for text in texts:
        lines = [line.strip().lstrip("#").strip() for line in text.replace("\\\n", " ").splitlines()]
        for line in lines:
            if line.startswith("python -m lit_gmc fit") and "..." not in line and "help" not in line:
                command = line.split("  #")[0].split(" [")[0].replace("$rule", "GMC").replace("${delay}", "128")
                argv = shlex.split(command)[4:]
                commands.append([a.replace("configs/", str(REPO / "configs") + "/") for a in argv])
    return commands


MY_PROJECT = {
    "__init__.py": "",
    "tasks.py": "from lit_gmc.data.tasks.base import Addition\n\n\nclass MyTask(Addition):\n    pass\n",
    "rewards.py": "def exact_match(completions, answer):\n    return [float(c == answer) for c in completions]\n",
}


@pytest.mark.parametrize("argv", documented_commands(), ids=" ".join)
def test_every_documented_command_line_parses(argv, tmp_path, monkeypatch):
    package = tmp_path / "my_project"  # the README's plug-in example names a user's package
    package.mkdir()
    for name, text in MY_PROJECT.items():
        (package / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = parse(*argv)
    assert config.data.total_updates == config.trainer.max_steps


def test_corollary1_cap_schedule_is_refused_for_rules_other_than_gmc(monkeypatch):
    args = ("--model.correction", "TIC", "--model.correction.cap_schedule", "corollary1")
    stderr = main_stderr(monkeypatch, "fit", *args)
    assert "--model.correction.cap_schedule: TIC has no option cap_schedule" in stderr
    assert "group-mass cap" in stderr
    gmc = parse("--model.correction.cap_schedule", "corollary1").model.correction
    assert (gmc.class_path, gmc.init_args.cap_schedule) == ("lit_gmc.rules.GMC", "corollary1")


def test_an_option_of_one_rule_given_to_another_is_refused_naming_it():
    with pytest.raises(UserError) as refused:
        parse("--model.correction", "GRPO", "--model.correction.cap", "0.3", "--data.group_size", "1")
    assert str(refused.value).splitlines() == [
        "invalid options:",
        "  --model.correction.cap: GRPO has no option cap (its options: clip, aggregation)",
        "  --data.group_size=1 must be >= 2 (group advantages need two responses)",
    ]


@pytest.mark.parametrize(
    ("rule", "option", "value"),
    [("GMC", "cap", 0.3), ("TIC", "cap", 0.3), ("GRPO", "clip", 0.25), ("VCPO", "c", 4.0), ("CISPO", "eps_high", 0.3),
     ("TIS", "C", 3.0), ("A3PO", "behavior_cap", 5.0), ("GAC", "cosine_high", 0.4)],
)  # fmt: skip
def test_each_rule_takes_its_own_threshold_and_keeps_its_authors_aggregation(rule, option, value):
    """Switching rules never carries the previous rule's aggregation over (the embedded default is GMC's)."""
    correction = parse("--model.correction", rule, f"--model.correction.{option}", str(value)).model.correction
    assert correction.class_path == f"lit_gmc.rules.{rule}"
    assert correction.init_args[option] == value and correction.init_args.aggregation is None
    built = getattr(lit_gmc.rules, rule)(**correction.init_args.as_dict())
    authors = {"GMC": "seq_sum_over_T", "TIC": "seq_sum_over_T", "GRPO": "seq_mean_token_mean",
               "VCPO": "seq_mean_token_mean", "GAC": "seq_mean_token_mean"}  # fmt: skip
    assert built.aggregation == authors.get(rule, "token_mean")


def test_optimizer_and_schedule_options_reach_the_module():
    config = parse("--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.05", "--lr_scheduler.warmup_fraction", "0.1",
                   "--trainer.max_steps", "30")  # fmt: skip
    sgd = {"class_path": "torch.optim.SGD", "init_args": config.optimizer.init_args.as_dict()}
    assert config.model.optimizer == sgd
    assert config.model.optimizer["init_args"]["lr"] == 0.05
    assert config.model.lr_scheduler["init_args"] == {"warmup_fraction": 0.1, "total_steps": 30, "last_epoch": -1}
    with pytest.raises(UserError, match="ReduceLROnPlateau needs a monitored metric"):
        parse("--lr_scheduler", "torch.optim.lr_scheduler.ReduceLROnPlateau")
    with pytest.raises(UserError, match=r"^--optimizer.lr=x: options without a class; give the class first"):
        parse("--optimizer.lr", "x")
    with pytest.raises(UserError, match=r"^--optimizer.lr=x: not a valid lr of SGD \(float \| Tensor\)$"):
        parse("--optimizer", "torch.optim.SGD", "--optimizer.lr", "x")


def test_the_qwen3_optimizer_parses_without_bitsandbytes_and_building_it_is_one_message():
    config = parse("--config", str(REPO / "configs" / "qwen3_4b.yaml"))
    spec = {"class_path": "bitsandbytes.optim.AdamW8bit", "init_args": {"lr": 1e-6, "betas": [0.9, 0.999],
                                                                         "weight_decay": 0.0}}  # fmt: skip
    assert config.model.optimizer == spec
    assert config.model.lr_scheduler["init_args"]["warmup_fraction"] == 0.03
    if importlib.util.find_spec("bitsandbytes") is None:
        from lit_gmc.optim import build_optimizer

        with pytest.raises(UserError, match="--optimizer bitsandbytes.optim.AdamW8bit: cannot import bitsandbytes"):
            build_optimizer(spec, [torch.nn.Parameter(torch.zeros(1))])
        with pytest.raises(UserError, match="give the flag null first"):
            parse("--config", str(REPO / "configs" / "qwen3_4b.yaml"), "--optimizer", "torch.optim.AdamW")
    cpu = parse("--config", str(REPO / "configs" / "qwen3_4b.yaml"), "--optimizer", "null", "--optimizer",
                "torch.optim.AdamW", "--optimizer.lr", "1e-6")  # fmt: skip
    assert cpu.model.optimizer["class_path"] == "torch.optim.AdamW"


def test_type_errors_and_range_errors_are_reported_together():
    with pytest.raises(UserError) as refused:
        parse("--data.group_size", "abc", "--model.max_grad_norm=x", "--model.correction.cap", "none?",
              "--data.schedule.delay", "soon", "--data.batch_prompts", "0", "--model.correction", "nope")  # fmt: skip
    assert str(refused.value).splitlines() == [
        "invalid options:",
        "  --data.group_size=abc: expected int",
        "  --model.max_grad_norm=x: expected float or null",
        "  --model.correction.cap=none?: expected float or null",
        "  --data.schedule.delay=soon: expected int",
        "  --model.correction=nope is not a rule: one of A3PO, CISPO, DPPO, GAC, GMC, GRPO, GSPO, GeoMIS, GeoTIS, IS, "
        "IcePop, M2PO, SeqMIS, SeqTIS, TIC, TIS, VCPO, or a Correction subclass's import path",
        "  --data.batch_prompts=0 must be >= 1",
    ]


def test_config_file_errors_name_the_file(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  lr: [1,\n")
    with pytest.raises(UserError, match=rf"^--config {broken}: not valid YAML \(line 3, column 1\)"):
        parse("--config", str(broken))
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  schedule:\n    init_args:\n      delay: soon\n")
    with pytest.raises(UserError, match=rf"^--data.schedule.delay=soon: expected int \(set in {typo}\)$"):
        parse("--config", str(typo))


def test_a_user_error_is_one_line_with_status_2_and_a_bug_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    done = subprocess.run([sys.executable, "-m", "lit_gmc", "fit", "--data.task", "Math", "--data.task.path",
                           str(tmp_path / "absent.jsonl")], capture_output=True, text=True, cwd=REPO,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.splitlines()[-1]  # found missing before anything loads, naming its option
    assert last.startswith(f"lit_gmc: error: --data.task.path {tmp_path / 'absent.jsonl'}: no such file or folder")

    def bug(argv):
        raise RuntimeError("a bug")

    monkeypatch.setattr(entry, "run", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        entry.main()
    monkeypatch.setattr(entry, "run", lambda argv: Math(path=str(tmp_path / "absent.jsonl")))
    with pytest.raises(SystemExit) as stopped:
        entry.main()
    assert stopped.value.code == 2 and capsys.readouterr().err.startswith("lit_gmc: error: data not found")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"problem": "1+1", "solution": "2"}\n{"problem": oops\n', r"bad\.jsonl:2: not valid JSON"),
        ('{"problem": "1+1"}\n', r"bad\.jsonl: no column 'solution' in any row"),
        ('{"problem": "1+1", "solution": "2"}\n{"problem": "2+2", "solution": null}\n', r"bad\.jsonl:2: missing field"),
    ],
    ids=["malformed", "no-solution-column", "row-without-solution"],
)
def test_data_file_errors_are_user_errors(tmp_path, text, message):
    (tmp_path / "bad.jsonl").write_text(text)
    with pytest.raises(UserError, match=message):
        Math(path=str(tmp_path / "bad.jsonl"), verifier_workers=1)


class BuildOnlyCLI(GMCCLI):
    """Builds the model, data and trainer exactly as ``python -m lit_gmc fit`` does, but does not fit."""

    def _run_subcommand(self, subcommand: str) -> None:
        pass


def test_the_default_progress_bar_counts_updates_and_a_configured_one_is_kept(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.profilers import PassThroughProfiler

    from lit_gmc.cli import UpdateProgressBar

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)  # in a terminal (tests/test_progress.py: elsewhere)
    trainer = BuildOnlyCLI(args=["fit", "--trainer.max_steps", "3"]).trainer
    bar = trainer.progress_bar_callback
    assert type(bar) is UpdateProgressBar and bar._get_train_description(0) == "updates"
    assert type(trainer.profiler) is PassThroughProfiler  # Lightning's own default, untouched
    args = ["fit", "--trainer.max_steps", "3", "--trainer.callbacks+=RichProgressBar",
            "--trainer.callbacks.refresh_rate=7"]  # fmt: skip
    kept = BuildOnlyCLI(args=args).trainer.progress_bar_callback
    assert type(kept) is RichProgressBar and kept.refresh_rate == 7


@pytest.mark.slow
def test_any_torch_optimizer_runs_a_tiny_fit(tmp_path):
    """SGD trains two updates (it used to crash: no schedule to step). A rule's option in a fit (GRPO's clip) is
    ``tests/test_e2e.py``'s."""
    from run_helpers import write_config

    from lit_gmc.tblog import read_scalars

    cli = fit(write_config(tmp_path, "run", total=2), "--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.01")
    assert cli.trainer.global_step == 2
    values = [value for _, value in read_scalars(tmp_path / "run")["train/lr"]]
    assert type(cli.trainer.optimizers[0]) is torch.optim.SGD
    assert values == pytest.approx([0.01 * 0.5 * (1 + math.cos(math.pi * s / 2)) for s in range(2)])


def main_error(monkeypatch, *argv: str) -> str:
    """What ``lit_gmc.__main__.main`` prints on stderr for ``argv``, once it has exited with status 2."""
    monkeypatch.setattr("sys.argv", ["lit_gmc", *argv])
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    with pytest.raises(SystemExit) as stop:
        entry.main()
    assert stop.value.code == 2, stderr.getvalue()[-2000:]
    return stderr.getvalue().strip()


def test_option_names_are_never_abbreviated_and_a_typo_gets_the_closest_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main_error(monkeypatch, "fit", "--trainer.max_step", "7") == (
        "lit_gmc: error: --trainer.max_step: no such option (did you mean --trainer.max_steps or --trainer.max_time "
        "or --trainer.min_steps?)"
    )  # argparse would have run 7 updates, taking it for --trainer.max_steps
    assert main_error(monkeypatch, "fit", "--model.corection", "TIC", "--data.group_sise=4").splitlines() == [
        "lit_gmc: error: invalid options:",
        "  --model.corection: no such option (did you mean --model.correction or --model.correction.cap or "
        "--model.correction.cap_min?)",
        "  --data.group_sise: no such option (did you mean --data.group_size?)",
    ]
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  group_sise: 4\n")
    assert main_error(monkeypatch, "fit", "--config", str(typo)) == (
        f"lit_gmc: error: --data.group_sise: no such option (did you mean --data.group_size?) (set in {typo})"
    )
    assert not (tmp_path / "runs").exists()


def test_optimizer_options_torch_refuses_are_one_line_naming_the_option_and_class(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    adamw = ("fit", "--optimizer", "torch.optim.AdamW")
    assert main_error(monkeypatch, *adamw, "--optimizer.lr", "-1") == (
        "lit_gmc: error: --optimizer.lr=-1.0: AdamW refuses it (Invalid learning rate: -1.0)"
    )  # checked with the options, not torch's traceback once the model is built
    assert main_error(monkeypatch, *adamw, "--optimizer.lr", "nan") == (
        "lit_gmc: error: --optimizer.lr=nan: not a valid lr of AdamW (float | Tensor)"
    )  # jsonargparse keeps the options and drops the class it could not build: the command line's is named
    assert main_error(monkeypatch, *adamw, "--optimizer.lr=-1", "--optimizer.eps=-1") == (
        "lit_gmc: error: --optimizer.lr=-1.0 --optimizer.eps=-1.0: AdamW refuses them (Invalid learning rate: -1.0)"
    )
    assert main_error(monkeypatch, "fit", "--optimizer.lr", "-1") == (
        "lit_gmc: error: --optimizer.lr=-1: options without a class; give the class first (--optimizer "
        "torch.optim.AdamW --optimizer.lr=-1)"
    )
    assert not (tmp_path / "runs").exists()


def test_a_run_refused_for_a_folder_in_use_writes_nothing(tmp_path, monkeypatch):
    from lit_gmc.run_folder import lock_folder

    monkeypatch.chdir(tmp_path)
    held = lock_folder(tmp_path / "runs" / "addition_tiny" / "checkpoints")  # another run's, as flock sees it
    try:
        assert main_error(monkeypatch, "fit", "--trainer.max_steps", "2").startswith(
            "lit_gmc: error: --checkpoint.dirpath runs/addition_tiny/checkpoints: another run (pid "
        )
    finally:
        held.close()
    assert [path.name for path in (tmp_path / "runs" / "addition_tiny").iterdir()] == [
        ".checkpoints.lit_gmc.lock"  # the other run's lock; no TensorBoard version_0
    ]


def test_help_and_export_help_import_neither_torch_nor_lightning():
    probe = (
        "import sys, contextlib, io\nfrom lit_gmc.__main__ import run\n"
        "for argv in (['--help'], ['export', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "        run(argv)\n"
        "    print(argv[0], 'usage: lit_gmc' in out.getvalue())\n"
        "print(sorted(name for name in ('torch', 'lightning', 'transformers') if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.stdout.splitlines() == ["--help True", "export True", "[]"], done.stderr[-2000:]


class ParserBuilt(Exception):
    def __init__(self, parser) -> None:
        self.parser = parser


class RawParser(GMCCLI):
    """Builds fit's parser and hands it over: jsonargparse's own messages, before lit_gmc reads them."""

    def parse_arguments(self, parser, args) -> None:
        raise ParserBuilt(parser)


@pytest.fixture(scope="module")
def raw_parser():
    with pytest.raises(ParserBuilt) as built:
        RawParser(args=["fit"])
    return built.value.parser


def raw_message(parser, *argv: str) -> str:
    from argparse import ArgumentError

    with pytest.raises(ArgumentError) as raised:
        parser.parse_args(["fit", *argv])
    return str(raised.value)


@pytest.mark.parametrize(
    ("argv", "reader", "read"),
    [
        (["--data.schedule.delay", "soon"], "bad_value",
         ("--data.schedule.delay", "--data.schedule.delay=soon: expected int")),
        (["--model.correction", "GRPO", "--model.correction.cap", "0.3"], "foreign_option",
         ("--model.correction.cap", "--model.correction.cap: GRPO has no option cap (its options: clip, aggregation)")),
        (["--model.correction", "nope"], "unknown_rule",
         ("--model.correction", "--model.correction=nope is not a rule: one of ")),
        (["--data.engine", "Nope"], "unknown_component", ("--data.engine", "--data.engine=Nope is not a class: one of "
         "HFEngine, VLLMEngine, VLLMServers, or a class's import path (my_project.module.MyClass)")),
        (["--data.reward", "no_such_module.reward"], "unimportable_function", ("--data.reward",
         "--data.reward=no_such_module.reward: cannot import no_such_module.reward")),
    ],
    ids=["bad-value", "foreign-option", "unknown-rule", "unknown-component", "unimportable-function"],
)  # fmt: skip
def test_each_jsonargparse_message_shape_read_is_still_the_installed_release_s(raw_parser, argv, reader, read):
    """parse_errors reads jsonargparse's text where its errors carry no flag: a release that rewords one fails here."""
    import lit_gmc.parse_errors as parse_errors

    found = getattr(parse_errors, reader)(raw_message(raw_parser, *argv))
    assert found is not None and found[0] == read[0] and found[1].startswith(read[1]), found


def test_the_unknown_option_messages_read_are_still_the_installed_release_s(raw_parser, tmp_path):
    from lit_gmc.parse_errors import unknown_options

    names = ["trainer.max_steps", "data.group_size"]
    message = raw_message(raw_parser, "--trainer.max_step", "7")
    assert unknown_options(message, [], lambda: names) == (
        "--trainer.max_step: no such option (did you mean --trainer.max_steps?)"
    )
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  group_sise: 4\n")
    argv = ["--config", str(typo)]
    assert unknown_options(raw_message(raw_parser, *argv), argv, lambda: names) == (
        f"--data.group_sise: no such option (did you mean --data.group_size?) (set in {typo})"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [\n")
    assert raw_message(raw_parser, "--config", str(broken)).startswith(("Problems parsing config", "Unexpected config"))


def test_the_private_lightning_methods_lit_gmc_overrides_are_still_called():
    """GMCCLI._parse_ckpt_path and UpdateProgressBar._get_train_description override private Lightning methods
    (pyproject.toml pins the Lightning range): a release that renames or stops calling them fails here."""
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.cli import LightningCLI

    assert "self._parse_ckpt_path()" in inspect.getsource(LightningCLI.__init__)
    assert list(inspect.signature(LightningCLI._parse_ckpt_path).parameters) == ["self"]
    assert "self._get_train_description(" in inspect.getsource(RichProgressBar)
    assert list(inspect.signature(RichProgressBar._get_train_description).parameters) == ["self", "current_epoch"]


def test_the_cli_offers_fit_export_and_estimate_under_its_own_name(capsys, monkeypatch):
    from lit_gmc.__main__ import run

    with pytest.raises(SystemExit) as shown_help:
        run(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert shown_help.value.code == 0 and shown.startswith("usage: lit_gmc [-h] {fit,export,estimate} ...")
    assert "fit train a policy on stale rollouts" in shown and "export write a checkpoint's policy" in shown
    assert "estimate measure every rule's update against the true gradient" in shown
    assert main_error_line(monkeypatch, "fti") == (
        "lit_gmc: error: fti is not a command: one of fit, export, estimate (lit-gmc --help); did you mean fit?"
    )
    assert main_error_line(monkeypatch) == "lit_gmc: error: give a command: fit or export or estimate (lit-gmc --help)"
    with pytest.raises(UserError, match="invalid choice: 'validate' \\(choose from 'fit'\\)"):
        GMCCLI(args=["validate"])

"""A user's first hour: progress lines in logs, samples in TensorBoard, reward functions checked, parse errors named."""

from __future__ import annotations

import io
import re
import textwrap
import warnings

import pytest
from run_helpers import fit, write_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_gmc.callbacks.progress import ProgressLines, default_every, duration, progress_line
from lit_gmc.callbacks.samples import Samples, samples_table
from lit_gmc.cli import GMCCLI, default_progress_bar
from lit_gmc.data.tasks.addition import Addition
from lit_gmc.data.tasks.reward import Reward
from lit_gmc.errors import UserError


def test_a_progress_line_carries_update_window_means_queue_rate_and_eta():
    line = progress_line(40, 2000, {"reward": 0.23125, "delay": 8.0}, {"queue": 7.0}, rate=1.52)
    # 1960 updates left at 1.52 updates/s: 1289.47 s = 21 min 29 s
    assert line == "update 40/2000 (2%) | reward 0.231 | delay 8.0 | queue 7 | 1.52 updates/s | ETA 21m 29s"
    assert duration(3725) == "1h 02m" and duration(42.4) == "42s"
    assert default_every(2000) == 20 and default_every(30) == 1
    assert "ETA" not in progress_line(1, 10, {}, {}, rate=0.0)  # no rate measured yet: no ETA guessed


def test_the_bar_is_chosen_by_the_terminal():
    assert type(default_progress_bar(True, None)).__name__ == "UpdateProgressBar"
    lines = default_progress_bar(False, 5)
    assert isinstance(lines, ProgressLines) and lines.every_n_updates == 5
    with pytest.raises(ValueError, match="every_n_updates=0"):
        ProgressLines(0)


def test_samples_table_escapes_what_markdown_would_break():
    table = samples_table(["1+2="], ["3|\n4"], [1.0], [8])
    assert table.splitlines()[-1] == "| 1+2= | 3\\|<br>4 | 1.000 | 8 |"


def test_a_logged_run_prints_progress_lines_and_logs_samples_to_tensorboard(tmp_path, capsys):
    """4 updates, a line every 2, samples every 3 (and the first): lines at 2 and 4, tables at updates 0 and 3."""
    config = write_config(tmp_path, "seen", total=4)
    samples = ("--trainer.callbacks.init_args.every_n_steps", "3", "--trainer.callbacks.init_args.rows", "3")
    # The shipped Samples (the last callback of configs/tiny.yaml, so the one these options reach)
    fit(config, *samples, "--trainer.enable_progress_bar", "true", "--progress_every", "2")  # pytest's stdout: no tty
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("update ")]
    pattern = r"update {}/4 \(\d+%\) \| reward \d\.\d{{3}} \| delay \d+\.\d \| queue \d+ \| [\d.]+ updates/s \| ETA \w+"
    assert len(lines) == 2, lines
    assert re.fullmatch(pattern.format(2), lines[0]) and re.fullmatch(pattern.format(4), lines[1]), lines
    events = EventAccumulator(str(next((tmp_path / "seen").glob("version_*"))), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("samples/text_summary")
    assert [event.step for event in texts] == [0, 3]
    table = texts[0].tensor_proto.string_val[0].decode()
    rows = table.splitlines()[2:]
    assert len(rows) == 3 and all(re.fullmatch(r"\| \d+\+\d+= \| .* \| [01]\.000 \| \d+ \|", row) for row in rows)


def test_samples_refuses_bad_options():
    with pytest.raises(ValueError, match="every_n_steps=0"):
        Samples(every_n_steps=0)


def native(completions, answer):
    return [float(c == answer) for c in completions]


def trl_style(prompts, completions, **kwargs):
    # TRL passes per-completion lists by keyword: one per dataset column (here the answer)
    return [float(p.endswith("=") and c == a) for p, c, a in zip(prompts, completions, kwargs["answer"], strict=True)]


def completions_only(completions, **kwargs):
    return [float(c == a) for c, a in zip(completions, kwargs["answer"], strict=True)]


@pytest.mark.parametrize("function", [native, trl_style, completions_only])
def test_native_and_trl_reward_functions_give_the_same_rewards(function):
    reward = Reward(function, "f")
    assert reward(["3", "4", " 3"], "3", "1+2=") == [1.0, 0.0, 0.0]


def test_the_task_s_score_is_the_reward_unless_one_is_given():
    task = Addition(max_operand=3)
    assert Reward.of(None, task)(["3", "x"], "3") == [1.0, 0.0]
    assert Reward.of(native, task).name == f"--data.reward {__name__}.native"


def takes_three(completions, answer, extra):
    return [0.0] * len(completions)


@pytest.mark.parametrize(
    ("returned", "message"),
    [(None, r"returned None for 2 completions; it must return a list of 2 numbers"),
     (1.0, r"returned 1.0 for 2 completions"),
     ([1.0], r"returned 1 values for 2 completions"),
     ([1.0, "yes"], r"returned 'yes' among its rewards")],
)  # fmt: skip
def test_a_bad_return_is_one_message_naming_the_function(returned, message):
    reward = Reward(lambda completions, answer: returned, "--data.reward my.bad_reward")
    convention = re.escape(", called as f(completions, answer), ")
    with pytest.raises(UserError, match=r"^reward --data.reward my.bad_reward" + convention + message):
        reward(["a", "b"], "a")


def test_a_wrong_signature_is_refused_when_the_datamodule_is_built():
    from run_helpers import tiny_data

    with pytest.raises(UserError, match=r"reward --data.reward .*takes_three\(completions, answer, extra\) takes "
                                        r"neither \(completions, answer\) nor TRL's keywords"):  # fmt: skip
        tiny_data(reward=takes_three)


def test_rewards_outside_0_1_warn_once_with_the_values():
    reward = Reward(lambda completions, answer: [5.0, -1.0], "wide")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert reward(["a", "b"], "a") == [5.0, -1.0]
        reward(["a", "b"], "a")
    assert [str(w.message) for w in caught] == [
        "reward wide returned [5.0, -1.0] outside [0, 1], the range Task.score documents; they are used as they are "
        "(this warning is shown once)"
    ]


NONE_TASK = """
from collections.abc import Sequence

from lit_gmc.data.tasks.addition import Addition
from lit_gmc.data.tasks.base import Prompt


class NoneScore:
    def __init__(self) -> None:
        self.addition = Addition(max_operand=9)

    def train_prompts(self) -> Sequence[Prompt]:
        return self.addition.train_prompts()

    def test_prompts(self) -> Sequence[Prompt]:
        return self.addition.test_prompts()

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        return None  # the mistake: a forgotten return
"""


def main_error_line(monkeypatch, *argv: str) -> str:
    """The last line ``lit_gmc`` prints on stderr for ``argv``, once it has exited with status 2 (a user's error)."""
    from lit_gmc.__main__ import main

    monkeypatch.setattr("sys.argv", ["lit_gmc", *argv])
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 2
    return stderr.getvalue().strip().splitlines()[-1]


def test_a_plug_in_task_whose_score_returns_none_is_one_line_naming_it(tmp_path, monkeypatch):
    (tmp_path / "none_task.py").write_text(textwrap.dedent(NONE_TASK))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, "none", total=2, task={"class_path": "none_task.NoneScore"})
    assert main_error_line(monkeypatch, "fit", "--config", str(config)) == (
        "lit_gmc: error: reward NoneScore.score (the task's reward), called as f(completions, answer), returned None "
        "for 4 completions; it must return a list of 4 numbers, one reward per completion"
    )
    assert not list((tmp_path / "none").glob("version_*"))  # a run failed before its first update is no run to list


class ParseOnly(GMCCLI):
    def instantiate_classes(self) -> None:
        pass

    def _run_subcommand(self, subcommand: str) -> None:
        pass


def parse_problems(*args: str) -> str:
    with pytest.raises(UserError) as caught:
        ParseOnly(args=["fit", *args])
    return str(caught.value)


def test_unknown_components_list_the_known_classes_with_every_other_bad_option():
    message = parse_problems("--data.schedule", "nonsense", "--data.engine", "Nope", "--data.group_size", "1")
    assert "--data.schedule=nonsense is not a class: one of FixedDelay, Live, Sync, VirtualClock, or" in message
    assert "--data.engine=Nope is not a class: one of HFEngine, VLLMEngine" in message
    assert "--data.group_size=1 must be >= 2" in message


def test_a_misspelt_reward_path_says_cannot_import_it():
    message = parse_problems("--data.reward", "lit_gmc.data.tasks.base.exact_matc")
    path = "lit_gmc.data.tasks.base.exact_matc"
    assert f"--data.reward={path}: cannot import {path} (module 'lit_gmc.data.tasks.base' has no attribute" in message


@pytest.mark.parametrize(("content", "found"), [("", "nothing (an empty file)"), ("- a\n", "a list")])
def test_a_config_file_that_is_no_mapping_is_named(tmp_path, content, found):
    path = tmp_path / "empty.yaml"
    path.write_text(content)
    assert parse_problems("--config", str(path)) == (
        f"--config {path}: holds {found}; a config is a mapping of options (trainer:, model:, data:, ...)"
    )


def test_progress_every_and_the_prompt_budget_below_one_are_refused():
    assert "--progress_every=0 must be >= 1" in parse_problems("--progress_every", "0")
    assert "--data.max_prompt_tokens=0 must be >= 1" in parse_problems("--data.max_prompt_tokens", "0")


@pytest.mark.slow
def test_preflight_reports_everything_this_machine_lacks_in_one_line_before_anything_loads(tmp_path):
    """A fresh hub cache, HF_HUB_OFFLINE, missing local paths and a file where the run folder should go."""
    import os
    import subprocess
    import sys

    (tmp_path / "a_file").write_text("")
    args = ["fit", "--data.task", "Math", "--data.task.path", str(tmp_path / "train.jsonl"), "--model.actor",
            "Qwen/Qwen3-0.6B", "--trainer.logger.init_args.save_dir", str(tmp_path / "a_file" / "runs")]  # fmt: skip
    if not torch_has_cuda():
        args += ["--trainer.accelerator", "gpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty_cache")}
    done = subprocess.run([sys.executable, "-m", "lit_gmc", *args], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    message = done.stderr[done.stderr.index("lit_gmc: error:") :].splitlines()
    assert message[0] == "lit_gmc: error: this machine cannot run this config:"
    assert any(line.startswith("  --trainer.accelerator=gpu: no CUDA GPU") for line in message) != torch_has_cuda()
    assert f"  --data.task.path {tmp_path / 'train.jsonl'}: no such file or folder" in "\n".join(message)
    assert "  --model.actor Qwen/Qwen3-0.6B: HF_HUB_OFFLINE is set and the model is not in the hub cache; point " \
           "--model.actor at a local copy" in "\n".join(message)  # fmt: skip
    assert f"  --trainer.logger.init_args.save_dir {tmp_path / 'a_file' / 'runs'}: cannot be written here " \
           f"({tmp_path / 'a_file'} is a file)" in message  # fmt: skip
    assert "Loading weights" not in done.stderr and not (tmp_path / "empty_cache").exists()  # nothing loaded


def test_a_hub_dataset_offline_names_the_path_option_and_hf_hub_offline(tmp_path, monkeypatch):
    from lit_gmc.data.tasks.math import Math

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    [problem] = Math.preflight_problems()
    assert problem.startswith("--data.task.path DigitalLearningGmbH/MATH-lighteval: HF_HUB_OFFLINE is set")
    (tmp_path / "datasets--DigitalLearningGmbH--MATH-lighteval" / "snapshots").mkdir(parents=True)
    assert Math.preflight_problems() == []  # cached: datasets reads it offline


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_a_resumed_run_continues_its_tensorboard_version_and_counts_from_the_resumed_update(tmp_path, capsys):
    config = write_config(tmp_path, "resumed", total=2, every=2)
    fit(config, "--trainer.enable_progress_bar", "true", "--progress_every", "1")
    fit(config, "--trainer.enable_progress_bar", "true", "--progress_every", "1", "--trainer.max_steps", "4",
        "--data.refill_on_extend", "true", "--ckpt_path", "last")  # fmt: skip
    lines = [line.split(" (")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("update ")]
    assert lines == ["update 1/2", "update 2/2", "update 3/4", "update 4/4"]
    assert sorted(p.name for p in (tmp_path / "resumed").glob("version_*")) == ["version_0"]  # one run in TensorBoard
    events = EventAccumulator(str(tmp_path / "resumed" / "version_0"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/reward")] == [0, 1, 2, 3]
    names = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert names[-1] == "last.ckpt" and not any(name.startswith("last-") for name in names), names  # no last-v1


def test_a_second_run_in_a_folder_in_use_is_refused_naming_it(tmp_path):
    from lit_gmc.run_folder import lock_folder

    folder = tmp_path / "busy" / "checkpoints"
    held = lock_folder(folder)  # another run, writing checkpoints there
    try:
        with pytest.raises(UserError, match=f"--checkpoint.dirpath {folder}: another run \\(pid \\d+\\) is writing"):
            fit(write_config(tmp_path, "busy", total=1))
        assert not list((tmp_path / "busy").glob("version_*/config.yaml"))  # refused before writing anything
    finally:
        held.close()
    fit(write_config(tmp_path, "busy", total=1))  # free again once that run ends


WORDY_TASK = """
from collections.abc import Sequence

from lit_gmc.data.tasks.base import Prompt


class Wordy:
    def train_prompts(self) -> Sequence[Prompt]:
        return [Prompt(0, "2+2=", "4"), Prompt(1, "What is 3 times 4?", "12")]

    def test_prompts(self) -> Sequence[Prompt]:
        return self.train_prompts()

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        return [float(c.strip() == answer) for c in completions]
"""


def test_the_tiny_tokenizer_refuses_characters_it_cannot_encode(tmp_path, monkeypatch):
    (tmp_path / "wordy.py").write_text(WORDY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as caught:
        fit(write_config(tmp_path, "wordy", total=1, task={"class_path": "wordy.Wordy"}))
    assert str(caught.value).startswith(
        "--model.actor tiny: its character tokenizer encodes only '0123456789+-=*() abcdefghijklmnopqrstuvwxyz', and "
        "the task's prompts also hold '?W' (first in prompt 1: 'What is 3 times 4?'), which it would read as <unk>; "
        "choose a model with a real tokenizer (--model.actor"
    )


def test_benchmark_rows_without_a_reference_answer_are_left_out_and_counted(tmp_path):
    import json

    from lit_gmc.callbacks.evaluation import BenchmarkFile, file_suite
    from lit_gmc.data.tasks.benchmarks import load_benchmark

    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "No answer?", "answer": ""}, {"problem": "3?", "answer": 3}]
    path = tmp_path / "amc23_test.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    bench = load_benchmark("amc23", data_dir=str(tmp_path))
    assert [item.answer for item in bench.items] == ["2", "3"]
    assert bench.skipped == (f"{path}:2",)  # file and line
    user_rows = [{"question": "2+3=", "answer": "5"}, {"question": "?", "answer": "  "}]
    user = tmp_path / "sums.jsonl"
    user.write_text("\n".join(json.dumps(row) for row in user_rows) + "\n")
    suite = file_suite(BenchmarkFile("sums", str(user), template="{question}", samples=1), None, lambda: None, (1,))
    assert len(suite.prompts) == 1 and suite.skipped == 1


def test_chat_template_wraps_each_prompt_as_a_user_turn_and_a_base_tokenizer_is_refused(char_tokenizer):
    import copy

    from lit_gmc.data.tasks.base import prompts_in_chat_template

    chat = copy.deepcopy(char_tokenizer)
    chat.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    plain = Addition(max_operand=3).train_prompts()
    wrapped = prompts_in_chat_template(plain, chat)
    assert [p.text for p in wrapped] == [f"<user>{p.text}<assistant>" for p in plain]
    assert [(p.id, p.answer) for p in wrapped] == [(p.id, p.answer) for p in plain]
    with pytest.raises(UserError, match="^--data.chat_template: the actor's tokenizer has no chat template"):
        prompts_in_chat_template(plain, char_tokenizer)


@pytest.mark.slow
def test_a_default_run_under_a_pipe_prints_progress_lines_and_no_start_up_noise(tmp_path):
    """``lit-gmc fit`` as under ``tee`` or SLURM: a line per update (2 updates: 1% rounds up to 1), nothing else."""
    import shutil
    import subprocess

    script = shutil.which("lit-gmc")
    assert script is not None, "the lit-gmc console script is installed with the package"
    done = subprocess.run([script, "fit", "--trainer.max_steps", "2"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert [line.split(" |")[0] for line in output.splitlines() if line.startswith("update ")] == [
        "update 1/2 (50%)", "update 2/2 (100%)"]  # fmt: skip
    for noise in ("Tip:", "Loading weights", "LeafSpec", "Warning"):
        assert noise not in output, output


@pytest.mark.slow
def test_a_new_run_beside_another_run_s_checkpoints_is_refused_naming_the_folder(tmp_path):
    config = write_config(tmp_path, "taken", total=1, every=1)
    fit(config)
    folder = tmp_path / "taken" / "checkpoints"
    with pytest.raises(UserError, match=f"--checkpoint.dirpath {folder} holds another run's checkpoints \\(epoch="):
        fit(config)
    assert not any(path.name.startswith("last-") for path in folder.iterdir())  # nothing written beside them
    fit(config, "--trainer.max_steps", "2", "--data.refill_on_extend", "true", "--ckpt_path", "last")  # as offered


def test_a_run_without_a_logger_name_is_named_after_its_task_and_model(tmp_path):
    config = ParseOnly(args=["fit", "--trainer.logger.init_args.name", "null", "--trainer.logger.init_args.save_dir",
                             str(tmp_path)]).config.fit  # fmt: skip
    assert config.trainer.logger.init_args.name == "addition_tiny"
    assert config.checkpoint.dirpath == str(tmp_path / "addition_tiny" / "checkpoints")
    config = ParseOnly(args=["fit", "--trainer.logger.init_args.name", "null", "--data.task", "Math",
                             "--model.actor", "Qwen/Qwen3-4B-Base"]).config.fit  # fmt: skip
    assert config.trainer.logger.init_args.name == "math_Qwen3-4B-Base"


@pytest.mark.parametrize(
    ("configs", "folder"),
    [([], "runs/addition_tiny"), (["qwen3_4b.yaml"], "runs/math_Qwen3-4B-Base"),
     (["qwen3_4b.yaml", "model/qwen3_8b.yaml", "experiment/simulated_async.yaml"],
      "runs/simulated_async/math_Qwen3-8B-Base")],
)  # fmt: skip
def test_the_shipped_configs_name_their_run_folder_after_task_and_model_for_fit_and_export(configs, folder):
    from pathlib import Path

    from lit_gmc.cli import FitConfig

    paths = [str(Path(__file__).parents[1] / "configs" / name) for name in configs]
    args = [arg for path in paths for arg in ("--config", path)]
    config = ParseOnly(args=["fit", *args]).config.fit
    assert config.checkpoint.dirpath == f"{folder}/checkpoints"
    assert FitConfig(args).config.checkpoint.dirpath == f"{folder}/checkpoints"  # export's --ckpt_path last looks there


def test_the_cli_offers_fit_and_export_under_its_own_name(capsys, monkeypatch):
    from lit_gmc.__main__ import run

    with pytest.raises(SystemExit) as shown_help:
        run(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert shown_help.value.code == 0 and shown.startswith("usage: lit_gmc [-h] {fit,export} ...")
    assert "fit train a policy on stale rollouts" in shown and "export write a checkpoint's policy" in shown
    assert main_error_line(monkeypatch, "fti") == (
        "lit_gmc: error: fti is not a command: one of fit, export (lit-gmc --help); did you mean fit?"
    )
    assert main_error_line(monkeypatch) == "lit_gmc: error: give a command: fit or export (lit-gmc --help)"
    with pytest.raises(UserError, match="invalid choice: 'validate' \\(choose from 'fit'\\)"):
        GMCCLI(args=["validate"])


def test_lightning_s_misconfiguration_is_a_user_error():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lit_gmc.__main__ import user_error_in

    assert user_error_in(RuntimeError("a bug")) is None  # a bug stays a bug
    wrapped = ValueError("outer")
    wrapped.__cause__ = MisconfigurationException("No supported gpu backend found!\n")
    assert str(user_error_in(wrapped)) == "No supported gpu backend found!"


def test_the_terminal_bar_counts_updates_to_max_steps_after_a_resume(tmp_path, monkeypatch):
    from lit_gmc.cli import UpdateProgressBar

    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    config = write_config(tmp_path, "bar", total=2, every=2)
    fit(config, "--trainer.enable_progress_bar", "true")
    trainer = fit(config, "--trainer.enable_progress_bar", "true", "--trainer.max_steps", "3",
                  "--data.refill_on_extend", "true", "--ckpt_path", "last")  # fmt: skip
    bar = trainer.trainer.progress_bar_callback
    assert isinstance(bar, UpdateProgressBar)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.completed, task.total) == (3, 3)  # before: 3/0 here (the issue saw 230/30 after a longer run)
    assert bar.get_metrics(trainer.trainer, trainer.model)["v_num"] == "0"  # the bar printed it as 0.000


LONG_TASK = """
from collections.abc import Sequence

from lit_gmc.data.tasks.base import Prompt


class Long:
    def train_prompts(self) -> Sequence[Prompt]:
        return [Prompt(0, "1+1=", "2"), Prompt(7, "1+" * 30 + "1=", "31")]

    def test_prompts(self) -> Sequence[Prompt]:
        return self.train_prompts()[:1]

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        return [float(c.strip() == answer) for c in completions]
"""


def test_prompts_that_leave_no_room_in_the_actor_s_context_are_refused_at_start_up(tmp_path, monkeypatch):
    (tmp_path / "long_task.py").write_text(LONG_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, "long", total=1, task={"class_path": "long_task.Long"})
    with pytest.raises(UserError) as caught:
        fit(config, "--data.max_new_tokens", "8")  # 62 + 8 tokens > the tiny actor's 64
    assert str(caught.value).startswith(
        "prompt 7 of the task is 62 tokens, and with --data.max_new_tokens 8 that is more than the 64 tokens "
        "--model.actor tiny can attend to; shorten"
    )
    with pytest.warns(UserWarning, match="cut the beginning of 1 of 2 training prompts"):  # the budget makes room
        fit(config, "--data.max_new_tokens", "8", "--data.max_prompt_tokens", "20")


class CheckedEngine:
    """An engine with its own start-up check, as a server engine has (records what it was asked)."""

    asked: list[str] = []

    def __init__(self, url: str = "http://nowhere:1") -> None:
        self.url = url

    def preflight_problems(self, actor: str | None = None) -> list[str]:
        CheckedEngine.asked.append(actor)
        return [f"server {self.url} is unreachable"]


def test_an_engine_s_own_preflight_is_asked_and_a_vllm_engine_needs_vllm(monkeypatch):
    import importlib.util

    from lit_gmc import preflight
    from lit_gmc.data.engines.vllm import VLLMEngine

    assert preflight.engine_problems(CheckedEngine, {"url": "http://a:8"}, "tiny") == [
        "--data.engine CheckedEngine: server http://a:8 is unreachable"]  # fmt: skip
    assert CheckedEngine.asked == ["tiny"]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "vllm" else real_find_spec(name)
    )
    [problem] = preflight.engine_problems(VLLMEngine, {}, "tiny")
    assert problem.startswith("--data.engine VLLMEngine needs vLLM, which is not installed here: pip install -e")


SETUP_TASK = """
from collections.abc import Sequence
from dataclasses import replace

from lit_gmc.data.tasks.base import Prompt


class Padded:
    '''Prompts made in setup(tokenizer), as Math and Addition make theirs: a long preamble before each sum.'''

    def __init__(self) -> None:
        self.prompts = [Prompt(0, "1+1=", "2"), Prompt(7, "2+2=", "4")]

    def setup(self, tokenizer) -> None:
        self.prompts = [replace(p, text="0+" * (20 + 2 * p.id) + p.text) for p in self.prompts]

    def train_prompts(self) -> Sequence[Prompt]:
        return self.prompts

    def test_prompts(self) -> Sequence[Prompt]:
        return self.prompts[:1]

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        return [float(c.strip() == answer) for c in completions]
"""


def test_prompts_made_in_setup_are_checked_against_the_context_and_cut_by_the_budget(tmp_path, monkeypatch):
    """Through ``lit_gmc fit``: one line with status 2 naming prompt 7 (72 tokens + 4 > 64), then a budget of 40."""
    (tmp_path / "padded_task.py").write_text(SETUP_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, "padded", total=1, task={"class_path": "padded_task.Padded"})
    assert main_error_line(monkeypatch, "fit", "--config", str(config)) == (
        "lit_gmc: error: prompt 7 of the task is 72 tokens, and with --data.max_new_tokens 4 that is more than the 64 "
        "tokens --model.actor tiny can attend to; shorten the task's prompts (--data.max_prompt_tokens N keeps the "
        "last N tokens of each) or lower --data.max_new_tokens"
    )
    with pytest.warns(UserWarning, match=r"--data.max_prompt_tokens 40: cut the beginning of 2 of 2 training prompts"):
        cli = fit(config, "--data.max_prompt_tokens", "40", "--trainer.logger.init_args.name", "padded_cut")
    served = {prompt.id: prompt.text for prompt in cli.datamodule.stream.prompts}
    assert served == {0: ("0+" * 20 + "1+1=")[-40:], 7: ("0+" * 34 + "2+2=")[-40:]}  # one token per character

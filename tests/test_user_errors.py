"""A user's mistake in the actor, a benchmark or an evaluation option is one message naming it, never a traceback.

``python -m lit_gmc`` and ``scripts/evaluate.py`` print a :class:`~lit_gmc.errors.UserError` as one line and exit
with status 2; these tests check that the actor (``--model.actor``, ``--actor``), the benchmark data (a missing or
malformed file, an unknown name, an unreachable hub) and the evaluation script's options end there. The
checkpoint side of ``export`` is in ``test_export.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import datasets
import lightning.pytorch as pl
import pytest
import torch
from run_helpers import main_error_line, main_stderr, parse_problems

from lit_gmc.actor import build_char_tokenizer, load_actor
from lit_gmc.callbacks.evaluation import Evaluation
from lit_gmc.data.tasks.benchmarks import BenchmarkUnreachable, load_benchmark
from lit_gmc.errors import UserError, UserFileNotFoundError

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def lit_gmc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lit_gmc", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env={**os.environ, **(env or {})})  # fmt: skip


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The ``lit_gmc: error:`` line of a run that ended on a user error (status 2, no traceback)."""
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.splitlines()[-1]
    assert last.startswith("lit_gmc: error: "), done.stderr[-3000:]
    return last


def fit_args(tmp_path: Path, *args: str) -> list[str]:
    return ["fit", "--config", TINY, "--trainer.max_steps", "1", "--trainer.logger.init_args.save_dir", str(tmp_path),
            *args]  # fmt: skip


# --- the actor ---------------------------------------------------------------------------------------------------


def test_a_missing_actor_folder_is_one_line_naming_the_option(tmp_path, monkeypatch):
    missing = tmp_path / "no_such_model"
    last = main_error_line(monkeypatch, *fit_args(tmp_path, "--model.actor", str(missing)))
    assert last.startswith(f"lit_gmc: error: --model.actor {missing}: no such model folder")


def test_a_hub_actor_on_an_offline_machine_says_to_pass_a_local_copy(tmp_path):
    # HF_HUB_OFFLINE makes "no network" certain; the preflight says so before anything loads (no retries)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty_cache")}
    last = one_line_error(lit_gmc(*fit_args(tmp_path, "--model.actor", "lit-gmc-tests/no-such-model"), env=env))
    assert last == (
        "lit_gmc: error: --model.actor lit-gmc-tests/no-such-model: HF_HUB_OFFLINE is set and the model is not in the "
        "hub cache; point --model.actor at a local copy, or unset HF_HUB_OFFLINE where the hub can be reached"
    )


def test_actor_paths_that_are_not_model_folders(tmp_path, monkeypatch):
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.write_bytes(b"not a model")
    with pytest.raises(UserError, match=rf"^--model.actor {checkpoint} is a file, not a model folder: .*export"):
        load_actor(str(checkpoint))
    with pytest.raises(UserError, match=rf"^--actor {tmp_path} is not a transformers model folder \(it has no config"):
        load_actor(str(tmp_path), option="--actor")
    with pytest.raises(UserFileNotFoundError, match=r"^--model.actor runs/x/hf: no such model folder"):
        load_actor("runs/x/hf")  # two slashes: a path, never a hub name, so not looked up online
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(UserError, match=rf"^--model.actor {broken}: transformers cannot load it as a causal LM"):
        load_actor(str(broken))
    monkeypatch.setenv("LIT_GMC_CACHE", str(checkpoint / "cache"))  # under a file: cannot be created
    with pytest.raises(UserError, match=r"^--model.actor tiny: cannot write the tiny actor under .*LIT_GMC_CACHE"):
        load_actor("tiny")


# --- benchmarks ------------------------------------------------------------------------------------------------


def offline(*args, **kwargs):
    raise ConnectionError("Couldn't reach 'math-ai/amc23' on the Hub (LocalEntryNotFoundError)")


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_benchmark_data_errors_are_user_errors(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="unknown benchmark 'mmlu'; known: math500"):
        load_benchmark("mmlu")
    minerva = write_rows(tmp_path / "minerva.jsonl", [{"problem": "p", "solution": "no box"}])
    with pytest.raises(UserError, match=r"minerva\.jsonl:1: column 'solution': no complete \\boxed"):
        load_benchmark("minerva", source=minerva)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserFileNotFoundError, match=rf"^benchmark 'amc23': {empty}: .*doesn't contain any data"):
        load_benchmark("amc23", source=str(empty))
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(BenchmarkUnreachable, match=r"^benchmark 'amc23': Couldn't reach .*amc23_test\.jsonl"):
        load_benchmark("amc23")


class Silent:
    """A GenerationEngine that is never asked to generate (setup fails first)."""

    def generate(self, prompts, n, sampling):
        raise AssertionError("not reached")


def test_evaluation_names_its_options_for_data_errors(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="invalid Evaluation options"):
        Evaluation(max_new_tokens=0)
    trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    tokenizer = build_char_tokenizer()
    monkeypatch.setattr(datasets, "load_dataset", offline)
    evaluation = Evaluation(benchmarks=["amc23"], engine=Silent(), tokenizer=tokenizer, scorer=SimpleNamespace())
    with pytest.raises(UserError, match=r"^Evaluation: benchmark 'amc23': Couldn't reach .* data_dir .* or sources$"):
        evaluation.setup(trainer, None, "fit")
    missing = Evaluation(benchmarks=["amc23"], data_dir=str(tmp_path), engine=Silent(), tokenizer=tokenizer,
                         scorer=SimpleNamespace())  # fmt: skip
    with pytest.raises(UserError, match=rf"^Evaluation: data not found: {tmp_path / 'amc23_test.jsonl'}"):
        missing.setup(trainer, None, "fit")


def test_an_unknown_benchmark_in_a_fit_is_one_line(tmp_path, monkeypatch):
    args = fit_args(tmp_path, "--trainer.callbacks+=lit_gmc.callbacks.evaluation.Evaluation",
                    "--trainer.callbacks.benchmarks=[nope]")  # fmt: skip
    last = main_error_line(monkeypatch, *args)
    assert last.startswith("lit_gmc: error: Evaluation: unknown benchmarks ['nope'] in benchmarks")


# --- scripts/evaluate.py ----------------------------------------------------------------------------------------


def evaluate_script():
    spec = importlib.util.spec_from_file_location("evaluate_script", REPO / "scripts" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def evaluate_error(capsys, *args: str) -> str:
    """The one stderr line of ``scripts/evaluate.py`` ending with status 2."""
    with pytest.raises(SystemExit) as stopped:
        evaluate_script().main(list(args))
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    return err.strip().splitlines()[-1]


def test_evaluate_script_errors_are_one_line_with_status_2(tmp_path, capsys, monkeypatch):
    amc = write_rows(tmp_path / "amc.jsonl", [{"problem": "1+1", "answer": "2"}])
    common = ("--benchmarks", "amc23", "--source", f"amc23={amc}", "--output", str(tmp_path / "out.json"))
    missing = tmp_path / "model"
    assert evaluate_error(capsys, "--actor", str(missing), *common).startswith(
        f"evaluate.py: error: --actor {missing}: no such model folder")  # fmt: skip
    not_a_checkpoint = write_rows(tmp_path / "x.ckpt", [{"a": 1}])
    assert evaluate_error(capsys, "--ckpt", not_a_checkpoint, *common) == (
        f"evaluate.py: error: --ckpt_path {not_a_checkpoint} is not a lit_gmc checkpoint (torch.load cannot read it "
        "as one)"
    )  # fmt: skip
    blocked = ("--output", f"{amc}/out.json")  # under a file: refused before anything is loaded
    assert "--output" in evaluate_error(capsys, "--actor", "tiny", *common[:4], *blocked)
    assert evaluate_error(capsys, *common).endswith("one of --ckpt or --actor is required")
    ranges = evaluate_error(capsys, "--actor", "tiny", "--ks", "0", "--verifier-workers", "0",
                            "--max-prompt-tokens", "-1")  # fmt: skip
    assert all(flag in ranges for flag in ("--ks 0: every k", "--verifier-workers must", "--max-prompt-tokens must"))
    if not torch.cuda.is_available():
        assert "--device cuda: no CUDA device" in evaluate_error(capsys, "--actor", "tiny", "--device", "cuda", *common)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    last = evaluate_error(capsys, "--actor", "tiny", "--benchmarks", "amc23")
    assert last.startswith("evaluate.py: error: benchmark 'amc23': Couldn't reach") and "--data-dir" in last


def test_a_callback_s_bad_option_is_one_message_though_jsonargparse_wraps_it(tmp_path, monkeypatch):
    args = fit_args(tmp_path, "--trainer.callbacks+=lit_gmc.callbacks.evaluation.Evaluation",
                    "--trainer.callbacks.max_problems", "0")  # fmt: skip
    stderr = main_stderr(monkeypatch, *args)
    assert "lit_gmc: error: invalid Evaluation options:\n  max_problems=0 must be >= 1" in stderr


def test_the_math_task_s_tokenizer_option_is_named(tmp_path, monkeypatch):
    missing = str(tmp_path / "no_tokenizer")
    write_rows(tmp_path / "train.jsonl", [{"problem": f"{i}+1", "solution": f"\\boxed{{{i + 1}}}"} for i in range(4)])
    args = fit_args(tmp_path, "--data.task", "Math", "--data.task.path", str(tmp_path / "train.jsonl"),
                    "--data.task.tokenizer", missing)  # fmt: skip
    last = main_error_line(monkeypatch, *args)
    assert last.startswith(f"lit_gmc: error: --data.task.tokenizer {missing}: no such model folder")


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


def test_lightning_s_misconfiguration_is_a_user_error():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lit_gmc.__main__ import user_error_in

    assert user_error_in(RuntimeError("a bug")) is None  # a bug stays a bug
    wrapped = ValueError("outer")
    wrapped.__cause__ = MisconfigurationException("No supported gpu backend found!\n")
    assert str(user_error_in(wrapped)) == "No supported gpu backend found!"

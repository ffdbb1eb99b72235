"""The run folder: named after task and model, continued by a resume, refused while another run uses it."""

from __future__ import annotations

import pytest
from run_helpers import ParseOnly, fit, write_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_gmc.errors import UserError


def test_a_resumed_run_continues_its_tensorboard_version_and_counts_from_the_resumed_update(tmp_path, capsys):
    config = write_config(tmp_path, "resumed", total=2, every=2)
    fit(config, "--trainer.enable_progress_bar", "true", "--progress_every", "1")
    fit(config, "--trainer.enable_progress_bar", "true", "--progress_every", "1", "--trainer.max_steps", "4",
        "--ckpt_path", "last")  # fmt: skip
    lines = [line.split(" (")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("update ")]
    assert lines == ["update 1/2", "update 2/2", "update 3/4", "update 4/4"]
    assert sorted(p.name for p in (tmp_path / "resumed").glob("version_*")) == ["version_0"]  # one run in TensorBoard
    events = EventAccumulator(str(tmp_path / "resumed" / "version_0"))
    events.Reload()
    # Sorted: both runs write from this one process, and TensorBoard orders their event files by name (timestamp
    # in seconds, then a per-process counter compared as text), which puts the second file first now and then.
    assert sorted(event.step for event in events.Scalars("train/reward")) == [0, 1, 2, 3]
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


@pytest.mark.slow
def test_a_new_run_beside_another_run_s_checkpoints_is_refused_naming_the_folder(tmp_path):
    config = write_config(tmp_path, "taken", total=1, every=1)
    fit(config)
    folder = tmp_path / "taken" / "checkpoints"
    with pytest.raises(UserError, match=f"--checkpoint.dirpath {folder} holds another run's checkpoints \\(epoch="):
        fit(config)
    assert not any(path.name.startswith("last-") for path in folder.iterdir())  # nothing written beside them
    fit(config, "--trainer.max_steps", "2", "--ckpt_path", "last")  # a finished run extended: refilled


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

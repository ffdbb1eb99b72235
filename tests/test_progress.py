"""Progress in logs and terminals: the progress line's content, the bar chosen by the terminal, a run's lines under a
pipe, and the bar's count after a resume."""

from __future__ import annotations

import re

import pytest
from run_helpers import fit, write_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_gmc.callbacks.progress import ProgressLines, default_every, duration, progress_line
from lit_gmc.cli import default_progress_bar


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


def test_the_terminal_bar_counts_updates_to_max_steps_after_a_resume(tmp_path, monkeypatch):
    from lit_gmc.cli import UpdateProgressBar

    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    config = write_config(tmp_path, "bar", total=2, every=2)
    fit(config, "--trainer.enable_progress_bar", "true")
    trainer = fit(config, "--trainer.enable_progress_bar", "true", "--trainer.max_steps", "3", "--ckpt_path", "last")
    bar = trainer.trainer.progress_bar_callback
    assert isinstance(bar, UpdateProgressBar)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.completed, task.total) == (3, 3)  # before: 3/0 here (the issue saw 230/30 after a longer run)
    assert bar.get_metrics(trainer.trainer, trainer.model)["v_num"] == "0"  # the bar printed it as 0.000

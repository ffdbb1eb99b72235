"""Small end-to-end runs of ``python -m lit_gmc fit`` on the tiny actor, in-process or in a subprocess.

Each run gets its own YAML (layered over the embedded default), TensorBoard folder and checkpoint folder,
and is read back as per-step records: what was consumed (batch id, launch version) and what it gave
(rewards, loss).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from lit_gmc.cli import GMCCLI
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.data.engines import HFEngine
from lit_gmc.data.schedules import FixedDelay
from lit_gmc.data.tasks import Addition
from lit_gmc.tblog import read_scalars

RECORD_TAGS = ("schedule/batch_id", "schedule/launch_version", "train/reward", "train/loss")


SCHEDULES = {
    "Sync": "lit_gmc.data.schedules.Sync",
    "FixedDelay": "lit_gmc.data.schedules.FixedDelay",
    "VirtualClock": "lit_gmc.data.virtual_clock.VirtualClock",
    "Live": "lit_gmc.data.live.Live",
}


def tiny_data(delay: int = 8, **kwargs: Any) -> RolloutDataModule:
    """The embedded default's data side (addition, HF engine, ``FixedDelay(delay)``) for direct Trainer tests."""
    return RolloutDataModule(Addition(), HFEngine(), FixedDelay(delay), **kwargs)


def component(class_path: str, **init_args: Any) -> dict[str, Any]:
    """A ``class_path`` + ``init_args`` entry; short schedule names expand to their paths."""
    return {"class_path": SCHEDULES.get(class_path, class_path), "init_args": init_args}


def write_config(
    tmp_path: Path,
    name: str,
    *,
    total: int,
    every: int | None = None,
    extra_callbacks: list[dict] | None = None,
    schedule: dict[str, Any] | None = None,
    **data: Any,
) -> Path:
    """A config for a small tiny-actor run named ``name``, logged and checkpointed under ``tmp_path / name``.

    ``every``: checkpoint period (None: no checkpoints); ``schedule``: a :func:`component` (None: the default's).
    """
    callbacks: list[dict[str, Any]] = [
        {"class_path": "lit_gmc.callbacks.weight_sync.WeightSync"},
        {"class_path": "lit_gmc.callbacks.delays.DelayAccounting"},
        *(extra_callbacks or []),
    ]
    checkpoint = (
        {"every_n_train_steps": every, "save_last": True, "save_top_k": -1}
        if every is not None
        else {"every_n_train_steps": 0, "save_last": False, "save_top_k": 0}
    )
    config = {
        "trainer": {
            "max_steps": total,
            "enable_progress_bar": False,
            # checkpoints follow the logger: tmp_path / name / checkpoints
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(tmp_path), "name": name}},
            "callbacks": callbacks,
        },
        "checkpoint": checkpoint,
        "data": {"batch_prompts": 2, "group_size": 4, "max_new_tokens": 4, **data,
                 **({"schedule": schedule} if schedule is not None else {})},
    }  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def fit(config: Path, *args: str, callbacks: list | None = None) -> GMCCLI:
    """``lit_gmc fit --config config *args`` in this process; ``callbacks`` are added to the config's."""
    defaults = {"callbacks": callbacks} if callbacks else {}
    return GMCCLI(args=["fit", "--config", str(config), *args], trainer_defaults=defaults)


def fit_command(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "lit_gmc", "fit", "--config", str(config), *args]


def run_subprocess(config: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(fit_command(config, *args), capture_output=True, text=True, timeout=timeout, env=os.environ)
    return done


def records(run_dir: Path) -> dict[int, dict[str, float]]:
    """``step -> {tag: value}`` for :data:`RECORD_TAGS` (and every ``schedule/`` and ``delay/`` tag)."""
    scalars = read_scalars(run_dir)
    out: dict[int, dict[str, float]] = {}
    for tag, points in scalars.items():
        if tag in RECORD_TAGS or tag.startswith(("schedule/", "delay/")):
            for step, value in points:
                out.setdefault(step, {})[tag] = value
    return out


def assert_same_records(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], tol: float = 1e-6) -> None:
    """Same steps, same tags, and every value equal to ``tol`` (ids and versions exactly)."""
    assert sorted(got) == sorted(want), f"steps differ: {sorted(got)} vs {sorted(want)}"
    for step in sorted(want):
        assert sorted(got[step]) == sorted(want[step]), f"step {step}: tags differ"
        for tag, value in want[step].items():
            limit = 0.0 if tag in ("schedule/batch_id", "schedule/launch_version") else tol
            assert abs(got[step][tag] - value) <= limit, f"step {step} {tag}: {got[step][tag]} != {value}"

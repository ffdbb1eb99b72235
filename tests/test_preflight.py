"""Preflight: what this machine or an engine lacks is reported in one line before anything loads."""

from __future__ import annotations

import pytest


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

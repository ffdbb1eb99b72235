"""Shared fixtures: tiny models built in-process, the shared benchmark data, CPU-only defaults."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from lit_gmc.actor import TinyRecipe, build_char_tokenizer, build_tiny_model

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine threads spin-wait on every
    small kernel (a 20-step fit measured 7 s on one thread, 142 s on two under load)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# Under pytest-xdist (the README's test command: ``-n 2 --dist loadfile --no-loadscope-reorder``) each test file is
# one unit of work, so its module fixtures (servers, reference runs) are made once, on one worker. Files start longest
# first (measured, docs/testing.md), so no worker is left with a long one at the end; a stale order only costs time.
# (``--dist loadgroup`` cannot group here: pytest 9.2 ignores the node id suffix pytest-xdist 3.8 gives a group.)
LONGEST_FIRST = ("test_vllm_serve", "test_qwen3_rehearsal", "test_scale_out_recipe", "test_resume", "test_e2e",
                 "test_scale_out", "test_sweep", "test_sigterm_waits", "test_cli", "test_export",
                 "test_gpu_check")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.stem, len(LONGEST_FIRST)))  # stable: each file's order is kept


VLLM_LOGGING_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")  # before any test module (and TRL) is imported


@pytest.fixture(autouse=True, scope="session")
def vllm_logging_level_as_it_was():
    """Importing TRL (``tests/test_task_contract.py`` does, at collection) sets ``VLLM_LOGGING_LEVEL=ERROR`` in this
    process, which every ``vllm serve`` launched later inherits, its INFO lines (the weight-update line) gone: the
    session starts, before any server fixture, with the value this process started with."""
    if VLLM_LOGGING_LEVEL is None:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
    else:
        os.environ["VLLM_LOGGING_LEVEL"] = VLLM_LOGGING_LEVEL


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the clone; tests that need it skip in a user's clone, which has none."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"benchmark data not found at {SHARED_DATA} (only present beside the project's own checkout)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()


def make_tiny_model(tokenizer, *, hidden: int = 32, layers: int = 2, seed: int = 0, dtype=torch.float32):
    recipe = TinyRecipe(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers, num_heads=4,
                        num_kv_heads=2, seed=seed)  # fmt: skip
    model = build_tiny_model(recipe, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    return model.to(dtype).eval()


@pytest.fixture
def tiny_model(char_tokenizer):
    """A randomly initialised 2-layer Qwen3 (hidden 32) over the character vocabulary, fp32."""
    return make_tiny_model(char_tokenizer)


@pytest.fixture
def tiny_actor_dir(tmp_path, char_tokenizer) -> Path:
    """A random tiny actor saved with ``save_pretrained`` (model + tokenizer), loadable by path."""
    model = make_tiny_model(char_tokenizer)
    path = tmp_path / "actor"
    model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def float64_rmsnorm(monkeypatch):
    """Qwen3's RMSNorm upcasts to float32 even in a float64 model, in backward too, which rounds gradients to
    ~1e-8; tests that compare estimators at float64 precision run the norm in the input dtype."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(Qwen3RMSNorm, "forward", forward)


@pytest.fixture(scope="module")
def float64_actor_dir(tmp_path_factory, char_tokenizer) -> Path:
    """A random tiny Qwen3 (hidden 16) in float64, saved so GMCModule can load it by path."""
    recipe = TinyRecipe(hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=3)
    model = build_tiny_model(recipe, len(char_tokenizer), char_tokenizer.pad_token_id, char_tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("actor")
    model.double().save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def single_process_runs(tmp_path_factory) -> dict[str, Path]:
    """``rule -> run folder`` of the single-process reference runs of the scale-out config (GMC and GAC), made once
    for ``tests/test_scale_out.py`` and the two-process kill -9 cells of ``tests/test_resume.py``.

    Under pytest-xdist the two files run on different workers; the runs are made once for both, in the folder the
    workers' temporary folders share, by whichever asks first while the other waits on the lock (pytest-xdist's
    recipe for a session fixture made once)."""
    from filelock import FileLock
    from run_helpers import MICRO, SCALE_OUT, run_subprocess, write_config

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    root = shared / "single_process_runs"
    runs = {rule: root / rule for rule in ("gmc", "gac")}
    with FileLock(str(shared / "single_process_runs.lock")):
        if not (root / "made").exists():  # a worker that failed to make them leaves no mark: make them again
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            for rule in runs:
                done = run_subprocess(write_config(root, rule, **SCALE_OUT), *MICRO, "--model.correction", rule.upper())
                assert done.returncode == 0, done.stderr[-3000:]
            (root / "made").touch()
    return runs

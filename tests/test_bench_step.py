"""``scripts/bench/bench_step.py``: its bare loop does what lit_gmc's update does, so the ratio compares like with like.

The benchmark times the two sides; this checks that they compute the same losses over the same updates (the bare
loop's GMC loss, AdamW and cosine schedule against ``GMCModule`` built by ``GMCCLI`` on the embedded default), so a
change to lit_gmc's defaults that the bare loop does not follow fails here rather than skewing the figures.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def bench_step():
    spec = importlib.util.spec_from_file_location("bench_step", REPO / "scripts" / "bench" / "bench_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_bare_loop_reaches_lit_gmc_losses_on_the_tiny_shape(tmp_path):
    bench = bench_step()
    shape = bench.SHAPES["tiny"]
    lit = bench.lit_side("tiny", shape, 4, tmp_path)
    bare = bench.bare_side("tiny", shape, 4)
    assert len(lit["losses"]) == len(bare["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(lit["losses"], bare["losses"], strict=True)) < 1e-9
    assert len(lit["wall"]) == len(bare["cpu"]) == 3  # the first update ends no interval on the lit side
    assert all(seconds > 0 for seconds in lit["wall"] + bare["wall"])


def test_fixed_batches_have_the_shape_and_one_version_per_update():
    bench = bench_step()
    shape = bench.SHAPES["qwen3-0.6b"]
    batches = bench.fixed_batches(shape, vocab=151936, count=2)
    assert [b.input_ids.shape for b in batches] == [(4, 64 + 192)] * 2
    assert [b.versions.tolist() for b in batches] == [[0, 0], [1, 1]] and batches[0].group_size == 2
    assert bool(batches[0].response_mask.all()) and batches[0].prompt_width == 64

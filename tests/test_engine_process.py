"""``HFEngine(layout="dedicated")``: the engine in a process of its own gives the colocated engine's samples."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from run_helpers import component, fit, records, write_config
from test_hf_engine import PROMPTS

from lit_gmc.actor import load_actor
from lit_gmc.data.engines.base import SamplingParams
from lit_gmc.data.engines.hf import HFEngine


def same_groups(a, b) -> bool:
    fields = ("prompt_ids", "response_ids", "response_mask", "behavior_logprobs")
    return all(torch.equal(getattr(x, f), getattr(y, f)) for x, y in zip(a, b, strict=True) for f in fields)


@pytest.fixture(scope="module")
def engines():
    colocated, dedicated = HFEngine(), HFEngine(layout="dedicated", threads=torch.get_num_threads())
    colocated.start("tiny")
    dedicated.start("tiny")
    yield colocated, dedicated
    colocated.close()
    dedicated.close()


def test_dedicated_samples_equal_colocated_before_and_after_a_weight_load(engines):
    colocated, dedicated = engines
    sampling = SamplingParams(max_new_tokens=6, seed=11)
    assert same_groups(colocated.generate(PROMPTS, 4, sampling), dedicated.generate(PROMPTS, 4, sampling))
    model, _ = load_actor("tiny")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    before = dedicated.generate(PROMPTS, 4, sampling)
    for engine in engines:
        engine.load_weights(model.named_parameters(), 7)
    after = dedicated.generate(PROMPTS, 4, sampling)
    assert same_groups(colocated.generate(PROMPTS, 4, sampling), after)
    assert not same_groups(before, after), "the engine process samples with the loaded weights"
    assert {g.version for g in after} == {7} and dedicated.version == 7
    with pytest.raises(KeyError, match="unknown parameter 'nope'"):
        dedicated.load_weights([("nope", torch.zeros(1))], 8)


def test_a_dead_engine_process_stops_generation_with_its_exit_code():
    engine = HFEngine(layout="dedicated")
    engine.start("tiny")
    try:
        os.kill(engine._process.process.pid, signal.SIGKILL)
        engine._process.process.join()
        with pytest.raises(RuntimeError, match=r"the engine process died while generating \(exit code -9\)"):
            engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4))
    finally:
        engine.close()
    assert engine._process is None


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"layout='remote' is not one of colocated, dedicated"):
        HFEngine(layout="remote")
    with pytest.raises(ValueError, match=r"threads=2 needs layout=dedicated"):
        HFEngine(threads=2)


@pytest.mark.slow
def test_an_overlapped_virtual_clock_run_has_the_same_records_in_both_layouts(tmp_path):
    schedule = component("VirtualClock", lam=120.0, overlap=True)
    fit(write_config(tmp_path, "colocated", total=8, schedule=schedule))
    fit(write_config(tmp_path, "dedicated", total=8, schedule=schedule), "--data.engine.layout", "dedicated")
    got, want = records(tmp_path / "dedicated"), records(tmp_path / "colocated")
    assert sorted(got) == sorted(want) == list(range(8))
    assert got == want  # every record exactly: the same rollouts, so the same losses

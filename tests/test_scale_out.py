"""Data parallelism: 2-process DDP and FSDP2 runs (gloo, CPU) against the single-process run of the same config.

Rank 0 owns the engine and the schedule and scatters whole groups (balanced by tokens), so the rollouts, delays and
versions of a 2-process run are the single-process run's exactly; losses and gradient norms agree to floating-point
reduction order (the two halves of the batch are reduced across processes instead of inside one backward).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from run_helpers import MICRO, SCALE_OUT, Ranks, assert_reproduces, fit_command, run_subprocess, tiny_data, write_config
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from lit_gmc.batch import RolloutBatch
from lit_gmc.data import datamodule
from lit_gmc.distributed import gather_groups
from lit_gmc.module import GMCModule
from lit_gmc.rules import VCPO
from lit_gmc.strategies import FSDP2Strategy

pytestmark = pytest.mark.slow
TOTAL, EVERY = SCALE_OUT["total"], SCALE_OUT["every"]
STRATEGIES = {"ddp": ("--trainer.strategy", "ddp"), "fsdp2": ("--trainer.strategy", "fsdp2")}
TWO = ("--trainer.devices", "2")


# `extended`, for CI's time: CI's two-process runs of this config are the kill -9 cells of tests/test_resume.py (DDP
# with GMC, FSDP2 with GAC), whose records, half written before the kill and half after the resume, are compared with
# the single-process run in the same way.
@pytest.mark.extended
@pytest.mark.parametrize(("strategy", "rule"), [("ddp", "gmc"), ("fsdp2", "gac")])
def test_two_processes_reproduce_the_single_process_run(tmp_path, single_process_runs, strategy, rule):
    config = write_config(tmp_path, "two", total=TOTAL, every=EVERY, batch_prompts=4)
    done = run_subprocess(config, *TWO, *STRATEGIES[strategy], *MICRO, "--model.correction", rule.upper(), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_reproduces(tmp_path / "two", single_process_runs[rule])


PROBE = '''
import json
import torch
import lightning.pytorch as pl
from lit_gmc.distributed import full_tensor


class EngineWeightsProbe(pl.Callback):
    """After each update (and WeightSync), rank 0 compares the engine's weights with the gathered parameters."""

    def __init__(self, out: str) -> None:
        self.out, self.seen = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.datamodule.rollout_engine
        gathered = {name[len("actor."):]: full_tensor(p.detach()) for name, p in pl_module.named_parameters()}
        sharded = any(type(p).__name__ == "DTensor" for p in pl_module.parameters())
        if trainer.global_rank == 0:
            weights = dict(engine.model.named_parameters())
            gap = max(float((weights[name] - value).abs().max()) for name, value in gathered.items())
            self.seen.append({"step": trainer.global_step, "version": engine.version, "gap": gap,
                              "sharded": sharded, "names": sorted(gathered) == sorted(weights)})
            with open(self.out, "w") as handle:
                json.dump(self.seen, handle)
'''


def test_fsdp2_weight_sync_gives_the_engine_the_gathered_parameters(tmp_path):
    (tmp_path / "probe_module.py").write_text(textwrap.dedent(PROBE))
    out = tmp_path / "probe.json"
    probe = {"class_path": "probe_module.EngineWeightsProbe", "init_args": {"out": str(out)}}
    config = write_config(tmp_path, "probe", total=3, extra_callbacks=[probe])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        fit_command(config, *TWO, *STRATEGIES["fsdp2"]), capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert [entry["step"] for entry in seen] == [1, 2, 3]
    for entry in seen:
        assert entry["sharded"] and entry["names"]
        assert entry["version"] == entry["step"]
        assert entry["gap"] == 0.0


def test_batch_prompts_not_divisible_by_the_world_size_is_a_start_up_error(monkeypatch):
    monkeypatch.setattr(datamodule, "rank_and_world", lambda: (1, 2))  # rank 1 of 2, as setup sees it under DDP
    data = tiny_data(batch_prompts=3)
    with pytest.raises(ValueError, match="--data.batch_prompts=3 cannot be split into whole groups over 2 processes"):
        data.setup("fit")
    data = tiny_data(batch_prompts=4)
    data.setup("fit")  # rank 1 starts no engine: it receives its groups from rank 0
    assert data.rollout_engine is None and data.state_dict() == {}


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_vcpo_under_fsdp2_is_refused_with_the_reason(one_process_group):
    module = GMCModule(correction=VCPO())
    module._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    with pytest.raises(ValueError, match="--model.correction=VCPO needs the exact gradient norm of every trajectory"):
        module.configure_model()
    gmc = GMCModule()
    gmc._device_mesh = module.device_mesh
    gmc.configure_model()  # every decoder layer and the module itself become FSDP2 units
    sharded = [type(m).__name__ for m in gmc.modules() if isinstance(m, FSDPModule)]
    assert sharded == ["FSDPGMCModule", "FSDPQwen3DecoderLayer", "FSDPQwen3DecoderLayer"]


def test_shards_keep_the_whole_update_s_normalisers():
    torch.manual_seed(0)
    groups, size, width = 4, 3, 5
    n = groups * size
    mask = torch.rand(n, width) > 0.3
    batch = RolloutBatch(
        input_ids=torch.zeros(n, 2 + width, dtype=torch.long),
        attention_mask=torch.ones(n, 2 + width, dtype=torch.bool),
        response_mask=mask, behavior_logprobs=torch.zeros(n, width), rewards=torch.arange(n, dtype=torch.float32),
        versions=torch.arange(groups), prompt_width=2, group_size=size, batch_ids=torch.arange(groups),
        prompt_ids=torch.arange(groups),
    )  # fmt: skip
    shares = batch.shards(2)
    order = torch.cat([s.update_positions for s in shares])  # (B,) update index of each share's groups
    assert sorted(order.tolist()) == list(range(groups))
    rows = (order[:, None] * size + torch.arange(size)).flatten()
    assert torch.equal(torch.cat([s.rewards for s in shares]), batch.rewards[rows])
    assert torch.equal(torch.cat([s.versions for s in shares]), batch.versions[order])
    for share in shares:
        assert share.num_groups == 2
        assert share.total_rows == n and share.total_tokens == int(mask.sum())
        assert share.groups_slice(0, 1).total_rows == n  # micro-batches of a share keep them too
    assert batch.total_rows == n and batch.total_tokens == int(mask.sum())
    with pytest.raises(ValueError, match="4 groups cannot be split evenly over 3 ranks"):
        batch.shards(3)


SLOW_RANK0 = '''
from __future__ import annotations

import time
from collections.abc import Sequence

import lightning.pytorch as pl
from lit_gmc.data.tasks.addition import Addition


class SlowAddition(Addition):
    """Addition whose first scoring (rank 0, inside the first batch's FIFO fill) takes `seconds` longer."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__()
        self.seconds, self.scored = seconds, False

    def score(self, completions: Sequence[str], answer: str) -> list[float]:
        if not self.scored:
            self.scored = True
            time.sleep(self.seconds)
        return super().score(completions, answer)


class SlowRank0(pl.Callback):
    """Rank 0 busy (as in an evaluation) before update `before` and after update `after` (a checkpoint step)."""

    def __init__(self, seconds: float, before: int, after: int) -> None:
        self.seconds, self.before, self.after = seconds, before, after

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 0 and trainer.global_step == self.before:
            time.sleep(self.seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0 and trainer.global_step == self.after:
            time.sleep(self.seconds)
'''


def test_ranks_wait_for_a_slow_rank_0_beyond_the_strategy_timeout(tmp_path, single_process_runs):
    """Rank 0 busy for longer than --trainer.strategy.timeout three times: the first batch, before an update and
    after one that is checkpointed. The other rank waits on the long-timeout channel and the run is the
    single-process run. (Before the channel, rank 1 timed out in scatter_object_list during the first batch.)"""
    (tmp_path / "slow_rank0.py").write_text(SLOW_RANK0)
    timeout, slow = 8, 12
    busy = {"class_path": "slow_rank0.SlowRank0", "init_args": {"seconds": slow, "before": 5, "after": 2 * EVERY}}
    config = write_config(tmp_path, "slow", total=TOTAL, every=EVERY, batch_prompts=4, extra_callbacks=[busy])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    args = (
        *MICRO, "--model.correction", "GMC", "--data.task", "slow_rank0.SlowAddition",
        "--data.task.seconds", str(slow), "--trainer.strategy", "lightning.pytorch.strategies.DDPStrategy",
        "--trainer.strategy.timeout", f"0:00:{timeout:02d}",
    )  # fmt: skip
    started = time.monotonic()
    # Both ranks started at once, clients of a store this test hosts: with Lightning's own launcher, rank 1 starts
    # later and the rendezvous, under the same short timeout, would fail before any of this is tested.
    ranks = Ranks(config, *args, logs=tmp_path, env=env)
    assert ranks.wait(timeout=400) == [0, 0], ranks.stderr()[-3000:] + ranks.stderr(1)[-3000:]
    assert time.monotonic() - started > 3 * slow
    assert_reproduces(tmp_path / "slow", single_process_runs["gmc"])


def gather_shares(rank: int, init: str, batch: RolloutBatch, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    share = batch.shards(2)[rank]
    rows = {"rewards": share.rewards, "lengths": share.response_mask.sum(-1)}
    gathered = gather_groups(rows, share.update_positions, share.group_size)
    if rank == 0:
        torch.save({**gathered, "positions": [s.update_positions.tolist() for s in batch.shards(2)]}, out)
    dist.destroy_process_group()


def test_gathered_rows_of_balanced_shares_are_in_the_update_s_order(tmp_path):
    torch.manual_seed(0)
    groups, size, width = 6, 3, 9
    n = groups * size
    lengths = torch.tensor([9, 8, 1, 1, 2, 1]).repeat_interleave(size)  # (N,) the long groups first: 72 vs 30 tokens
    mask = torch.arange(width)[None, :] < lengths[:, None]
    batch = RolloutBatch(
        input_ids=torch.zeros(n, 2 + width, dtype=torch.long),
        attention_mask=torch.cat([torch.ones(n, 2, dtype=torch.bool), mask], 1), response_mask=mask,
        behavior_logprobs=torch.zeros(n, width), rewards=torch.randn(n), versions=torch.arange(groups),
        prompt_width=2, group_size=size, batch_ids=torch.arange(groups), prompt_ids=torch.arange(groups),
    )  # fmt: skip
    out = tmp_path / "gathered.pt"
    init = f"file://{tmp_path / 'store'}"
    torch.multiprocessing.start_processes(gather_shares, args=(init, batch, str(out)), nprocs=2, start_method="fork")
    got = torch.load(out)
    assert got["positions"] == [[0, 2, 3], [1, 4, 5]]  # 51 tokens each
    assert torch.equal(got["rewards"], batch.rewards) and torch.equal(got["lengths"], lengths)


def test_the_cli_knows_the_fsdp2_strategy():
    assert StrategyRegistry["fsdp2"]["strategy"] is FSDP2Strategy  # registered by importing lit_gmc.module
